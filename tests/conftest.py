from pathlib import Path

import pytest
import torch

from tiny_checkpoints import KINDS, write_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(kind) -> (folder, transformers model); each kind is written once per session."""
    made: dict[str, tuple[Path, object]] = {}

    def get(kind: str):
        if kind not in made:
            folder = tmp_path_factory.mktemp(kind)
            made[kind] = (folder, write_checkpoint(kind, folder))
        return made[kind]

    return get


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.inference_mode():
        yield


ALL_KINDS = list(KINDS)
