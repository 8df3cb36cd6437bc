"""Command-line helpers shared by generate.py, serve.py, bench.py and evaluate.py: the checkpoint and the form its
weights run in, devices, dtypes, the KV-policy, quantization, paging and tensor-parallel options, sampling
defaults, and an answer's text."""

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from compression.config import AGGREGATIONS, POLICIES, CompressionConfig
from engine.paged_cache import PageConfig, default_block_size
from engine.sampling import SamplingConfig
from engine.stop_strings import StopStrings
from errors import UserError
from models import parallel
from models.config import ModelConfig
from models.flash_attention import why_not_flash
from models.kv_quant import KV_BITS, KV_DTYPES, kv_storage
from models.linear import NATIVE_CPU_MATMUL
from models.parallel import TensorParallel
from models.quantized import GROUP_SIZES, QUANT_MODES
from weights.download import resolve_checkpoint
from weights.loader import stored_dtype, stored_quantized
from weights.tokenizer import StreamDecoder, Tokenizer

# llama-cli's defaults, for checkpoints whose generation_config.json says nothing about sampling.
LLAMA_CPP_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0}
SAMPLING_FIELDS = tuple(LLAMA_CPP_SAMPLING)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
COMPILE_FROM_TOKENS = 512  # from this many tokens a compiled step repays its warm start (docs/performance.md)
DTYPE_HELP = (
    "activations and KV cache. auto: bfloat16 with quantized weights, the bundled model's included, on every CPU kind "
    "(torch's int4 product with float32 activations is 4-5x slower on CPU; docs/performance.md); else the checkpoint's dtype, "
    "bfloat16 for float16 on CPU (whose float16 products are emulated), and float32 for a batch of 2 rows or more on a CPU "
    "without native bfloat16 products (AVX2), where it decodes a batch of 8 2.7x faster"
)


def add_quant_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("quantized weights (weight-only; activations stay in --dtype)")
    g.add_argument(
        "--quant", choices=("auto", *QUANT_MODES), default="auto",
        help="auto: the checkpoint as stored, and the bundled model in its own 4-bit blocks (none: its float copy); "
        "int8: per output channel; int4: per group of --group-size inputs. the embedding and LM head go int8 in both; norms and biases stay in --dtype",
    )
    g.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=32, help="--quant int4: inputs that share one scale and zero")


def checkpoint_and_quant(checkpoint: str | None, quant: str, group_size: int) -> tuple[Path, str]:
    """The checkpoint folder to load, and the quantization load_model applies to it ("none": as stored).

    The bundled SmolLM2's file is 4-bit (Q4_1): by default, and for --quant int4 in groups of its
    own 32, the engine runs those blocks as they are (weights/gguf_blocks.py), so each token reads
    the bytes llama.cpp reads; a float copy of them reads 8 times as many. --quant none gives the
    float copy, --quant int8 that copy in 8 bits. Under torchrun, whose tensor parallelism splits
    16/32-bit weights only, the default is the float copy."""
    if checkpoint is None:
        from weights.gguf_blocks import GROUP  # the GGUF machinery, imported only for the bundled model
        from weights.packaged import smollm2_checkpoint

        own_blocks = parallel.launched_ranks() == 1 and (quant == "auto" or (quant == "int4" and group_size == GROUP))
        return smollm2_checkpoint(quantized=own_blocks), "none" if own_blocks or quant == "auto" else quant
    return resolve_checkpoint(checkpoint), "none" if quant == "auto" else quant


