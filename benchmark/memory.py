"""What a decode step must read, and how much memory a process has held.

Bytes per decode token: every weight once per step (the LM head in full even when it is tied to
the embedding, of which only B rows are read), plus each row's K/V for the cache slots in use,
averaged over the decode, divided by the batch. Achieved GB/s is that times decode tok/s.
The byte count is a model of the traffic no decode step can avoid, not a measurement. The
engine's step (and transformers' static cache) actually run attention over every allocated
slot, masked, so their real traffic is somewhat higher; counting only the slots in use keeps the
figure the same for every system, which is what makes achieved GB/s comparable between them.

Peak memory: on CPU the process's resident high-water mark, which includes Python, torch and,
for the transformers systems, the transformers library (the report's `before loading` shows that
part); on CUDA, torch's peak allocation on the device. Loading a checkpoint stored in another
dtype can set the peak (file pages and converted copies at once); the memory held after the
trials is the steady state.
"""

import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kv import KV_CHANNEL_CODES
from kv.contiguous import contiguous_cache
from models.transformer import Transformer


@dataclass(frozen=True)
class DecodeTraffic:
    batch: int
    weight_bytes: int  # per step: every layer, the final norm, the LM head, and B embedding rows
    kv_bytes_per_slot: int  # per row and slot: K and V over all layers
    mean_slots: float  # slots each row's attention reads, averaged over the decode steps

    @property
    def bytes_per_step(self) -> float:
        return self.weight_bytes + self.batch * self.kv_bytes_per_slot * self.mean_slots

    @property
    def bytes_per_token(self) -> float:
        """One step makes one token per row, so the weights' cost is shared by the batch."""
        return self.bytes_per_step / self.batch


def decode_traffic(model: Transformer, batch: int, prompt_len: int, new_tokens: int, kv_dtype: str = "auto") -> DecodeTraffic:
    """The bytes read by the new_tokens - 1 decode steps that follow a prefill of prompt_len tokens,
    with the cache storing keys and values as kv_dtype says (kv/quantized.py)."""
    config = model.config
    itemsize = model.norm.weight.element_size()  # the activations', which the KV cache and a looked-up row share
    # The LM head is read in full even when it is the embedding table; the table as an embedding
    # is only gathered from, one row per batch row.
    weight_bytes = stored_bytes(model.layers) + stored_bytes(model.norm) + stored_bytes(model.lm_head) + batch * config.hidden_size * itemsize
    # What a whole number of key blocks more costs, per slot: codes and scales included, a cache's
    # fixed part not (kv/channel_keys.py's block still filling), and the same for every storage.
    block = max(group for _, group in KV_CHANNEL_CODES.values())
    size = lambda n_slots: contiguous_cache(model, 1, n_slots, kv_dtype, torch.device("meta")).nbytes
    kv_bytes_per_slot = (size(2 * block) - size(block)) // block
    # Step i (from 0) feeds the token at position prompt_len + i and reads prompt_len + i + 1 slots;
    # over the new_tokens - 1 steps that averages to prompt_len + new_tokens / 2.
    return DecodeTraffic(batch, weight_bytes, kv_bytes_per_slot, prompt_len + new_tokens / 2)


def gguf_traffic(gguf: Path, engine: DecodeTraffic) -> DecodeTraffic:
    """The engine's traffic with llama.cpp's weights: every tensor of the GGUF file once per step,
    except an embedding table that is not also the LM head (one row per batch row is gathered from
    it). Its KV cache is float16, as large as a 16-bit engine's."""
    from gguf import GGUFReader  # only a llama.cpp comparison reads the file

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(gguf).tensors}
    weight_bytes = sum(tensors.values())
    if "output.weight" in tensors:
        weight_bytes -= tensors["token_embd.weight"]
    return DecodeTraffic(engine.batch, weight_bytes, engine.kv_bytes_per_slot, engine.mean_slots)


def stored_bytes(module: torch.nn.Module) -> int:
    """The bytes of a module's weights: its parameters, and the buffers quantized layers keep them in."""
    return sum(t.nbytes for t in module.parameters()) + sum(t.nbytes for t in module.buffers())


def memory_high_water(device: torch.device) -> int:
    """Bytes: the most this process has held so far. CUDA: the most torch allocated on the device.
    CPU: the resident set's high-water mark (Linux VmHWM, which starts afresh with each process
    image; elsewhere ru_maxrss, which may carry over the spawning parent's)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = _proc_status_bytes("VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def memory_in_use(device: torch.device) -> int | None:
    """Bytes this process holds now: torch's allocation on CUDA, the resident set on CPU (None off Linux)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _proc_status_bytes("VmRSS")


def _proc_status_bytes(field: str) -> int | None:
    status = Path("/proc/self/status")
    if not status.is_file():
        return None
    line = next(line for line in status.read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # reported in kB
