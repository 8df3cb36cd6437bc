"""A run's features in one object, and the session they make: the cache kind (paged, quantized,
flash-attn on CUDA), the KV policy with its store, the runner (compiled, a CUDA graph), and
speculative decoding.

The core (engine/generation.py) runs any cache kind, policy and runner it is handed; this is the
one place that picks them from the options the scripts parse.
"""

from dataclasses import dataclass
from functools import partial

from compression.config import CompressionConfig
from compression.manager import CompressionManager, PerRowManagers, new_store
from engine.compile import Compiled
from engine.cuda_graph import Graph
from engine.generation import Eager, GenerationResult, OnTokens, Session, check_lengths, run
from engine.sampling import RowSampling, SamplingConfig
from engine.saved_step import Saved
from engine.speculative import Speculation, speculate
from errors import UserError
from kv import KV_CHANNEL_CODES
from kv.cache import KVCache
from kv.flash import FlashKVCache
from kv.paged import PageConfig, PagedKVCache
from kv.key_bias import model_key_bias
from kv.contiguous import contiguous_cache
from kv.quantized import kv_storage
from models.transformer import Transformer


@dataclass(frozen=True)
class RunOptions:
    compile: bool = False  # the decode step's blocks compiled (engine/compile.py)
    cuda_graph: bool = False  # the decode step captured as a CUDA graph and replayed (engine/cuda_graph.py)
    compression: CompressionConfig = CompressionConfig()  # a KV policy, and its store
    pages: PageConfig | None = None  # a paged cache (kv/paged.py); None: contiguous
    kv_dtype: str = "auto"  # how the cache stores keys and values (kv/quantized.py: kv_storage)
    speculation: Speculation | None = None  # drafts verified several at a time (engine/speculative.py), one prompt
    prefix_cache: bool = False  # continuous batching: prompts share the cached blocks they begin with (kv/prefix_cache.py)


def new_cache(model: Transformer, batch: int, n_slots: int, options: RunOptions) -> KVCache | PagedKVCache:
    """The cache kind the options ask for, `batch` rows of up to n_slots slots."""
    dtype, bits, group = kv_storage(options.kv_dtype, model.dtype)
    if options.kv_dtype in KV_CHANNEL_CODES:
        check_keeps_every_slot(options)
    if options.pages is not None:
        return PagedKVCache.allocate(model.config, batch, n_slots, dtype, model.device, options.pages, bits=bits, group=group, key_bias=partial(model_key_bias, model, device=model.device))
    if bits is None and model.device.type == "cuda":
        return FlashKVCache.allocate(model.config, batch, n_slots, dtype, model.device)
    return contiguous_cache(model, batch, n_slots, options.kv_dtype, model.device)


def check_keeps_every_slot(options: RunOptions) -> None:
    """Keys per channel over blocks of slots (kv/channel_keys.py) stay where they were written:
    one clear error for what would move them or take them back."""
    asked = {"a KV policy (--kv-policy)": options.compression.enabled, "the paged cache (--paged, --max-batch)": options.pages is not None, "--speculate": options.speculation is not None}
    for what, given in asked.items():
        if given:
            raise UserError(f"--kv-dtype {options.kv_dtype} keeps keys per channel over blocks of slots, which {what} would move or take back; use per-slot codes (e.g. --kv-dtype int3 or k4v3) with it, or drop it")


def new_policy(model: Transformer, cache: KVCache | PagedKVCache, options: RunOptions, per_row: bool = False) -> CompressionManager | PerRowManagers | None:
    """The KV policy over the cache (per_row: one schedule per row, for rows that join at different steps), or None."""
    compression = options.compression
    if not compression.enabled:
        return None
    store = new_store(model.config, cache.length.shape[0], compression, model.dtype, model.device)
    kind = PerRowManagers if per_row else CompressionManager
    return kind(compression, cache, model.config.n_heads, model.rope_cos, model.rope_sin, store)


def new_runner(model: Transformer, options: RunOptions) -> Eager | Compiled | Graph:
    if options.cuda_graph and model.device.type != "cuda":
        raise UserError("CUDA graphs need the model on a CUDA device; drop --cuda-graph or use --device cuda")
    if options.cuda_graph:
        return Graph(compile=options.compile)
    return Compiled() if options.compile else Eager()


def open_session(
    model: Transformer, batch: int, n_slots: int, options: RunOptions, *, eos_ids: frozenset[int], sampling: SamplingConfig | RowSampling = SamplingConfig()
) -> Session:
    """A session of `batch` rows of up to n_slots slots, made as the options say."""
    runner = new_runner(model, options)
    cache = new_cache(model, batch, n_slots, options)
    policy = new_policy(model, cache, options)
    if isinstance(runner, Compiled) and model.device.type == "cpu" and type(cache) is KVCache and policy is None and type(model) is Transformer:
        runner = Saved()  # the plain step on CPU: a package saved once, loaded in milliseconds (engine/saved_step.py)
    return Session(model, cache, eos_ids=eos_ids, sampling=sampling, policy=policy, runner=runner)


def generate(
    model: Transformer, prompts: list[list[int]], max_new_tokens: int, *, eos_ids: frozenset[int], sampling: SamplingConfig = SamplingConfig(),
    on_tokens: OnTokens | None = None, options: RunOptions = RunOptions(), n_slots: int | None = None,
) -> GenerationResult:
    """Generate for a batch of prompts (any lengths), as the options say. With a KV policy the
    cache holds the prompt + budget_max + window slots only, and is compacted whenever it is full.
    n_slots sizes the cache's rows (default: what this run needs), so that runs of several sizes
    can share one shape, hence one CUDA graph."""
    check_lengths(model, prompts, max_new_tokens)
    needed = options.compression.slots_needed(max(len(p) for p in prompts), max_new_tokens)
    if n_slots is not None and n_slots < needed:
        raise ValueError(f"this run needs {needed} slots per row, more than the {n_slots} asked for")
    session = open_session(model, len(prompts), needed if n_slots is None else n_slots, options, eos_ids=eos_ids, sampling=sampling)
    if options.speculation is not None:
        return speculate(session, prompts[0], max_new_tokens, options.speculation, on_tokens)
    return run(session, prompts, max_new_tokens, on_tokens)
