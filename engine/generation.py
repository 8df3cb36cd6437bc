"""The generation loop: one cache, one prefill, then one decode step per token."""

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from compression.config import CompressionConfig
from compression.manager import CompressionManager, CompressionStats
from engine.cuda_graph import capture_decode_step
from engine.decode import decode_step, prefill
from engine.kv_cache import KVCache
from engine.sampling import SamplingConfig, sample
from models.errors import UserError
from models.transformer import Transformer


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # per row, the generated ids, EOS excluded
    prompt_tokens: int  # summed over rows
    prefill_s: float
    decode_s: float
    decode_steps: int
    kv_cache_bytes: int
    compression: CompressionStats | None = None

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def check_lengths(model: Transformer, prompts: list[list[int]], max_new_tokens: int) -> None:
    limit = model.config.max_position_embeddings
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("every prompt must have at least one token")
    if max_new_tokens < 1:
        raise UserError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > limit:
        raise UserError(
            f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the model's maximum of {limit} positions; "
            "shorten the prompt or lower --max-new-tokens"
        )


# Vector width of the CPU kernels torch chose for this process (ATEN_CPU_CAPABILITY can lower it).
SIMD_BITS = {"AVX512": 512, "AVX2": 256}


def compile_decode_step(device: torch.device) -> Callable[..., torch.Tensor]:
    """The decode step as one compiled graph. On CPU its host code is C++ (inductor's
    cpp_wrapper), which calls the step's ~300 kernels without Python in between.

    On CPU the generated code's vector width is set to that of torch's own kernels. Inductor
    follows ATEN_CPU_CAPABILITY by itself, but its on-disk cache does not key on it: a step
    compiled under the AVX-512 kernels was reused under AVX2 and emitted wrong tokens. A width
    given as an option is part of the cache key."""
    options: dict[str, object] = {"cpp_wrapper": device.type == "cpu"}
    simd_bits = SIMD_BITS.get(torch.backends.cpu.get_cpu_capability())
    if device.type == "cpu" and simd_bits is not None:
        options["cpp.simdlen"] = simd_bits
    return torch.compile(decode_step, fullgraph=True, options=options)


def generate(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: frozenset[int],
    sampling: SamplingConfig = SamplingConfig(),
    compile: bool = False,
    on_tokens: Callable[[list[int | None]], None] | None = None,
    compression: CompressionConfig = CompressionConfig(),
    cuda_graph: bool = False,
) -> GenerationResult:
    """Generate for a batch of prompts (any lengths). on_tokens receives, after every step, each
    row's new token, or None for a row that has finished. With a compression policy the cache
    holds the prompt + budget_max + window slots only, and is compacted whenever it is full."""
    check_lengths(model, prompts, max_new_tokens)
    device = model.embed.weight.device
    B = len(prompts)
    n_slots = compression.slots_needed(max(len(p) for p in prompts), max_new_tokens)
    cache = KVCache.allocate(model.config, B, n_slots, model.embed.weight.dtype, device)
    manager = None
    if compression.enabled:
        manager = CompressionManager(compression, cache, model.config.n_heads, model.rope_cos, model.rope_sin)
    if cuda_graph and device.type != "cuda":
        raise UserError("CUDA graphs need the model on a CUDA device; drop --cuda-graph or use --device cuda")
    eos = torch.tensor(sorted(eos_ids) or [-1], device=device)

    start = time.perf_counter()
    logits = prefill(model, cache, prompts, compression=manager)
    tokens = sample(logits, sampling)
    finished = torch.isin(tokens, eos)
    new_tokens = tokens.tolist()  # the host sync that ends prefill
    prefill_s = time.perf_counter() - start

    step = compile_decode_step(device) if compile else decode_step
    advance = partial(step, model, cache, tokens, finished, eos, sampling, manager)
    if cuda_graph and max_new_tokens > 1:
        state = [cache.length, cache.position, tokens, finished] + ([manager.query_slot] if manager else [])
        advance = capture_decode_step(advance, state)

    # Eager, each step attends over the slots that can be in use, a bound the host knows: any
    # size costs nothing. A compiled step or a CUDA graph reads the whole buffer: one shape,
    # one compile. A compressed cache is small already, and its lengths shrink on the device.
    bound_reads = not (compile or cuda_graph or manager is not None)
    longest = max(len(p) for p in prompts)
    generated: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    steps = 0
    start = time.perf_counter()
    while True:
        emitted: list[int | None] = []
        for row, token in enumerate(new_tokens):
            done[row] = done[row] or token in eos_ids
            if done[row]:
                emitted.append(None)
            else:
                generated[row].append(token)
                emitted.append(token)
        if on_tokens is not None:
            on_tokens(emitted)
        if all(done) or steps + 1 == max_new_tokens:
            break
        if bound_reads:
            advance(n_read=longest + steps + 1)
        elif compile and steps > 0:
            # The first call checked the compiled step's guards against these very objects, and
            # nothing the guards read changes between steps (only tensor values do): checking
            # them again cost 1.5-1.9 ms of a 30-35 ms SmolLM2 step. With several compiled
            # versions in the process, torch still checks what tells them apart.
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                advance()
        else:
            advance()
        if manager is not None:
            manager.after_step()
        steps += 1
        new_tokens = tokens.tolist()
    decode_s = time.perf_counter() - start
    stats = manager.stats if manager is not None else None
    return GenerationResult(generated, sum(map(len, prompts)), prefill_s, decode_s, steps, cache.nbytes, stats)
