"""ModelConfig: the few numbers that define a Llama / Qwen2 / Qwen3 transformer, read from config.json."""

import json
from dataclasses import dataclass
from pathlib import Path

from models.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling: long wavelengths are slowed down by `factor`, short ones kept."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama when attention_bias is set
    o_bias: bool  # Llama's attention_bias also covers the output projection
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head's q and k, before RoPE
    rope_scaling: RopeScaling | None = None

    @property
    def group_size(self) -> int:
        """Query heads per KV head: query head h reads KV head h // group_size."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                f"unsupported model_type {model_type!r} in config.json; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _reject_sliding_window(raw, model_type)
        n_heads = raw["num_attention_heads"]
        n_kv_heads = raw.get("num_key_value_heads") or n_heads
        if n_heads % n_kv_heads:
            raise UserError(f"config.json: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv_heads}")
        qkv_bias, o_bias, mlp_bias = _biases(raw, model_type)
        rope_theta, rope_scaling = _read_rope(raw)
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            n_layers=raw["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // n_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=model_type == "qwen3",
            rope_scaling=rope_scaling,
        )

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(raw)
        except KeyError as e:
            raise UserError(f"{path} has no {e.args[0]!r} field, which a {raw.get('model_type')} config needs") from None


def _biases(raw: dict, model_type: str) -> tuple[bool, bool, bool]:
    """(qkv, output, mlp) biases, chosen per architecture as transformers builds each one."""
    attention_bias = bool(raw.get("attention_bias", False))
    if model_type == "llama":
        return attention_bias, attention_bias, bool(raw.get("mlp_bias", False))
    if model_type == "qwen2":
        return True, False, False
    if model_type == "qwen3":
        return attention_bias, attention_bias, False
    return False, False, False  # mistral


def _read_rope(raw: dict) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling; transformers 5 nests both in `rope_parameters`, older files use the top level."""
    params = raw.get("rope_parameters") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise UserError(f"config.json asks for RoPE scaling {rope_type!r}; only 'llama3' scaling is supported")
    return theta, RopeScaling(
        factor=scaling["factor"],
        low_freq_factor=scaling["low_freq_factor"],
        high_freq_factor=scaling["high_freq_factor"],
        original_max_position_embeddings=scaling["original_max_position_embeddings"],
    )


def _reject_sliding_window(raw: dict, model_type: str) -> None:
    # Qwen configs carry a sliding_window value that is only used when use_sliding_window is true.
    uses_window = raw.get("use_sliding_window", False) if model_type.startswith("qwen") else raw.get("sliding_window") is not None
    if uses_window:
        raise UserError("config.json enables sliding-window attention, which this engine does not implement")
