"""Command-line helpers shared by generate.py, serve.py, bench.py and evaluate.py: the checkpoint and the form its
weights run in, devices, dtypes, the options of every feature, sampling defaults, and an answer's text. What
builds a feature from its options is in cli_features.py, which a script loads only when a feature is asked for."""

import argparse
import os
import sys
from pathlib import Path

import torch

from compression.config import AGGREGATIONS, POLICIES, STORE_DROPS, CompressionConfig
from engine.sampling import SamplingConfig
from errors import UserError
from kv import KV_BITS, KV_CHANNEL_CODES, KV_DTYPES
from models.linear import NATIVE_CPU_MATMUL
from models import GGUF_GROUP, GROUP_SIZES, QUANT_MODES
from weights.loader import stored_dtype, stored_quantized
from weights.tokenizer import StreamDecoder, Tokenizer

# llama-cli's defaults, for checkpoints whose generation_config.json says nothing about sampling.
LLAMA_CPP_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0}
SAMPLING_FIELDS = tuple(LLAMA_CPP_SAMPLING)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# How long a collective waits for the other ranks before it fails: long enough for the slowest
# rank's first torch.compile, short enough that a dead or stuck rank ends the run.
DEFAULT_RANK_TIMEOUT_S = 600
COMPILE_NOTICE = "compiling the decode step (a group of transformer blocks, reused by every group of layers; later runs load it); --no-compile runs eager"
# From this many tokens a compiled step repays its warm start (docs/performance.md): the plain
# step's saved package loads in a fraction of a second, torch.compile's groups in seconds.
SAVED_STEP_FROM_TOKENS = 32
COMPILE_FROM_TOKENS = 512
DTYPE_HELP = (
    "activations and KV cache. auto: bfloat16 with quantized weights, the bundled model's included, on every CPU kind "
    "(torch's int4 product with float32 activations is 4-27x slower on CPU; docs/performance.md); else the checkpoint's dtype, "
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
        from weights.packaged import smollm2_checkpoint

        own_blocks = launched_ranks() == 1 and (quant == "auto" or (quant == "int4" and group_size == GGUF_GROUP))
        return smollm2_checkpoint(quantized=own_blocks), "none" if own_blocks or quant == "auto" else quant
    if Path(checkpoint).expanduser().is_dir():
        return Path(checkpoint).expanduser(), "none" if quant == "auto" else quant
    from weights.download import resolve_checkpoint  # the hub client, only for what is not a local folder

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
        "--kv-dtype", choices=["auto", *KV_DTYPES, *KV_BITS, *KV_CHANNEL_CODES], default="auto", metavar="KV_DTYPE",
        help="how the cache stores keys and values: auto (the model's --dtype), bf16, f16, f32; or codes with a float16 step and minimum per 32 channels of each token: int8, int4, int3, int2 (keys and values alike), kNvM (keys in N bits, values in M; N, M of 8, 4, 3, 2), e.g. k4v3; any of these with g64 for a step and minimum per 64 channels, e.g. k4v3g64 (kv/quantized.py); or kcNvM, keys per channel over blocks of 32 tokens (N, M of 4, 3, 2), e.g. kc3v3, for a cache that keeps every token (kv/channel_keys.py); kcNvMg64: blocks of 64 tokens and values in groups of 64 channels, e.g. kc4v3g64",
    )
    g.add_argument("--kv-store", type=int, default=d.store_slots, metavar="SLOTS", help="demote what a policy evicts into a store of this many slots (pages of 16), which each decode step recalls from (0: eviction is final)")
    g.add_argument("--kv-store-dtype", choices=[*KV_DTYPES, *KV_BITS], default=d.store_dtype, metavar="KV_DTYPE", help="how the store holds keys and values (as --kv-dtype)")
    g.add_argument("--kv-store-drops", choices=STORE_DROPS, default=d.store_drops, help="what a full store overwrites: its oldest slots, or the least_attended (those that received the least attention in the cache)")
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
        store_slots=args.kv_store, store_dtype=args.kv_store_dtype, recall_pages=args.kv_recall, store_drops=args.kv_store_drops,
    )


