"""The KV cache kinds (cache.py is the plain one) and what they are stored in."""

import torch

KV_BITS = {f"{name}{suffix}": (bits, group) for name, bits in ({f"int{n}": (n, n) for n in (8, 4, 3, 2)} | {f"k{k}v{v}": (k, v) for k in (8, 4, 3, 2) for v in (8, 4, 3, 2) if k != v}).items() for suffix, group in (("", 32), ("g64", 64))}  # --kv-dtype codes per slot: ((key bits, value bits), the channels of each group)
KV_CHANNEL_CODES = {f"kc{k}v{v}{suffix}": ((k, v), group) for k in (4, 3, 2) for v in (4, 3, 2) for suffix, group in (("", 32), ("g64", 64))}  # --kv-dtype codes with keys per channel (kv/channel_keys.py): ((key bits, value bits), the slots of each key block and the channels of each value group)
KV_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}  # --kv-dtype floats
STORE_PAGE = 16  # demoted slots per page of the store (kv/store.py): each page has one summary, and is recalled whole
