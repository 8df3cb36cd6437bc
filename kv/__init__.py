"""The KV cache kinds (cache.py is the plain one) and what they are stored in."""

import torch

CODE_BITS = (8, 4, 3, 2)
# --kv-dtype codes: (key bits, value bits). intN stores both in N bits; kNvM keys in N, values in M,
# since keys lose more to fewer bits than values do (docs/quantization.md).
KV_BITS = {f"int{n}": (n, n) for n in CODE_BITS} | {f"k{k}v{v}": (k, v) for k in CODE_BITS for v in CODE_BITS if k != v}
KV_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}  # --kv-dtype floats
STORE_PAGE = 16  # demoted slots per page of the store (kv/store.py): each page has one summary, and is recalled whole
