"""Results are saved after every cell of a long run: whole, or not at all."""

import os
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Write the file through a temporary one, so that a run killed while it saves keeps the
    previous version (which it resumes from) instead of a truncated one."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)
