"""ModelConfig: the few numbers that define a Llama / Mistral / Qwen2 / Qwen3 transformer, read from config.json."""

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling from config.json: its type and the parameters of that type (models/rope.py computes
    them); the parameters of the other types keep their defaults."""

    rope_type: str  # one of ROPE_TYPES but "default"
    factor: float
    original_max_position_embeddings: int  # the context the model was trained on; linear does not use it
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float = 32.0  # yarn: pairs turning more often than this over the trained context are kept
    beta_slow: float = 1.0  # yarn: pairs turning less often than this are interpolated
    truncate: bool = True  # yarn: round the ramp's ends to whole pairs
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn, longrope: cos and sin are scaled by it; None: from factor
    short_factor: tuple[float, ...] | None = None  # longrope: one per pair, within the trained context
    long_factor: tuple[float, ...] | None = None  # longrope: one per pair, beyond it


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # the positions the engine serves: its RoPE tables' length
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama when attention_bias is set
    o_bias: bool  # Llama's attention_bias also covers the output projection
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head's q and k, before RoPE
    rope_scaling: RopeScaling | None = None

    @classmethod
    def from_dict(cls, raw: object, source: str = "config.json") -> "ModelConfig":
        """The config of raw, config.json's parsed contents; errors name the file as `source`."""
        if not isinstance(raw, dict):
            raise UserError(f"{source} holds {_json_kind(raw)}, not an object of named fields; it is not a model config")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                f"unsupported model_type {model_type!r} in {source}; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        fields = _Fields(raw, source, needed_by=f"a {model_type} config")
        _reject_sliding_window(fields, model_type)
        n_heads = fields.integer("num_attention_heads")
        hidden_size = fields.integer("hidden_size")
        n_kv_heads = fields.integer("num_key_value_heads", n_heads)
        if n_heads % n_kv_heads:
            raise UserError(f"{source}: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv_heads}")
        head_dim = fields.integer("head_dim", hidden_size // n_heads)
        qkv_bias, o_bias, mlp_bias = _biases(fields, model_type)
        max_positions = fields.integer("max_position_embeddings", 4096)
        rope_theta, rope_scaling = _read_rope(fields, head_dim, max_positions)
        if rope_scaling is not None and rope_scaling.rope_type == "dynamic":
            # Dynamic NTK exists to run past the trained context, which transformers reads from
            # max_position_embeddings; how far is the factor ("a factor of x handles x times the original length").
            max_positions = int(rope_scaling.factor * max_positions)
        return cls(
            model_type=model_type,
            vocab_size=fields.integer("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=fields.integer("intermediate_size"),
            n_layers=fields.integer("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=fields.number("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=max_positions,
            tie_word_embeddings=fields.flag("tie_word_embeddings", False),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=model_type == "qwen3",
            rope_scaling=rope_scaling,
        )

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:  # cut short, or not text at all
            raise UserError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw, str(path))


class _Required:
    """The default of a field that must be present."""


_REQUIRED = _Required()


@dataclass(frozen=True)
class _Fields:
    """One JSON object of config.json, read field by field with the type the engine needs. JSON null counts
    as absent. A missing required field, or a value of another type, is one UserError that names the file, the
    field, what it holds and what was expected: never a TypeError deep inside the model later."""

    raw: dict
    source: str  # the file, for messages
    needed_by: str  # what a required field is missing for, e.g. "a llama config"
    prefix: str = ""  # the enclosing field, e.g. "rope_scaling."

    def _value(self, name: str, default: object) -> object:
        value = self.raw.get(name)
        if value is None and default is _REQUIRED:
            raise UserError(f"{self.source} has no {self.prefix + name!r} field, which {self.needed_by} needs")
        return value

    def _wrong(self, name: str, value: object, expected: str) -> UserError:
        shown = json.dumps(value, default=repr)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return UserError(
            f"{self.source}: field {self.prefix + name!r} holds {shown} ({_json_kind(value)}), "
            f"but must be {expected}; correct it in that file"
        )

    def _typed(self, name: str, default: object, accepts: Callable[[object], bool], expected: str) -> object:
        value = self._value(name, default)
        if value is None:
            return default
        if not accepts(value):
            raise self._wrong(name, value, expected)
        return value

    def integer(self, name: str, default: int | _Required = _REQUIRED) -> int:
        """A positive integer: every integer of a model config is a count or a size."""
        return self._typed(name, default, _is_count, "a positive integer")

    def number(self, name: str, default: float | None | _Required = _REQUIRED) -> float | None:
        value = self._typed(name, default, _is_number, "a number")
        return None if value is None else float(value)

    def flag(self, name: str, default: bool) -> bool:
        return self._typed(name, default, lambda v: isinstance(v, bool), "true or false")

    def text(self, name: str, default: str) -> str:
        return self._typed(name, default, lambda v: isinstance(v, str), "a string")

    def numbers(self, name: str, count: int) -> tuple[float, ...]:
        """A list of exactly `count` numbers (required)."""
        value = self._value(name, _REQUIRED)
        if not isinstance(value, list) or not all(_is_number(x) for x in value) or len(value) != count:
            raise self._wrong(name, value, f"a list of {count} numbers, one per pair of the head's {2 * count} dimensions")
        return tuple(float(x) for x in value)

    def nested(self, name: str) -> "_Fields | None":
        """The JSON object in field `name`; None when it is absent, null or empty."""
        value = self._value(name, None)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self._wrong(name, value, "an object {...} or null")
        return _Fields(value, self.source, self.needed_by, prefix=f"{self.prefix}{name}.") if value else None


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # JSON true is no number


def _json_kind(value: object) -> str:
    """What a parsed JSON value is, in JSON's words."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    kinds = {float: "a number", str: "a string", list: "a list", dict: "an object", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def _biases(fields: _Fields, model_type: str) -> tuple[bool, bool, bool]:
    """(qkv, output, mlp) biases, chosen per architecture as transformers builds each one."""
    attention_bias = fields.flag("attention_bias", False)
    if model_type == "llama":
        return attention_bias, attention_bias, fields.flag("mlp_bias", False)
    if model_type == "qwen2":
        return True, False, False
    if model_type == "qwen3":
        return attention_bias, attention_bias, False
    return False, False, False  # mistral


def _read_rope(fields: _Fields, head_dim: int, max_positions: int) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling; transformers 5 nests both in `rope_parameters`, older files use the top level."""
    params = fields.nested("rope_parameters")
    theta = fields.number("rope_theta", 10000.0)
    if params is not None:
        theta = params.number("rope_theta", theta)
    scaling = fields.nested("rope_scaling") or params
    if scaling is None:
        return theta, None
    rope_type = scaling.text("rope_type", scaling.text("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_TYPES:
        raise UserError(
            f"{fields.source} asks for RoPE scaling {rope_type!r}, which this engine does not implement; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    scaling = replace(scaling, needed_by=f"{rope_type!r} RoPE scaling")
    if rope_type in ("linear", "dynamic"):
        # Linear has no use for the trained context; dynamic reads it from max_position_embeddings, as transformers does.
        return theta, RopeScaling(rope_type, scaling.number("factor"), max_positions)
    # transformers gives a top-level original_max_position_embeddings (Phi-3 files) precedence over the scaling's own.
    original = scaling.integer("original_max_position_embeddings", max_positions)
    original = fields.integer("original_max_position_embeddings", original)
    if rope_type == "llama3":
        return theta, RopeScaling(
            rope_type,
            scaling.number("factor"),
            original,
            low_freq_factor=scaling.number("low_freq_factor"),
            high_freq_factor=scaling.number("high_freq_factor"),
        )
    if rope_type == "yarn":
        return theta, RopeScaling(
            rope_type,
            scaling.number("factor"),
            original,
            # transformers falls back to the paper's 32 and 1 when a beta is absent or 0.
            beta_fast=scaling.number("beta_fast", None) or 32.0,
            beta_slow=scaling.number("beta_slow", None) or 1.0,
            truncate=scaling.flag("truncate", True),
            mscale=scaling.number("mscale", None),
            mscale_all_dim=scaling.number("mscale_all_dim", None),
            attention_factor=scaling.number("attention_factor", None),
        )
    # longrope: Phi-3 files give no factor, only the two context lengths it is the ratio of.
    factor = scaling.number("factor", None)
    return theta, RopeScaling(
        rope_type,
        max_positions / original if factor is None else factor,
        original,
        attention_factor=scaling.number("attention_factor", None),
        short_factor=scaling.numbers("short_factor", head_dim // 2),
        long_factor=scaling.numbers("long_factor", head_dim // 2),
    )


def _reject_sliding_window(fields: _Fields, model_type: str) -> None:
    # Qwen configs carry a sliding_window value that is only used when use_sliding_window is true.
    if model_type.startswith("qwen"):
        uses_window = fields.flag("use_sliding_window", False)
    else:
        uses_window = fields.raw.get("sliding_window") is not None
    if uses_window:
        raise UserError(f"{fields.source} enables sliding-window attention, which this engine does not implement")