def add_paging_args(p: argparse.ArgumentParser, paged_help: str) -> None:
    g = p.add_argument_group("paged KV cache (kv/paged.py)")
    g.add_argument("--paged", action="store_true", help=paged_help)
    g.add_argument("--block-size", type=int, help="slots per block, a power of two (default: 16; 256 on CUDA with flash-attn, its page size)")
    g.add_argument("--kv-blocks", type=int, help="blocks in the pool (default: every row's longest case, the contiguous cache's memory)")
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", help="continuous batching: prefill every prompt whole (default: a prompt takes the cached blocks it begins with)")


def compile_pays(device: torch.device, tokens: int | None, saved: bool) -> bool:
    """Whether generate.py compiles the decode step when neither --compile nor --no-compile is
    given: on CPU, for a chat (many answers on one session) or a run that may make enough tokens
    that the milliseconds saved per token repay loading the compiled step: SAVED_STEP_FROM_TOKENS
    where the saved package serves the run (saved: the plain cache, engine/saved_step.py),
    COMPILE_FROM_TOKENS where torch.compile's groups do. On CUDA the CUDA graph does its job."""
    return device.type == "cpu" and (tokens is None or tokens >= (SAVED_STEP_FROM_TOKENS if saved else COMPILE_FROM_TOKENS))


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
      CPU kind and on CUDA. torch's CPU int4 product with float32 activations is 4-27x slower than
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


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tensor parallelism (launch with torchrun --nproc-per-node N; models/parallel.py)")
    g.add_argument(
        "--rank-timeout", type=float, default=DEFAULT_RANK_TIMEOUT_S, metavar="SECONDS",
        help="how long a rank waits for the others at a collective before the run fails (a rank that died or hung)",
    )


def launched_ranks() -> int:
    """How many ranks the launcher started (torchrun sets WORLD_SIZE); 1 without a launcher."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def sampling_with(given: dict[str, float | int | None], checkpoint_defaults: dict[str, float | int] | None) -> SamplingConfig:
    """Each value given (not None) wins; the rest come from the checkpoint's generation_config.json, else from llama-cli."""
    values = dict(checkpoint_defaults or LLAMA_CPP_SAMPLING)
    values.update({name: value for name, value in given.items() if value is not None})
    return SamplingConfig(**values)


class AnswerText:
    """One answer as text: decoded piece by piece, held back where a stop string may begin."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.decoder = StreamDecoder(tokenizer)
        self.stops = None
        if stops:
            from engine.stop_strings import StopStrings  # read only by an answer given stop strings

            self.stops = StopStrings(stops)
        self.text = ""

    @property
    def stopped(self) -> bool:
        """A stop string has appeared: the answer is over."""
        return self.stops is not None and self.stops.stopped

    def push(self, token: int) -> str:
        piece = self.decoder.push(token)
        piece = piece if self.stops is None else self.stops.push(piece)
        self.text += piece
        return piece

    def flush(self) -> str:
        piece = self.decoder.flush()
        piece = piece if self.stops is None else self.stops.push(piece) + self.stops.flush()
        self.text += piece
        return piece


class CompileNotice:
    """Says once on stderr, just before the first decode step, that the step is being compiled
    (after every check of the input has passed, so a bad request stays one line of error)."""

    def __init__(self, compiling: bool):
        self.pending = compiling

    def __call__(self) -> None:
        if self.pending:
            print(COMPILE_NOTICE, file=sys.stderr, flush=True)
            self.pending = False


def answer_eos(args: argparse.Namespace, tokenizer: Tokenizer) -> frozenset[int]:
    """The tokens that end an answer: none with --ignore-eos."""
    return frozenset() if args.ignore_eos else tokenizer.eos_ids
