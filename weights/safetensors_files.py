"""A checkpoint's safetensors files: which they are (one file, or the shards its index names), and
each opened for reading, with one clear error for a file that is missing, cut short or damaged."""

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from errors import UserError

INDEX = "model.safetensors.index.json"
# The files of a checkpoint folder the engine makes (a GGUF import), and the dtypes it saves weights in.
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
SAVED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What to do about a damaged file of a checkpoint.
FETCH_AGAIN = "download or copy it again (a folder imported from a GGUF file: delete it and import it again)"


def read_weight_map(checkpoint: Path) -> dict[str, str] | None:
    """Tensor name -> shard file, from the index of a sharded checkpoint; None for a single file."""
    index = checkpoint / INDEX
    if not index.is_file():
        return None
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except ValueError as e:  # not JSON, or not UTF-8 text
        raise UserError(f"{INDEX} in {checkpoint} is damaged (not valid JSON: {e}); {FETCH_AGAIN}") from e
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
        raise UserError(f'{INDEX} in {checkpoint} is damaged (it has no "weight_map" from tensor names to shard files); {FETCH_AGAIN}')
    return weight_map


def safetensors_files(checkpoint: Path, weight_map: dict[str, str] | None) -> list[Path]:
    if weight_map is not None:
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (checkpoint / s).is_file()]
        if missing:
            raise UserError(f"{checkpoint / INDEX} lists shards that are not in the folder: {', '.join(missing)}")
        return [checkpoint / s for s in shards]
    single = checkpoint / "model.safetensors"
    if single.is_file():
        return [single]
    raise UserError(
        f"{checkpoint} has no model.safetensors or {INDEX}; "
        "the engine reads safetensors weights only (a GGUF file can be imported with python -m weights.gguf)"
    )


def open_safetensors(path: Path) -> safe_open:
    """The file, opened for reading. safe_open checks the whole header against the file's size, so a
    damaged file fails here rather than at get_tensor."""
    try:
        return safe_open(path, framework="pt", device="cpu")
    except SafetensorError as e:
        raise UserError(f"{path.name} in {path.parent} is damaged ({_damage(path, e)}); {FETCH_AGAIN}") from e
    except OSError as e:  # not damage, e.g. no permission to read it
        raise UserError(f"cannot read {path} ({e}); check that the file is readable") from e


def _damage(path: Path, error: SafetensorError) -> str:
    """What is wrong with a file safe_open refused. Most often a download was cut short, which the
    sizes show; anything else is a damaged header, in safetensors' own words."""
    size = path.stat().st_size
    if size < 8:
        return f"it is {size} bytes long, too short to hold a header: cut off during a copy or download?"
    with open(path, "rb") as f:
        header_length = int.from_bytes(f.read(8), "little")
        header = f.read(header_length) if 8 + header_length <= size else b""
    declared = 8 + header_length + (_data_length(header) or 0)
    if declared > size:
        return f"the file is shorter than its header says, {size} of {declared} bytes: cut off during a copy or download?"
    return f"its header is damaged: {str(error).removeprefix('Error while deserializing header: ')}"


def _data_length(header: bytes) -> int | None:
    """How many bytes of tensor data a safetensors header describes; None if it is not a readable header."""
    try:
        entries = json.loads(header)
        return max((int(entry["data_offsets"][1]) for name, entry in entries.items() if name != "__metadata__"), default=0)
    except (ValueError, TypeError, LookupError, AttributeError):  # a damaged header can hold any JSON, or none
        return None
