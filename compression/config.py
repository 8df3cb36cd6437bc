"""What a KV-cache policy is asked to do: which policy, and the budget it must keep to."""

from dataclasses import dataclass

from errors import UserError
from kv import KV_BITS, KV_DTYPES, STORE_PAGE

STORE_DTYPES = (*KV_DTYPES, *KV_BITS)  # any --kv-dtype but auto
STORE_DROPS = ("oldest", "least_attended")
PREFIX_SINKS = 4  # a compressed prompt's first tokens, kept whole: attention sinks and the start of the instruction
POLICIES = ("none", "beacon", "streaming", "rpc", "snapkv", "tova", "rkv", "h2o", "maxattn", "random")
AGGREGATIONS = ("max", "mean", "topm")


@dataclass(frozen=True)
class CompressionConfig:
    policy: str = "none"
    budget: int = 512  # generated tokens kept after a compaction (budget_min), the recent window excluded
    hysteresis: int = 128  # compaction starts when the kept part exceeds budget + hysteresis (budget_max)
    window: int = 32  # most recent tokens, never evicted
    n_beacon: int = 16  # BeaconKV: beacon queries per (layer, query head)
    n_recent: int = 16  # recent queries buffered per (layer, query head); the observation window of the baselines
    aggregation: str = "max"  # BeaconKV: how scores combine over queries and the heads of a KV group
    top_m: int = 4  # BeaconKV, aggregation topm: the mean of this many strongest votes
    heads_agree: int = 2  # BeaconKV: a key scores its n-th most interested head of the group (1: the best; a smaller group needs all its heads)
    fps_per_group: bool = False  # BeaconKV: one FPS per KV group, on its heads' queries side by side; the heads share the beacons' steps
    lazy_refresh: bool = True  # BeaconKV: refresh the beacons once, just before each compaction, instead of each time the ring fills
    prefix_budget: int = 0  # a long prompt keeps this many of the tokens between its first PREFIX_SINKS and last prefix_tail (0: all)
    prefix_tail: int = 64  # with prefix_budget: the prompt's last tokens (the question), kept whole
    seed: int = 0  # for the random policy
    # Under tensor parallelism, this rank's first KV head and the model's count (models.parallel.kv_head_place):
    # the random policy draws for all of them, as one process would, and takes its own.
    kv_heads: tuple[int, int] | None = None
    store_slots: int = 0  # demote evicted slots into a store of this many (0: eviction is final)
    store_dtype: str = "int4"  # how the store holds keys and values (kv/quantized.py's names)
    recall_pages: int = 4  # store pages each KV head of each decode step attends besides the cache
    store_drops: str = "oldest"  # a full store overwrites its oldest slots, or those that received the least attention in the cache

    def __post_init__(self):
        named = (("policy", POLICIES), ("aggregation", AGGREGATIONS), ("store_dtype", STORE_DTYPES), ("store_drops", STORE_DROPS))
        for name, known in named:
            if getattr(self, name) not in known:
                raise UserError(f"unknown --kv-{name.replace('_', '-')} {getattr(self, name)!r}; choose one of {', '.join(known)}")
        for name in ("budget", "hysteresis", "window", "n_recent", "top_m", "heads_agree"):
            if getattr(self, name) < 1:
                raise UserError(f"--kv-{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.prefix_budget < 0 or self.prefix_tail < 1:
            raise UserError(f"--kv-prefix-budget must be >= 0 and --kv-prefix-tail >= 1, got {self.prefix_budget} and {self.prefix_tail}")
        if self.prefix_budget and self.policy in ("h2o", "maxattn", "none"):
            raise UserError(f"--kv-prefix-budget needs a policy that scores a prompt: {self.policy} has nothing to score it with")
        if self.n_beacon < 0:
            raise UserError(f"--n-beacon must be >= 0, got {self.n_beacon}")
        if self.store_slots:
            if self.policy == "none":
                raise UserError("--kv-store holds what a policy evicts: add a --kv-policy")
            if self.store_slots < 0 or self.store_slots % STORE_PAGE:
                raise UserError(f"--kv-store must be a multiple of its page of {STORE_PAGE} slots, got {self.store_slots}")
            if not 1 <= self.recall_pages <= self.store_slots // STORE_PAGE:
                raise UserError(f"--kv-recall must be between 1 and the store's {self.store_slots // STORE_PAGE} pages, got {self.recall_pages}")

    @property
    def enabled(self) -> bool:
        return self.policy != "none"

    @property
    def budget_max(self) -> int:
        return self.budget + self.hysteresis

    @property
    def buffered_beacons(self) -> int:
        """Beacon slots in the query buffer: only BeaconKV keeps any."""
        return self.n_beacon if self.policy == "beacon" else 0

    def slots_needed(self, longest_prompt: int, max_new_tokens: int) -> int:
        """Cache slots per row: the prompt plus what can be generated before the next compaction."""
        if not self.enabled:
            return longest_prompt + max_new_tokens
        return longest_prompt + min(max_new_tokens, self.budget_max + self.window + 1)