def add_compression_args(p: argparse.ArgumentParser) -> None:
    d = CompressionConfig()
    g = p.add_argument_group("KV-cache compression")
    g.add_argument("--kv-policy", choices=POLICIES, default=d.policy, help="which generated tokens stay in the cache (none: all of them)")
    g.add_argument("--kv-budget", type=int, default=d.budget, help="generated tokens kept by a compaction, the recent window excluded")
    g.add_argument("--kv-hysteresis", type=int, default=d.hysteresis, help="compaction starts when the kept part exceeds budget + this")
    g.add_argument("--kv-window", type=int, default=d.window, help="most recent tokens, never evicted")
    g.add_argument("--n-beacon", type=int, default=d.n_beacon, help="BeaconKV: beacon queries per layer and head")
    g.add_argument("--n-recent", type=int, default=d.n_recent, help="recent queries that score the cache (all policies that use queries)")
    g.add_argument("--kv-aggregation", choices=AGGREGATIONS, default=d.aggregation, help="BeaconKV: how scores combine over queries and the heads of a KV group")
    g.add_argument("--kv-top-m", type=int, default=d.top_m, help="BeaconKV, --kv-aggregation topm: the mean of this many strongest votes")
    g.add_argument("--kv-fps-per-group", action="store_true", help="BeaconKV: one FPS per KV group on its heads' queries side by side, instead of one per query head")
    g.add_argument("--kv-lazy-refresh", action=argparse.BooleanOptionalAction, default=d.lazy_refresh, help="BeaconKV: refresh the beacons once just before each compaction (--no-kv-lazy-refresh: each time the recent ring fills, as v1)")
    g.add_argument("--kv-prefix-budget", type=int, default=d.prefix_budget, help="a long prompt keeps its first 4 and last --kv-prefix-tail tokens and this many of those between, the best the policy scores (0: the whole prompt)")
    g.add_argument("--kv-prefix-tail", type=int, default=d.prefix_tail, help="with --kv-prefix-budget: the prompt's last tokens (the question), kept whole")
    g.add_argument("--kv-heads-agree", type=int, default=d.heads_agree, help="BeaconKV: a key scores its n-th most interested query head of the KV group (1: the best)")
    g.add_argument(
        "--kv-dtype", choices=["auto", *KV_DTYPES, *KV_BITS], default="auto",
        help="how the cache stores keys and values: auto (the model's --dtype), bf16, f16, f32, or int8/int4 codes with a float16 step and minimum per 32 channels of each token; k8v4: keys int8, values int4 (models/kv_quant.py)",
    )
    g.add_argument("--kv-store", type=int, default=d.store_slots, metavar="SLOTS", help="demote what a policy evicts into a store of this many slots (pages of 16), which each decode step recalls from (0: eviction is final)")
    g.add_argument("--kv-store-dtype", choices=[*KV_DTYPES, *KV_BITS], default=d.store_dtype, help="how the store holds keys and values")
    g.add_argument("--kv-recall", type=int, default=d.recall_pages, metavar="PAGES", help="store pages each KV head attends at each step, the pages whose keys can score highest against its queries")


def compression_config(args: argparse.Namespace) -> CompressionConfig:
    return CompressionConfig(
        policy=args.kv_policy,
        budget=args.kv_budget,
        hysteresis=args.kv_hysteresis,
        window=args.kv_window,
        n_beacon=args.n_beacon,
        n_recent=args.n_recent,
        aggregation=args.kv_aggregation,
        top_m=args.kv_top_m,
        heads_agree=args.kv_heads_agree,
        fps_per_group=args.kv_fps_per_group,
        lazy_refresh=args.kv_lazy_refresh,
        prefix_budget=args.kv_prefix_budget,
        prefix_tail=args.kv_prefix_tail,
        seed=args.seed,
        store_slots=args.kv_store,
        store_dtype=args.kv_store_dtype,
        recall_pages=args.kv_recall,
    )


def add_paging_args(p: argparse.ArgumentParser, paged_help: str) -> None:
    g = p.add_argument_group("paged KV cache (engine/paged_cache.py)")
    g.add_argument("--paged", action="store_true", help=paged_help)
    g.add_argument("--block-size", type=int, help="slots per block, a power of two (default: 16; 256 on CUDA with flash-attn, its page size)")
    g.add_argument("--kv-blocks", type=int, help="blocks in the pool (default: every row's longest case, the contiguous cache's memory)")


def page_config(args: argparse.Namespace, device: torch.device, paged: bool) -> PageConfig | None:
    """The paged cache's shape when this run pages its cache (--paged, or continuous batching), else None."""
    if not paged:
        if args.block_size is not None or args.kv_blocks is not None:
            raise UserError("--block-size and --kv-blocks size a paged cache; add --paged (or --max-batch) or drop them")
        return None
    return PageConfig(default_block_size(device) if args.block_size is None else args.block_size, args.kv_blocks)


def compile_pays(device: torch.device, tokens: int | None) -> bool:
    """Whether generate.py compiles the decode step when neither --compile nor --no-compile is
    given: on CPU, for a chat (many answers on one session) or a run that may make
    COMPILE_FROM_TOKENS tokens or more, past which the milliseconds saved per token repay the
    compile's seconds (docs/performance.md); on CUDA the CUDA graph does its job."""
    return device.type == "cpu" and (tokens is None or tokens >= COMPILE_FROM_TOKENS)


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device cuda was requested but this torch ({torch.__version__}) sees no CUDA device; use --device cpu")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, checkpoint: Path, device: torch.device, quant: str, *, rows: int = 1) -> torch.dtype:
    """The activations' dtype for `rows` sequences decoded at once: --dtype, or for auto the fastest
    that keeps the checkpoint's precision.

    - Quantized weights (--quant int8/int4, or a checkpoint saved quantized): bfloat16, on every
      CPU kind and on CUDA. torch's CPU int4 product with float32 activations is 4-5x slower than
      with bfloat16 ones (docs/performance.md), and the weights carry less precision than either.
    - Float weights: the checkpoint's dtype, except on CPU: float16 becomes bfloat16 (float16
      products are emulated there; bfloat16 has the same size and native kernels), and on a CPU
      without native bfloat16 products (AVX2) a batch of 2 rows or more runs in float32, which
      there decodes a batch of 8 at 2.7x the rate of bfloat16 (models/linear.py, docs/performance.md)."""
    if name != "auto":
        return DTYPES[name]
    if quant != "none" or stored_quantized(checkpoint):
        return torch.bfloat16
    dtype = DTYPES.get(stored_dtype(checkpoint) or "", torch.float32)
    if device.type != "cpu" or dtype == torch.float32:
        return dtype
    return torch.float32 if rows > 1 and not NATIVE_CPU_MATMUL[torch.bfloat16] else torch.bfloat16


