"""The systems a benchmark compares; each loader runs inside its worker process, loads its model,
does one warm-up run and returns a Loaded whose measure() times one trial.

- engine: engine.generation.generate. TTFT is the time from the call to the first token on the
  host (cache allocation, prefill, and on CUDA the graph capture); decode tok/s = batch * decode
  steps / its decode time, which excludes all of that.
- transformers: AutoModelForCausalLM.generate, greedy, with its default dynamic cache;
- transformers_static: the same with cache_implementation="static".
  generate reports no split of its time, so a streamer notes when its first new tokens arrive:
  TTFT is the time from the call to then, decode tok/s = (N - 1) * batch / the time after it,
  from the same run.
- llama.cpp: llama-cpp-python on a GGUF file, batch 1, as many threads as torch uses. Its own
  eval, one token at a time, greedy by argmax of the logits (no sampler chain): TTFT is the
  prompt's eval and the first argmax, decode tok/s the N - 1 evals that follow.
"""

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmark.machine import matmul_ceiling_tok_s, synchronize
from benchmark.memory import DecodeTraffic, decode_traffic
from benchmark.workers import Loaded
from benchmark.workload import Trial, Workload, dtype_name, progress
from compression.manager import CompressionStats
from engine.options import RunOptions, generate
from kv.paged import PageConfig
from weights.forms import load_model
from weights.sharding import load_rank


@dataclass(frozen=True)
class CompressionCost:
    """What the engine's KV policy cost in the last trial: medians per event, in milliseconds."""

    compactions: int
    compaction_ms: float | None
    refreshes: int
    refresh_ms: float | None  # BeaconKV's FPS refreshes of the beacon queries
    share_of_decode: float  # compactions and refreshes together, over the trial's whole decode time

    @classmethod
    def of(cls, stats: CompressionStats, decode_s: float) -> "CompressionCost":
        def median_ms(seconds: list[float]) -> float | None:
            return statistics.median(seconds) * 1000 if seconds else None

        spent = sum(stats.compaction_s) + sum(stats.refresh_s)
        return cls(stats.compactions, median_ms(stats.compaction_s), len(stats.refresh_s), median_ms(stats.refresh_s), spent / decode_s)


@dataclass(frozen=True)
class EngineExtras:
    """What the engine's worker reports besides its trials."""

    traffic: DecodeTraffic
    matmul_ceiling_tok_s: float | None
    compression: CompressionCost | None  # None without a KV policy


def load_engine(w: Workload, pages: PageConfig | None = None) -> Loaded:
    """The engine on its contiguous cache, or with pages on its paged one."""
    name = "engine" if pages is None else "engine_paged"
    quant = f", weights {w.quant_label}" if w.quant_label else ""
    progress(f"{name}: loading {w.checkpoint} as {dtype_name(w.dtype)} on {w.device}{quant}")
    if w.parallel is None:
        model = load_model(w.checkpoint, w.dtype, w.device, w.quant, w.group_size)
    else:
        model = load_rank(w.checkpoint, w.dtype, w.device, w.parallel, w.quant)
    stats: list[tuple[CompressionStats | None, float]] = []  # per trial, with its decode seconds
    ceilings: list[float] = []

    def measure() -> Trial:
        first_token_at: list[float] = []

        def on_tokens(_: dict[int, int | None]) -> None:
            if not first_token_at:
                first_token_at.append(time.perf_counter())

        start = time.perf_counter()
        with torch.inference_mode():
            result = generate(model, w.prompts, w.new_tokens, eos_ids=frozenset(), on_tokens=on_tokens, options=RunOptions(compile=w.compile, compression=w.compression, cuda_graph=w.device.type == "cuda", pages=pages, kv_dtype=w.kv_dtype))
        stats.append((result.compression, result.decode_s))
        trial = Trial(first_token_at[0] - start, result.decode_tok_s, result.kv_cache_bytes)
        if w.ceiling:  # right after each trial, so that the share compares figures taken together
            ceilings.append(matmul_ceiling_tok_s(model, w.batch))
        return trial

    def extras() -> EngineExtras:
        ceiling = statistics.median(ceilings[1:]) if w.ceiling else None  # the warm-up's is left out, as its trial is
        last, decode_s = stats[-1]
        compression = None if last is None else CompressionCost.of(last, decode_s)
        return EngineExtras(decode_traffic(model, w.batch, w.prompt_len, w.new_tokens, w.kv_dtype), ceiling, compression)

    progress(f"{name}: warm-up run" + (", which compiles the decode step" if w.compile else ""))
    measure()
    return Loaded(measure, extras)


class FirstTokenClock:
    """A streamer for transformers' generate that notes when the first new tokens arrive: its
    first put is the prompt, its second the first generated tokens. One run then gives both the
    time to first token and the decode rate after it."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at = 0.0

    def put(self, _: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def load_transformers(w: Workload, static: bool) -> Loaded:
    import transformers  # only the transformers processes pay for importing it

    transformers.logging.set_verbosity_error()  # generation-config advice, not results
    name = "transformers_static" if static else "transformers"
    progress(f"{name}: loading {w.peer_checkpoint or w.checkpoint} as {dtype_name(w.dtype)} on {w.device}")
    model = transformers.AutoModelForCausalLM.from_pretrained(w.peer_checkpoint or w.checkpoint, dtype=w.dtype).to(w.device).eval()
    ids = torch.tensor(w.prompts, device=w.device)
    options: dict[str, Any] = dict(attention_mask=torch.ones_like(ids), do_sample=False, return_dict_in_generate=True)
    if static:
        options["cache_implementation"] = "static"

    def measure() -> Trial:
        clock = FirstTokenClock()
        synchronize(w.device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=w.new_tokens, min_new_tokens=w.new_tokens, streamer=clock, **options)
        synchronize(w.device)
        end = time.perf_counter()
        kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in out.cache.layers)
        return Trial(clock.first_token_at - start, (w.new_tokens - 1) * w.batch / (end - clock.first_token_at), kv_bytes)

    progress(f"{name}: warm-up run")
    measure()
    return Loaded(measure, lambda: None)


def load_llama_cpp(w: Workload) -> Loaded:
    import numpy as np
    from llama_cpp import Llama  # only the llama.cpp process imports it

    from weights.loader import read_config

    threads = torch.get_num_threads()
    progress(f"llama.cpp: loading {w.gguf} with {threads} threads")
    n_ctx = w.prompt_len + w.new_tokens
    # n_batch = n_ctx: llama-cpp-python keeps n_batch rows of logits, indexed by position.
    llm = Llama(model_path=str(w.gguf), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    config = read_config(w.checkpoint)
    kv_bytes = 2 * config.n_layers * config.n_kv_heads * config.head_dim * n_ctx * 2  # K and V, float16, every slot

    def next_token() -> int:
        return int(np.argmax(llm.scores[llm.n_tokens - 1]))

    def measure() -> Trial:
        llm.reset()
        start = time.perf_counter()
        llm.eval(w.prompts[0])
        token = next_token()
        first = time.perf_counter()
        for _ in range(w.new_tokens - 1):
            llm.eval([token])
            token = next_token()
        return Trial(first - start, (w.new_tokens - 1) / (time.perf_counter() - first), kv_bytes)

    progress("llama.cpp: warm-up run")
    measure()
    return Loaded(measure, lambda: None)
