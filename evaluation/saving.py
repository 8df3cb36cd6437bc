"""Results are saved after every cell of a long run, whole or not at all, and resumed only
under the settings they were measured with."""

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from compression.config import CompressionConfig
from evaluation.config import VARIANT_OPTIONS
from errors import UserError


def write_atomically(path: Path, text: str) -> None:
    write_atomically_with(path, lambda partial: partial.write_text(text))


def write_atomically_with(path: Path, write: Callable[[Path], None]) -> None:
    """Write the file through a temporary one, so that a run killed while it saves keeps the
    previous version (which it resumes from) instead of a truncated one."""
    partial = path.with_name(path.name + ".partial")
    write(partial)
    os.replace(partial, path)


def rounding() -> dict:
    """What decides how a run's floats round besides its settings: the thread count, and the CPU
    kernels torch picked (bfloat16 products round otherwise on AVX2 than on AVX-512). Cells of
    two such runs can differ where no setting does, so they must not resume or merge into one
    table, nor pair with the other's full cache."""
    return {"threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def kernels_text(config: dict) -> str:
    """The CPU kernels a run rounded with, for its report's settings line (earlier runs did not record them)."""
    return f", CPU kernels: {config['cpu_capability']}" if "cpu_capability" in config else ""


def beacon_defaults() -> dict:
    """BeaconKV's options as policy "beacon" runs them: cells of another version of BeaconKV
    (v1 scored with heads_agree 1) must not resume into this one's table."""
    defaults = CompressionConfig()
    return {name: getattr(defaults, name) for name in VARIANT_OPTIONS}


def check_resumable(saved: dict, settings: dict) -> None:
    """One clear error when the saved results were measured with other settings than this run's
    (only the output folder may differ): cells of two settings must never mix."""
    differ = sorted(k for k in settings if k != "out" and saved.get(k) != settings[k])
    if differ:
        raise UserError(f"{settings['out']} holds results measured with other settings ({', '.join(differ)}); pass --restart to overwrite them, or another --out")


@contextmanager
def sole_writer(folder: Path) -> Iterator[None]:
    """Hold a lock on the results folder for a whole run: a second run writing there would mix
    its cells with this one's, or overwrite them. The lock goes with the process."""
    folder.mkdir(parents=True, exist_ok=True)
    handle = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another evaluate.py is writing to {folder}; wait for it to finish, or pass another --out") from None
        yield
    finally:
        os.close(handle)
