"""The sampling defaults a checkpoint ships in generation_config.json, read as transformers reads them."""

import json
from pathlib import Path

from errors import UserError

# The fields that choose how tokens are picked, and the value transformers' GenerationConfig
# assumes for each one a file leaves out.
TRANSFORMERS_DEFAULTS: dict[str, float | int | bool] = {
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def sampling_defaults(checkpoint: Path) -> dict[str, float | int] | None:
    """temperature (0 when the file says not to sample), top_k, top_p, min_p and
    repetition_penalty from the checkpoint's generation_config.json; None when the file is
    missing or sets none of these fields."""
    path = checkpoint / "generation_config.json"
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); fix or re-download the checkpoint") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path} holds a {type(raw).__name__}, not a JSON object; fix or re-download the checkpoint")
    if not any(raw.get(name) is not None for name in TRANSFORMERS_DEFAULTS):
        return None
    values = {name: _checked(path, raw, name, default) for name, default in TRANSFORMERS_DEFAULTS.items()}
    return {
        "temperature": values["temperature"] if values["do_sample"] else 0.0,
        "top_k": values["top_k"],
        "top_p": values["top_p"],
        "min_p": values["min_p"],
        "repetition_penalty": values["repetition_penalty"],
    }


def _checked(path: Path, raw: dict, name: str, default: float | int | bool) -> float | int | bool:
    value = raw.get(name)
    if value is None:
        return default
    # bool is an int in Python: a boolean field takes only booleans, a number field no booleans.
    ok = isinstance(value, bool) if isinstance(default, bool) else isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, int) and not isinstance(default, bool):
        ok = ok and float(value).is_integer()
    if not ok:
        expected = "true or false" if isinstance(default, bool) else "an integer" if isinstance(default, int) else "a number"
        raise UserError(f"{path}: {name} is {value!r}, expected {expected}; fix the file or override it with the matching flag")
    return int(value) if isinstance(default, int) and not isinstance(default, bool) else value
