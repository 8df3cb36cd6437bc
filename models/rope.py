"""Rotary position embeddings: the angular speed of each pair of dimensions, the cos/sin tables, the rotation.

Every RoPE scaling that transformers offers Llama and Qwen checkpoints is computed as transformers computes it:
- default: pair i turns at theta^(-2i/D) radians per position;
- linear: every speed divided by the factor, so positions are squeezed into the trained range;
- dynamic (NTK): theta grows with the sequence once it is longer than the trained context;
- yarn: slow pairs interpolated, fast pairs kept, a ramp between; cos and sin scaled by an attention factor;
- longrope: one factor per pair, short ones within the trained context, long ones beyond; an attention factor too;
- llama3: long wavelengths slowed by the factor, short ones kept, a smooth blend between.

Dynamic and longrope depend on the sequence length, which transformers reads as the largest position in the
forward pass + 1. A key keeps the rotation it was cached with, so the frequencies a token gets depend on the
pass it was computed in: see rope_tables and rope_cos_sin.
"""

import math

import torch

from models.config import ModelConfig, RopeScaling


def _pair_exponents(config: ModelConfig) -> torch.Tensor:
    """[D/2] float32: 2i / D for each pair i. Built on the CPU explicitly: the model is created under a meta device."""
    dim = config.head_dim
    return torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim


def _default(config: ModelConfig) -> torch.Tensor:
    """[D/2]: pair i turns at theta^(-2i/D) radians per position."""
    return 1.0 / (config.rope_theta ** _pair_exponents(config))


def _llama3(config: ModelConfig, s: RopeScaling) -> torch.Tensor:
    """[D/2]: wavelengths longer than the trained context / low_freq_factor are slowed by the factor,
    those shorter than context / high_freq_factor are kept, and the ones between are blended smoothly."""
    inv_freq = _default(config)
    wavelength = 2 * math.pi / inv_freq
    context = s.original_max_position_embeddings
    scaled = torch.where(wavelength > context / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    smooth = (context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelength >= context / s.high_freq_factor) & (wavelength <= context / s.low_freq_factor)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(config: ModelConfig, s: RopeScaling) -> torch.Tensor:
    """[D/2]: pairs that turn fewer than beta_slow times over the trained context are interpolated (divided
    by the factor), pairs that turn more than beta_fast times are kept, and a linear ramp blends the ones between."""
    dim, theta = config.head_dim, config.rope_theta
    powers = theta ** _pair_exponents(config)  # [D/2]
    kept, interpolated = 1.0 / powers, 1.0 / (s.factor * powers)

    def pair_turning(turns: float) -> float:
        # The (fractional) pair index whose wavelength fits `turns` times into the trained context.
        return dim * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(s.beta_fast), pair_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of width 0 would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)  # [D/2]
    keep = 1 - ramp
    return interpolated * (1 - keep) + kept * keep


def _dynamic(config: ModelConfig, s: RopeScaling, seq_lens: torch.Tensor) -> torch.Tensor:
    """[N, D/2]: NTK scaling raises theta as the sequence grows past the trained context, so the slow pairs
    stretch over the longer sequence while the fast ones barely move. Within the context, theta is unchanged."""
    dim, context = config.head_dim, s.original_max_position_embeddings
    length = seq_lens.clamp(min=context)  # [N]
    theta = config.rope_theta * (s.factor * length / context - (s.factor - 1)) ** (dim / (dim - 2))  # [N]
    return 1.0 / (theta[:, None] ** _pair_exponents(config)[None, :])


def _longrope(config: ModelConfig, s: RopeScaling, seq_lens: torch.Tensor) -> torch.Tensor:
    """[N, D/2]: each pair's wavelength is stretched by its own factor; the long factors once the sequence
    is longer than the trained context, the short ones until then."""
    powers = config.rope_theta ** _pair_exponents(config)  # [D/2]
    short = 1.0 / (torch.tensor(s.short_factor, dtype=torch.float32, device="cpu") * powers)
    long = 1.0 / (torch.tensor(s.long_factor, dtype=torch.float32, device="cpu") * powers)
    is_long = seq_lens[:, None] > s.original_max_position_embeddings  # [N, 1]
    return torch.where(is_long, long[None, :], short[None, :])