def attention_line(device: torch.device, dtype: torch.dtype, config: ModelConfig, kv_dtype: str, pages: PageConfig | None, store_slots: int) -> str | None:
    """One line for stderr on CUDA: which kernel a decode step's attention runs, and why when it is
    not flash-attn (None on CPU, whose one path is SDPA)."""
    if device.type != "cuda":
        return None
    cache_dtype, bits = kv_storage(kv_dtype, dtype)
    block_size = None if pages is None else pages.block_size
    reason = why_not_flash(device, dtype, None if bits else cache_dtype, config.head_dim, block_size, store_slots > 0)
    if reason is None:
        return "attention: flash-attn in decode steps" + (" through the block table" if pages else "") + ", SDPA in prefill"
    return f"attention: SDPA{' over gathered blocks' if pages else ''}, not flash-attn: {reason}"


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tensor parallelism (launch with torchrun --nproc-per-node N; models/parallel.py)")
    g.add_argument(
        "--rank-timeout", type=float, default=parallel.DEFAULT_TIMEOUT_S, metavar="SECONDS",
        help="how long a rank waits for the others at a collective before the run fails (a rank that died or hung)",
    )


def start_ranks(args: argparse.Namespace, device: torch.device) -> tuple[TensorParallel | None, torch.device]:
    """Under torchrun with N > 1 ranks, join them (this rank's place and device); else (None, device)."""
    if parallel.launched_ranks() == 1:
        return None, device
    if args.rank_timeout <= 0:
        raise UserError(f"--rank-timeout must be positive, got {args.rank_timeout}")
    return parallel.start(device, args.rank_timeout)


@contextlib.contextmanager
def ranks_running(tp: TensorParallel | None) -> Iterator[None]:
    """Around a tensor-parallel run: only rank 0 prints (the others' output goes nowhere; errors
    still reach every rank's stderr), a failed collective is one clear error on every rank, and
    the process group ends with the run."""
    if tp is None:
        yield
        return
    finished = False
    try:
        with open(os.devnull, "w") as nowhere, contextlib.ExitStack() as quiet:
            if tp.rank > 0:
                quiet.enter_context(contextlib.redirect_stdout(nowhere))
                quiet.enter_context(contextlib.redirect_stderr(nowhere))
            yield
        finished = True
    except RuntimeError as e:
        # What a collective raises when a peer is gone or a wait times out: NCCL's DistError, gloo's
        # RuntimeError from its own sources. Any other RuntimeError is a bug, and keeps its traceback.
        if not isinstance(e, dist.DistError) and "gloo" not in str(e):
            raise
        detail = str(e).strip().splitlines()[0]
        raise UserError(
            f"rank {tp.rank} of {tp.world}: a collective with the other ranks failed ({detail}); "
            "another rank died, hung past --rank-timeout, or stopped on an error of its own (see its message)"
        ) from None
    finally:
        parallel.stop(tp, finished)


def sampling_with(given: dict[str, float | int | None], checkpoint_defaults: dict[str, float | int] | None) -> SamplingConfig:
    """Each value given (not None) wins; the rest come from the checkpoint's generation_config.json, else from llama-cli."""
    values = dict(checkpoint_defaults or LLAMA_CPP_SAMPLING)
    values.update({name: value for name, value in given.items() if value is not None})
    return SamplingConfig(**values)


class AnswerText:
    """One answer as text: decoded piece by piece, held back where a stop string may begin."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.decoder = StreamDecoder(tokenizer)
        self.stops = StopStrings(stops)
        self.text = ""

    def push(self, token: int) -> str:
        piece = self.stops.push(self.decoder.push(token))
        self.text += piece
        return piece

    def flush(self) -> str:
        piece = self.stops.push(self.decoder.flush()) + self.stops.flush()
        self.text += piece
        return piece
