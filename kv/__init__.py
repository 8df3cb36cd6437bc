"""The KV cache kinds (cache.py is the plain one) and what they are stored in."""

import torch

KV_BITS = {"int8": (8, 8), "int4": (4, 4), "k8v4": (8, 4)}  # --kv-dtype codes: (key bits, value bits); keys lose more in 4 bits (docs/quantization.md)
KV_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}  # --kv-dtype floats
STORE_PAGE = 16  # demoted slots per page of the store (kv/store.py): each page has one summary, and is recalled whole