def rope_inverse_frequencies(config: ModelConfig, seq_lens: torch.Tensor) -> torch.Tensor:
    """[N, D/2] float32 angular speeds for sequences of seq_lens [N] tokens (float32, on the CPU).
    Only dynamic and longrope depend on the length; for the other scalings every row is the same."""
    s = config.rope_scaling
    if s is None:
        inv_freq = _default(config)
    elif s.rope_type == "dynamic":
        return _dynamic(config, s, seq_lens)
    elif s.rope_type == "longrope":
        return _longrope(config, s, seq_lens)
    elif s.rope_type == "linear":
        inv_freq = _default(config) / s.factor  # positions squeezed by the factor, as speeds
    elif s.rope_type == "yarn":
        inv_freq = _yarn(config, s)
    else:
        inv_freq = _llama3(config, s)
    return inv_freq[None, :].expand(len(seq_lens), -1)


def attention_factor(s: RopeScaling | None) -> float:
    """What transformers multiplies cos and sin by: yarn and longrope sharpen attention over long contexts
    (both q and k are scaled, so the logits grow by its square). 1 for the other scalings."""
    if s is None or s.rope_type not in ("yarn", "longrope"):
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    if s.rope_type == "longrope":
        return 1.0 if s.factor <= 1 else math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))

    def yarn_scale(m: float) -> float:
        return 1.0 if s.factor <= 1 else 0.1 * m * math.log(s.factor) + 1.0

    # DeepSeek-style configs give both mscales; their ratio replaces the paper's 0.1 ln(factor) + 1.
    if s.mscale and s.mscale_all_dim:
        return yarn_scale(s.mscale) / yarn_scale(s.mscale_all_dim)
    return yarn_scale(1.0)


def depends_on_length(s: RopeScaling | None) -> bool:
    """Whether the frequencies change with the sequence length (dynamic, longrope)."""
    return s is not None and s.rope_type in ("dynamic", "longrope")


def _cos_sin(angles: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., D] of angles [..., D/2], in the rotate-half layout (pair i is dims i and i + D/2)."""
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos() * scale, angles.sin() * scale


def rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, [max_positions, D] float32, attention factor included.

    Row p is what transformers uses for a token decoded alone at position p: for dynamic and longrope, the
    frequencies of a sequence of p + 1 tokens. Decoding a batch, transformers takes the largest position of the
    batch for every row, where this table gives each row its own (the same for a batch of one)."""
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device="cpu")  # [P]
    inv_freq = rope_inverse_frequencies(config, positions + 1)  # [P, D/2]
    return _cos_sin(positions[:, None] * inv_freq, attention_factor(config.rope_scaling))


def rope_cos_sin(
    config: ModelConfig,
    cos_table: torch.Tensor,  # [max_positions, D] from rope_tables
    sin_table: torch.Tensor,  # [max_positions, D]
    positions: torch.Tensor,  # [B, T]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, T, D] float32 for positions. One token per row (decode) reads the tables, with no host
    sync. Several tokens (prefill) with dynamic or longrope get the frequencies of the whole pass, max position
    + 1, as in transformers: the host reads that length, which is fine outside the compiled decode step."""
    if positions.shape[1] == 1 or not depends_on_length(config.rope_scaling):
        return cos_table[positions], sin_table[positions]
    seq_len = torch.tensor([positions.max().item() + 1], dtype=torch.float32, device="cpu")  # [1]
    inv_freq = rope_inverse_frequencies(config, seq_len)[0].to(positions.device)  # [D/2]
    return _cos_sin(positions[..., None].float() * inv_freq, attention_factor(config.rope_scaling))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by cos/sin [B, T, D]; pairs are (i, i + D/2), as in HF checkpoints."""
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
