"""GGUF's 4-bit blocks read straight into the engine's int4 form, with no second quantization.

Every 4-bit type of llama.cpp stores, per block of 32 weights of a row, unsigned values q in 0..15
and an affine map back to floats. Written as (q - 8) * scale + zero, which is what torch's int4
kernels compute (models/quantized.py), each is an int4 group of 32:

- Q4_0: w = d * (q - 8)             -> scale d, zero 0
- Q4_1: w = d * q + m               -> scale d, zero m + 8d
- Q4_K: w = d * sc * q - dmin * mn  -> scale d * sc, zero 8 * d * sc - dmin * mn
  (super-blocks of 256: eight groups of 32, each with a 6-bit sc and mn, packed in 12 bytes)

The layouts follow ggml's block structs (ggml-common.h); the tests check every type against the
`gguf` package's own dequantizer. Any other type has no exact int4 form: weights/gguf.py
--quantized makes it int8 per output channel.
"""

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from models import GGUF_GROUP

from models.quantized import QuantizedWeight

INT4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
GROUP = GGUF_GROUP


def int4_weight(blocks: np.ndarray, kind: Q, shape: tuple[int, int]) -> QuantizedWeight:
    """The weight [N, K] of a tensor's raw blocks ([N, bytes per row] uint8), as int4 groups of 32."""
    N, K = shape
    raw = np.ascontiguousarray(blocks).reshape(N, -1)
    if kind == Q.Q4_K:
        values, scales, zeros = _q4_k(raw.reshape(N, K // 256, 144))
    else:
        values, scales, zeros = _q4_0_or_1(raw.reshape(N, K // GROUP, -1), with_min=kind == Q.Q4_1)
    return QuantizedWeight(
        torch.from_numpy(values.reshape(N, K).astype(np.int8) - 8),
        torch.from_numpy(scales.reshape(N, K // GROUP)),
        torch.from_numpy(zeros.reshape(N, K // GROUP)),
    )


def _half(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields (the last axis, 2 bytes) as float32."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: the low nibbles are the first 16, the high nibbles the next 16."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _q4_0_or_1(raw: np.ndarray, with_min: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks [N, K/32, 18 or 20]: float16 d (and m for Q4_1), then 16 bytes of values."""
    d = _half(raw[..., 0:2])  # [N, K/32]
    if not with_min:
        return _nibbles(raw[..., 2:]), d, np.zeros_like(d)
    m = _half(raw[..., 2:4])
    return _nibbles(raw[..., 4:]), d, m + 8 * d


def _q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Super-blocks [N, K/256, 144]: float16 d and dmin, 12 bytes of 6-bit (sc, mn) x 8, 128 bytes of values."""
    d, dmin = _half(raw[..., 0:2])[..., None], _half(raw[..., 2:4])[..., None]  # [N, K/256, 1]
    packed = raw[..., 4:16].astype(np.uint8)
    low, high = packed[..., 0:4], packed[..., 4:8]  # groups 0-3: sc and mn in the low 6 bits
    tail = packed[..., 8:12]  # groups 4-7: low 4 bits here, high 2 bits in the top bits of low/high
    sc = np.concatenate([low & 63, (tail & 0x0F) | ((low >> 6) << 4)], axis=-1).astype(np.float32)
    mn = np.concatenate([high & 63, (tail >> 4) | ((high >> 6) << 4)], axis=-1).astype(np.float32)
    # 128 bytes = four chunks of 32: the low nibbles are group 2i, the high nibbles group 2i + 1.
    chunks = raw[..., 16:].reshape(*raw.shape[:2], 4, 32)
    values = np.stack([chunks & 0x0F, chunks >> 4], axis=3)  # [N, K/256, 4, 2, 32]
    scales = d * sc
    return values, scales, 8 * scales - dmin * mn
