"""What one evaluation run covers: the tasks, the size of the token streams, the budgets."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from compression.config import CompressionConfig
from compression.received_attention import attention_records
from errors import UserError
from kv import KV_BITS, KV_CHANNEL_CODES, KV_DTYPES

TASKS = ("retrieval", "attention", "loss", "continuation", "cost")

# BeaconKV's options a variant may set ("beacon:heads_agree=1"), so that an ablation runs beside
# the baselines in one evaluation; and the store's, which any policy's variant may set
# ("snapkv:store_slots=256:recall_pages=4").
VARIANT_OPTIONS = ("aggregation", "top_m", "heads_agree", "fps_per_group", "lazy_refresh", "prefix_budget", "prefix_tail")
STORE_OPTIONS = ("store_slots", "store_dtype", "recall_pages", "store_drops")


def with_variant(config: CompressionConfig, spec: str) -> CompressionConfig:
    """`config` for the policy `spec` names: a policy ("snapkv"), BeaconKV with some of its
    scoring options set ("beacon:aggregation=topm:top_m=8"), or any policy with a store."""
    name, *settings = spec.split(":")
    options = {}
    for setting in settings:
        option, _, value = setting.partition("=")
        allowed = STORE_OPTIONS + (VARIANT_OPTIONS if name == "beacon" else ())
        if option not in allowed or not value:
            raise UserError(
                f"policy {spec!r}: a variant is POLICY:OPTION=VALUE[:OPTION=VALUE], OPTION one of {', '.join(STORE_OPTIONS)} "
                f"(and for beacon {', '.join(VARIANT_OPTIONS)})"
            )
        kind = type(getattr(config, option))
        try:
            options[option] = kind(value) if kind is not bool else {"true": True, "false": False}[value.lower()]
        except (ValueError, KeyError):
            raise UserError(f"policy {spec!r}: {option}={value} is not a valid {kind.__name__}") from None
    return replace(config, policy=name, **options)


@dataclass(frozen=True)
class Sizes:
    length: int  # tokens after each prompt: forced, or generated
    n_traces: int  # reasoning traces of each kind, with and without revisit hints (tasks 1 and 2)
    n_text: int  # chunks of Python source (tasks 2 and 3)
    text_prompt: int  # their protected prefix, in tokens
    n_continuations: int  # prompts decoded freely (task 4)
    continuation_prompt: int
    future_queries: int  # K of task 2
    attention_every: int  # task 2 looks at every n-th compaction (a long run would not hold the kept maps of all)


# The default run: about 41 recalls per trace of 2048 tokens, so >= 300 recalls of each kind on
# SmolLM2 (docs/evaluation.md gives its time per model); --quick is a smoke run.
FULL = Sizes(length=2048, n_traces=8, n_text=2, text_prompt=32, n_continuations=2, continuation_prompt=64, future_queries=16, attention_every=8)
QUICK = Sizes(length=400, n_traces=1, n_text=1, text_prompt=16, n_continuations=1, continuation_prompt=32, future_queries=4, attention_every=2)
# (budgets, hysteresis, window, n_beacon, n_recent) where the command line does not say; budgets
# below 1 are fractions of the stream's length.
FULL_COMPRESSION = ((0.05, 0.10, 0.25), 16, 16, 16, 16)
QUICK_COMPRESSION = ((0.1,), 8, 8, 4, 8)
QUICK_POLICIES = ("beacon", "streaming", "snapkv")


@dataclass(frozen=True)
class EvalConfig:
    checkpoint: Path
    policies: tuple[str, ...]  # the compressing ones; the full cache always runs
    budgets: tuple[int, ...]
    hysteresis: int
    window: int
    n_beacon: int
    n_recent: int
    aggregation: str  # BeaconKV's
    tasks: tuple[str, ...]
    dtype: str
    out: Path
    sizes: Sizes
    seed: int = 0
    full_pass: Path | None = None  # the full cache's saved pass to start from (default: out/full_pass.pt); not a setting of the results

    def compression(self, policy: str, budget: int) -> CompressionConfig:
        base = CompressionConfig("beacon", budget, self.hysteresis, self.window, self.n_beacon, self.n_recent, self.aggregation, seed=self.seed)
        return with_variant(base, split_storage(policy)[0])  # a policy, or a variant of one

    def first_compaction(self, budget: int) -> int:
        """Decode steps after which any policy with this budget compacts for the first time."""
        return budget + self.hysteresis + self.window + 1


def split_storage(spec: str) -> tuple[str, str]:
    """A cell's policy spec, and how its cache stores keys and values (--kv-dtype):
    "streaming:kv_dtype=int4:store_slots=256" -> ("streaming:store_slots=256", "int4"). The full
    cache in another storage is "none:kv_dtype=int8"."""
    name, *settings = spec.split(":")
    kept, kv_dtype = [name], "auto"
    for setting in settings:
        option, _, value = setting.partition("=")
        if option != "kv_dtype":
            kept.append(setting)
        elif value not in (*KV_DTYPES, *KV_BITS, *KV_CHANNEL_CODES):
            raise UserError(f"policy {spec!r}: kv_dtype={value} is not a KV storage; choose one of {', '.join([*KV_DTYPES, *KV_BITS, *KV_CHANNEL_CODES])}")
        elif value in KV_CHANNEL_CODES and name != "none":
            raise UserError(f"policy {spec!r}: kv_dtype={value} keeps keys per channel over blocks of slots, which no policy can compact; run it as the full cache, none:kv_dtype={value}")
        else:
            kv_dtype = value
    if name == "none" and settings and (len(kept) > 1 or kv_dtype == "auto"):
        raise UserError(f"policy {spec!r}: the full cache runs anyway; 'none:kv_dtype=int8' runs it in another storage, and takes no other option")
    return ":".join(kept), kv_dtype


def cells_attention_records(policies: tuple[str, ...]) -> set[str]:
    """The records of the attention received that the full cache's pass keeps, for the cells that
    resume from it and score by one."""
    return set().union(*(attention_records(with_variant(CompressionConfig(), split_storage(spec)[0])) for spec in policies))
