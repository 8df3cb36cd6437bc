"""Results are saved after every cell of a long run, whole or not at all, and resumed only
under the settings they were measured with."""

import os
from pathlib import Path

from errors import UserError


def write_atomically(path: Path, text: str) -> None:
    """Write the file through a temporary one, so that a run killed while it saves keeps the
    previous version (which it resumes from) instead of a truncated one."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def check_resumable(saved: dict, settings: dict) -> None:
    """One clear error when the saved results were measured with other settings than this run's
    (only the output folder may differ): cells of two settings must never mix."""
    differ = sorted(k for k in settings if k != "out" and saved.get(k) != settings[k])
    if differ:
        raise UserError(f"{settings['out']} holds results measured with other settings ({', '.join(differ)}); pass --restart to overwrite them, or another --out")
