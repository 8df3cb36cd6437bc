"""BeaconKV and the baselines against brute-force references, and the cache invariants they keep."""

import argparse
import math

import pytest
import torch

from cli import add_compression_args, compression_config
from kv.compaction import compact_in_place
from compression.config import POLICIES, CompressionConfig
from compression.fps import farthest_point_sampling
from compression.manager import CompressionManager
from compression.policies import SCORERS
from compression.scoring import aggregate, attention_logits
from engine.decode import StepState, decode_step, prefill
from engine.options import RunOptions, generate, open_session
from kv.cache import KVCache
from engine.sampling import SamplingConfig
from errors import UserError
from compression.manager import QueryTap
from models.transformer import CacheRead
from models.rope import apply_rope
from weights.forms import load_model

CPU = torch.device("cpu")
SCORERS_BEFORE = dict(SCORERS)  # the real scorers, for tests that wrap one


def brute_force_fps(points: torch.Tensor, k: int, valid: list[bool]) -> list[int]:
    """The definition, one point at a time, with the full similarity matrix."""
    n = points.shape[0]
    sim = [[torch.cosine_similarity(points[i], points[j], dim=0).item() for j in range(n)] for i in range(n)]
    candidates = [i for i in range(n) if valid[i]]
    chosen = [min(candidates, key=lambda i: sum(sim[i][j] for j in candidates if j != i))]
    while len(chosen) < k:
        chosen.append(min(candidates, key=lambda i: max(sim[i][c] for c in chosen)))
    return chosen


def test_fps_picks_the_same_points_as_brute_force():
    torch.manual_seed(0)
    points = torch.randn(2, 3, 12, 5)  # [rows, heads, N, D]
    valid = torch.rand(2, 1, 12) > 0.25
    picks = farthest_point_sampling(points, 4, valid)
    for b in range(2):
        for h in range(3):
            assert picks[b, h].tolist() == brute_force_fps(points[b, h], 4, valid[b, 0].tolist())


def test_fps_with_fewer_valid_points_than_picks_repeats_valid_ones():
    points = torch.randn(1, 6, 3)
    valid = torch.tensor([[False, True, False, True, False, False]])
    picks = farthest_point_sampling(points, 4, valid)[0].tolist()
    assert set(picks) == {1, 3}


@pytest.mark.parametrize("how", ["max", "mean"])
def test_scores_match_each_query_head_to_its_own_kv_head(how):
    torch.manual_seed(1)
    B, H, H_kv, Q, C, D = 2, 6, 2, 3, 7, 4
    queries, keys = torch.randn(B, H, Q, D), torch.randn(B, H_kv, C, D)
    got = aggregate(attention_logits(queries, keys), how)  # [B, H_kv, C]
    G = H // H_kv
    for b in range(B):
        for kv in range(H_kv):
            for c in range(C):
                logits = [
                    (queries[b, h, q] @ keys[b, kv, c]).item() / math.sqrt(D)
                    for h in range(kv * G, (kv + 1) * G)  # query heads h with h // G == kv
                    for q in range(Q)
                ]
                expected = {"max": max(logits), "mean": sum(logits) / len(logits)}[how]
                assert got[b, kv, c].item() == pytest.approx(expected, abs=1e-5)


def test_compaction_gives_the_attention_of_the_kept_subset():
    torch.manual_seed(2)
    L, B, H_kv, S, D = 2, 2, 3, 24, 4
    k, v = torch.randn(L, B, H_kv, S, D), torch.randn(L, B, H_kv, S, D)
    full_k, full_v = k.clone(), v.clone()
    prompt_length = torch.tensor([3, 6])
    n_candidates, window, K = 10, 2, 4
    keep = torch.rand(L, B, H_kv, n_candidates).argsort(-1)[..., :K].sort(-1).values
    compact_in_place([k, v], prompt_length, keep, n_candidates, window)
    query = torch.randn(D)
    for l in range(L):
        for b in range(B):
            P = prompt_length[b].item()
            for h in range(H_kv):
                kept_slots = list(range(P)) + [P + i for i in keep[l, b, h].tolist()] + list(range(P + n_candidates, P + n_candidates + window))
                n = len(kept_slots)
                subset_k, subset_v = full_k[l, b, h, kept_slots], full_v[l, b, h, kept_slots]
                expected = torch.softmax(subset_k @ query, 0) @ subset_v
                got = torch.softmax(k[l, b, h, :n] @ query, 0) @ v[l, b, h, :n]
                assert torch.allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_compaction_moves_every_kept_slot_bit_for_bit(dtype):
    """Keys and values of any dtype, and a slot bookkeeping buffer with no head dim, end up
    exactly [prefix | kept | window], slot by slot as a loop over (layer, row, head) puts them."""
    torch.manual_seed(3)
    L, B, H_kv, S, D = 3, 2, 2, 30, 5
    k = (torch.randn(L, B, H_kv, S, D) * 100).to(dtype)
    positions = torch.arange(L * B * H_kv * S).view(L, B, H_kv, S)
    before_k, before_positions = k.clone(), positions.clone()
    prompt_length = torch.tensor([4, 1])
    n_candidates, window, K = 12, 3, 5
    keep = torch.rand(L, B, H_kv, n_candidates).argsort(-1)[..., :K].sort(-1).values
    compact_in_place([k, positions], prompt_length, keep, n_candidates, window)
    for l in range(L):
        for b in range(B):
            P = prompt_length[b].item()
            for h in range(H_kv):
                slots = list(range(P)) + [P + i for i in keep[l, b, h].tolist()] + list(range(P + n_candidates, P + n_candidates + window))
                assert torch.equal(k[l, b, h, : len(slots)], before_k[l, b, h, slots])
                assert positions[l, b, h, : len(slots)].tolist() == before_positions[l, b, h, slots].tolist()


def teacher_forced_run(model, config, prompts, continuation, check_each_step=None):
    """Prefill, then feed the continuation token by token through the decode step."""
    cache = KVCache.allocate(model.config, len(prompts), config.slots_needed(max(map(len, prompts)), len(continuation)), torch.float32, CPU)
    manager = CompressionManager(config, cache, model.config.n_heads, model.rope_cos, model.rope_sin) if config.enabled else None
    prefill(model, cache, prompts, policy=manager)
    tokens, finished, eos = torch.zeros(len(prompts), dtype=torch.int64), torch.zeros(len(prompts), dtype=torch.bool), torch.tensor([-1])
    for token in continuation:
        tokens.fill_(token)
        decode_step(model, cache, StepState(tokens, finished, eos, SamplingConfig()), manager)
        if manager is not None:
            compactions = manager.stats.compactions
            manager.after_step()
            if check_each_step:
                check_each_step(cache, manager, compactions != manager.stats.compactions)
    return cache, manager


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "none"])
def test_length_stays_within_the_allocation_and_compacts_to_prefix_budget_window(policy, tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    config = CompressionConfig(policy=policy, budget=8, hysteresis=4, window=3, n_beacon=3, n_recent=5)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15]]
    continuation = torch.randint(3, 384, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    seen = []

    def check(cache, manager, compacted):
        assert (cache.length <= cache.n_slots).all()
        if compacted:
            assert cache.length.tolist() == [3 + 8 + 3, 7 + 8 + 3]
            seen.append(cache.position.tolist())

    cache, manager = teacher_forced_run(model, config, prompts, continuation, check)
    assert cache.n_slots == 7 + 8 + 4 + 3 + 1
    assert len(seen) == manager.stats.compactions >= 4
    assert cache.position.tolist() == [3 + 60, 7 + 60]  # positions never move back


def test_kept_keys_keep_their_positions(tiny_checkpoint):
    """Layer 0's key depends only on the token and its position, so every kept slot must hold
    exactly the full-cache key of the position the manager says it holds."""
    model = load_model(tiny_checkpoint("qwen3")[0], torch.float32, CPU)
    prompt = [4, 8, 15, 16]
    continuation = torch.randint(3, 384, (50,), generator=torch.Generator().manual_seed(4)).tolist()
    config = CompressionConfig(policy="beacon", budget=10, hysteresis=5, window=4, n_beacon=3, n_recent=6)
    cache, manager = teacher_forced_run(model, config, [prompt], continuation)
    full, _ = teacher_forced_run(model, CompressionConfig(), [prompt], continuation)
    assert manager.stats.compactions >= 2
    positions = manager.slot_positions()[0, 0]  # layer 0, row 0: [H_kv, S]
    n = cache.length.item()
    for h in range(model.config.n_kv_heads):
        expected = full.k[0, 0, h, positions[h, :n]]
        assert torch.allclose(cache.k[0, 0, h, :n], expected, atol=1e-6)
        assert positions[h, :n].tolist() == sorted(positions[h, :n].tolist())


@pytest.mark.parametrize("policy", ["beacon", "snapkv", "rkv", "streaming"])
def test_rows_of_a_batch_are_compressed_independently(policy, tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (4, 13, 9)]
    config = CompressionConfig(policy=policy, budget=12, hysteresis=6, window=4, n_beacon=4, n_recent=6)
    batch = generate(model, prompts, 60, eos_ids=frozenset(), options=RunOptions(compression=config)).tokens
    alone = [generate(model, [p], 60, eos_ids=frozenset(), options=RunOptions(compression=config)).tokens[0] for p in prompts]
    assert batch == alone


def test_a_budget_larger_than_the_generation_gives_the_full_cache_tokens(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen2")[0], torch.float32, CPU)
    prompts = [[3, 4, 5, 6], [7, 8]]
    full = generate(model, prompts, 40, eos_ids=frozenset()).tokens
    config = CompressionConfig(policy="beacon", budget=64, window=4)
    result = generate(model, prompts, 40, eos_ids=frozenset(), options=RunOptions(compression=config))
    assert result.tokens == full and result.compression.compactions == 0


@pytest.mark.parametrize("policy", ["beacon", "h2o"])
def test_compiled_step_with_query_recording_equals_eager(policy, tiny_checkpoint):
    """Recording queries (and for H2O accumulating attention) inside the step compiles with fullgraph."""
    model = load_model(tiny_checkpoint("qwen3")[0], torch.float32, CPU)
    prompts = [[3, 9, 27, 81], [5, 25, 125]]
    config = CompressionConfig(policy=policy, budget=10, hysteresis=4, window=3, n_beacon=3, n_recent=5)
    eager = generate(model, prompts, 40, eos_ids=frozenset(), options=RunOptions(compression=config))
    compiled = generate(model, prompts, 40, eos_ids=frozenset(), options=RunOptions(compression=config, compile=True))
    assert compiled.tokens == eager.tokens and compiled.compression.compactions == eager.compression.compactions > 0


@pytest.mark.parametrize("how, top_m", [("topm", 3), ("topm", 50), ("max", 1)])
@pytest.mark.parametrize("H, heads_agree", [(6, 1), (6, 2), (6, 3), (6, 4), (2, 2)])
def test_softer_aggregations_and_heads_that_agree_match_their_definitions(how, top_m, H, heads_agree):
    """Each head's votes are its queries' logits; heads_agree n scores a key by its n-th best head
    (each head combining its own queries), 1 by all the group's votes together. A group of fewer
    than n heads needs all of them: 4 of a group of 3, and 2 of one head (multi-head attention)."""
    torch.manual_seed(6)
    B, H_kv, Q, C, D = 1, 2, 4, 5, 4
    queries, keys = torch.randn(B, H, Q, D), torch.randn(B, H_kv, C, D)
    got = aggregate(attention_logits(queries, keys), how, top_m, heads_agree)
    G = H // H_kv

    def combine(votes: list[float]) -> float:
        if how == "topm":
            strongest = sorted(votes, reverse=True)[:top_m]
            return sum(strongest) / len(strongest)
        return max(votes)

    for kv in range(H_kv):
        for c in range(C):
            votes = {h: [(queries[0, h, q] @ keys[0, kv, c]).item() / math.sqrt(D) for q in range(Q)] for h in range(kv * G, (kv + 1) * G)}
            if heads_agree == 1:
                expected = combine([v for head in votes.values() for v in head])
            else:
                expected = min(combine(head) for head in votes.values()) if heads_agree >= G else sorted((combine(head) for head in votes.values()), reverse=True)[heads_agree - 1]
            assert got[0, kv, c].item() == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize(
    "flags, heads_agree, lazy_refresh",
    [([], 2, True), (["--kv-heads-agree", "1", "--no-kv-lazy-refresh"], 1, False), (["--kv-lazy-refresh"], 2, True)],
)
def test_the_command_line_runs_v2_by_default_and_v1_when_asked(flags, heads_agree, lazy_refresh):
    parser = argparse.ArgumentParser()
    add_compression_args(parser)
    parser.add_argument("--seed", type=int, default=0)  # generate.py's and bench.py's own
    config = compression_config(parser.parse_args(["--kv-policy", "beacon", *flags]))
    assert (config.heads_agree, config.lazy_refresh) == (heads_agree, lazy_refresh)


def test_bad_compression_options_are_refused():
    with pytest.raises(UserError, match="unknown --kv-policy 'h3o'"):
        CompressionConfig(policy="h3o")
    with pytest.raises(UserError, match="--kv-budget must be >= 1"):
        CompressionConfig(policy="beacon", budget=0)
    with pytest.raises(UserError, match="unknown --kv-aggregation"):
        CompressionConfig(aggregation="median")
    with pytest.raises(UserError, match="--kv-top-m must be >= 1"):
        CompressionConfig(aggregation="topm", top_m=0)
    with pytest.raises(UserError, match="--kv-heads-agree must be >= 1"):
        CompressionConfig(heads_agree=0)


@pytest.mark.parametrize("kv_dtype, store_slots", [("auto", 0), ("int4", 32)])
def test_compaction_holds_the_same_memory_however_long_the_run(tiny_checkpoint, kv_dtype, store_slots):
    """The cache (its codes and scales when quantized), the store of demoted slots, and every tensor
    the manager keeps: the same storages and the same bytes after the first compaction and after
    many more (the store's ring wraps several times), so a long run's memory cannot grow with its tokens."""
    from engine.options import RunOptions, open_session
    from kv.quantized import kv_parts

    model = load_model(tiny_checkpoint("llama")[0], torch.float32, torch.device("cpu"))
    config = CompressionConfig(policy="beacon", budget=12, hysteresis=6, window=4, n_beacon=4, n_recent=6, store_slots=store_slots, recall_pages=1)
    session = open_session(model, 2, config.slots_needed(9, 10_000), RunOptions(compression=config, kv_dtype=kv_dtype), eos_ids=frozenset())
    session.prefill([[5] * 9, [7] * 6])

    def held() -> dict[str, tuple[int, int]]:
        manager = session.policy
        owners = {"cache": session.cache, "store": session.policy.store, "manager": manager, "buffer": manager.buffer, "positions": manager.positions}
        tensors = {
            f"{owner}.{k}.{i}": t
            for owner, o in owners.items()
            if o is not None
            for k, v in vars(o).items()
            if isinstance(v, (torch.Tensor, tuple))
            for i, t in enumerate(kv_parts(v) if not isinstance(v, torch.Tensor) else [v])
        }
        return {name: (t.untyped_storage().data_ptr(), t.nbytes) for name, t in tensors.items()}

    while session.stats.compactions < 1:
        session.step()
    after_first = held()
    assert any(name.startswith("store.") for name in after_first) == bool(store_slots)
    while session.stats.compactions < 40:
        session.step()
    assert held() == after_first
    if store_slots:
        assert bool(session.policy.store.filled.all())
    assert session.policy.generated <= config.budget_max + config.window


@pytest.mark.parametrize("policy", ["snapkv", "beacon"])
def test_recent_queries_are_scored_where_they_were_issued_and_as_many_for_every_policy(policy, tiny_checkpoint, monkeypatch):
    """At a compaction every policy scores with the last n_recent queries (BeaconKV's ring no longer
    restarts at a refresh), each rotated to the position of the token that issued it (not to the
    current position, which handicapped the baselines)."""
    import compression.policies as policies
    from models.rope import apply_rope

    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    config = CompressionConfig(policy=policy, budget=8, hysteresis=4, window=4, n_beacon=4, n_recent=6)
    recorded, scored, recorded_before = [], [], []
    record, compact, scorer = CompressionManager.record, CompressionManager._compact, SCORERS[policy]
    monkeypatch.setattr(CompressionManager, "record", lambda self, q, p: (recorded.append(q[0].clone()), record(self, q, p))[1])
    monkeypatch.setattr(CompressionManager, "_compact", lambda self: (recorded_before.append(len(recorded)), compact(self))[1])
    monkeypatch.setitem(SCORERS, policy, lambda x: (scored.append(x.recent.clone()), scorer(x))[1])
    prompt_len = 9
    generate(model, [[5 + i for i in range(prompt_len)]], 30, eos_ids=frozenset(), options=RunOptions(compression=config))

    n = recorded_before[0]  # the queries recorded before the first compaction, one per decode step
    assert n > config.n_recent
    # Step i (from 0) fed the token at position prompt_len + i: its query was issued there.
    positions = torch.arange(n - config.n_recent, n) + prompt_len
    raw = torch.cat(recorded[n - config.n_recent : n], dim=2)  # layer 0: [B, H, R, D]
    expected = apply_rope(raw, model.rope_cos[positions][None], model.rope_sin[positions][None])
    assert scored[0].shape[2] == config.n_recent
    assert torch.allclose(scored[0], expected, atol=1e-5)


def brute_force_weights(recent, context, visible, candidates):
    """[B][H][R][C] by loops: query h of recent query r, softmax over the keys it could read."""
    B, H, R, D = recent.shape
    H_kv = context.shape[1]
    out = torch.zeros(B, H, R, len(candidates[0]))
    for b in range(B):
        for h in range(H):
            kv = h // (H // H_kv)
            for r in range(R):
                seen = [j for j in range(context.shape[2]) if visible[b, kv, r, j]]
                logits = torch.tensor([float(recent[b, h, r] @ context[b, kv, j]) / math.sqrt(D) for j in seen])
                weight = dict(zip(seen, logits.softmax(0).tolist()))
                out[b, h, r] = torch.tensor([weight.get(int(c), 0.0) for c in candidates[b]])
    return out


def brute_force_pool(scores, kernel, how):
    """Along the last axis, each value replaced by the max or mean of its window (edges clipped)."""
    out = torch.empty_like(scores)
    for i in range(scores.shape[-1]):
        window = scores[..., max(0, i - kernel // 2) : i + kernel // 2 + 1]
        out[..., i] = window.amax(-1) if how == "max" else window.mean(-1)
    return out


def test_each_baseline_equals_its_definition_by_brute_force():
    """RPC, SnapKV, TOVA and R-KV on a tiny case: the softmax of each recent query over the keys it
    could read (prompt and window included, later keys excluded), reduced as each paper reduces it."""
    from compression.policies import ScoringInputs

    g = torch.Generator().manual_seed(0)
    B, H, H_kv, R, S, D = 2, 4, 2, 3, 12, 8
    recent = torch.randn(B, H, R, D, generator=g)
    context = torch.randn(B, H_kv, S, D, generator=g)
    candidates = torch.tensor([[2, 3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8, 9]])  # [B, C] after a prompt of 2 / 3 slots
    slot_position = torch.arange(S)
    issued = torch.tensor([[9, 10, 11], [9, 10, 11]])  # [B, R]
    visible = (slot_position[None, None, None, :] <= issued[:, None, :, None]).expand(B, H_kv, R, S).clone()
    visible[1, :, :, 11] = False  # a slot not in use in row 1
    in_use = torch.ones(B, S, dtype=torch.bool)
    in_use[1, 11] = False
    x = ScoringInputs(recent=recent, beacons=recent[:, :, :0], keys=context.gather(2, candidates[:, None, :, None].expand(B, H_kv, 7, D)),
                      context=context, visible=visible, in_use=in_use, candidate_slots=candidates, config=CompressionConfig(), generator=g)
    weights = brute_force_weights(recent, context, visible, candidates)  # [B, H, R, C]
    grouped = weights.view(B, H_kv, H // H_kv, R, -1)
    expected = {
        "rpc": brute_force_pool(grouped.mean(dim=(2, 3)), 7, "mean"),
        "snapkv": brute_force_pool(grouped.sum(dim=3).mean(dim=2), 7, "max"),
        "tova": grouped[:, :, :, -1].mean(dim=2),
    }
    for policy, want in expected.items():
        assert torch.allclose(SCORERS[policy](x), want, atol=1e-6), policy
    # R-KV as its reference code scores: logits max over the group, softmax outside the window.
    G, C = H // H_kv, candidates.shape[1]
    importance = torch.zeros(B, H_kv, C)
    redundancy = torch.zeros(B, H_kv, C)
    for b in range(B):
        window_start = int(candidates[b, -1]) + 1
        used = [j for j in range(S) if in_use[b, j]]
        for k in range(H_kv):
            mean_weight = torch.zeros(S)
            for r in range(R):
                readable = [j for j in range(S) if visible[b, k, r, j] and j < window_start]
                logits = torch.tensor([max(float(recent[b, k * G + g, r] @ context[b, k, j]) for g in range(G)) / math.sqrt(D) for j in readable])
                mean_weight[readable] += logits.softmax(0) / R
            importance[b, k] = brute_force_pool(mean_weight[candidates[b]], 7, "max")
            unit = torch.nn.functional.normalize(context[b, k], dim=-1)
            column_sums = torch.zeros(S)
            for i in used:
                row = {j: float(unit[i] @ unit[j]) for j in used if j != i}
                similar = [j for j, value in row.items() if value > 0.5]
                row[max(similar) if similar else 0] = 0.0  # the newest similar key is left out
                for j, value in row.items():
                    column_sums[j] += value
            share = (column_sums[used] / len(used)).softmax(0)
            redundancy[b, k] = torch.tensor([float(share[used.index(int(c))]) for c in candidates[b]])
    assert torch.allclose(SCORERS["rkv"](x), 0.07 * importance - 0.93 * redundancy, atol=1e-6)


@pytest.mark.parametrize("policy", ["h2o", "maxattn"])
def test_the_attention_received_equals_the_softmax_attention_recomputed_from_scratch(tiny_checkpoint, policy):
    """The attention each slot received, recorded inside the decode step over the steps and a
    group's heads (H2O: their sum; maxattn: their maximum), equals that of the softmax attention
    of every decoded query, recomputed from one prefill of the whole sequence."""
    from engine.options import RunOptions, open_session
    from models.rope import apply_rope

    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    config = CompressionConfig(policy=policy, budget=64, hysteresis=16, window=8)  # no compaction in 20 steps
    session = open_session(model, 1, 64, RunOptions(compression=config), eos_ids=frozenset())
    prompt = [5 + 3 * i for i in range(9)]
    fed = [session.prefill([prompt]).tokens[0]]
    for _ in range(20):
        fed.append(session.step().tokens[0])
    sequence = prompt + fed[:-1]  # the last sampled token was never fed
    n = len(sequence)

    cache = KVCache.allocate(model.config, 1, n, torch.float32, CPU)
    positions = torch.arange(n)[None]
    collected = []
    layers = [QueryTap(layer, collected.append) for layer in cache.layers(None)]
    model(torch.tensor([sequence]), positions, CacheRead(layers, positions, None))
    queries = torch.stack(collected)  # [L, 1, H, T, D]
    L, _, H, _, D = queries.shape
    H_kv = cache.k.shape[2]
    expected = torch.zeros(L, H_kv, n)
    for layer in range(L):
        rotated = apply_rope(queries[layer], model.rope_cos[positions], model.rope_sin[positions])[0]  # [H, T, D]
        for t in range(len(prompt), n):  # the decoded tokens' queries
            for h in range(H):
                keys = cache.k[layer, 0, h // (H // H_kv), : t + 1]  # [t + 1, D]
                paid = (keys @ rotated[h, t] / math.sqrt(D)).softmax(0)
                row = expected[layer, h // (H // H_kv), : t + 1]
                row.copy_(row + paid if policy == "h2o" else torch.maximum(row, paid))
    got = session.policy.received["sum" if policy == "h2o" else "max"][:, 0, :, :n]
    assert torch.allclose(got, expected, atol=1e-4)


def test_h2o_counts_nothing_yet_for_the_tokens_a_chat_turn_appends(tiny_checkpoint):
    """After a compaction the slots past the kept ones still hold evicted tokens' sums: a turn's
    tokens written there start from zero, since no decoded query has read them."""
    from engine.options import RunOptions, open_session

    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    config = CompressionConfig(policy="h2o", budget=8, hysteresis=4, window=4)
    session = open_session(model, 1, 64, RunOptions(compression=config), eos_ids=frozenset())
    session.prefill([[5, 9, 13, 17]])
    while session.stats.compactions < 1:
        session.step()
    held = int(session.cache.length[0])
    assert session.policy.received["sum"][:, 0, :, held : held + 6].abs().sum() > 0  # stale sums lie there
    session.prefill([[21, 25, 29, 33, 37, 41]])
    assert session.policy.received["sum"][:, 0, :, held : held + 6].abs().sum() == 0


def queries_of(model, sequence: list[int]) -> torch.Tensor:
    """Every layer's pre-RoPE queries [L, 1, H, T, D] of one sequence, from one plain forward."""
    n = len(sequence)
    cache = KVCache.allocate(model.config, 1, n, torch.float32, CPU)
    positions = torch.arange(n)[None]
    collected = []
    layers = [QueryTap(layer, collected.append) for layer in cache.layers(None)]
    model(torch.tensor([sequence]), positions, CacheRead(layers, positions, None))
    return torch.stack(collected)


def test_seeding_layer_by_layer_picks_the_farthest_prompt_queries_of_each_layer(tiny_checkpoint):
    """The first beacons are FPS over each layer's prompt queries, padding excluded: the same
    picks as FPS over every layer's queries at once, computed from plain forwards of each prompt."""
    model = load_model(tiny_checkpoint("qwen2")[0], torch.float32, CPU)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (23, 14)]
    config = CompressionConfig(policy="beacon", budget=16, n_beacon=5, n_recent=4)
    cache = KVCache.allocate(model.config, 2, 40, torch.float32, CPU)
    manager = CompressionManager(config, cache, model.config.n_heads, model.rope_cos, model.rope_sin)
    prefill(model, cache, prompts, policy=manager)
    for row, prompt in enumerate(prompts):
        queries = queries_of(model, prompt)[:, 0]  # [L, H, T, D]
        picks = farthest_point_sampling(queries, 5)  # [L, H, 5]
        expected = queries.gather(2, picks[..., None].expand(*picks.shape, queries.shape[-1]))
        assert torch.allclose(manager.buffer.beacons[:, row], expected, atol=1e-5)


@pytest.mark.parametrize("turn_length", [3, 9])
def test_a_chat_turn_puts_its_last_queries_in_the_recent_ring(turn_length, tiny_checkpoint):
    """After a turn appended to a cache in use, the ring holds the turn's last min(n, n_recent)
    queries, oldest first, each with the position it was issued at."""
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    first, turn = [5, 9, 13, 17, 21, 25], [30 + 7 * i for i in range(turn_length)]
    config = CompressionConfig(policy="snapkv", budget=16, window=4, n_recent=5)
    cache = KVCache.allocate(model.config, 1, 40, torch.float32, CPU)
    manager = CompressionManager(config, cache, model.config.n_heads, model.rope_cos, model.rope_sin)
    prefill(model, cache, [first], policy=manager)
    prefill(model, cache, [turn], policy=manager)
    kept = min(turn_length, 5)
    recent, issued_at = manager.buffer.recent()
    expected = queries_of(model, first + turn)[:, :, :, -kept:]
    assert torch.allclose(recent, expected, atol=1e-5)
    assert issued_at[0].tolist() == list(range(len(first) + turn_length - kept, len(first) + turn_length))


@pytest.mark.parametrize("policy", ["none", "beacon", "snapkv"])
@pytest.mark.parametrize("turn", ["first", "chat"])
def test_no_layer_queries_outlive_their_layer_in_prefill(policy, turn, tiny_checkpoint):
    """Each layer's queries are a view that pins its whole q/k/v output: a prefill with a KV
    policy used to keep every layer's ([L, B, H, T, D], many times a long prompt's KV cache)."""
    import weakref

    from engine.options import RunOptions, open_session

    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    config = CompressionConfig(policy=policy, budget=32, window=4, n_beacon=4, n_recent=4)
    session = open_session(model, 1, 120, RunOptions(compression=config), eos_ids=frozenset())
    if turn == "chat":
        session.prefill([[5, 9, 13, 17, 21]])
    first_queries, alive_after_the_layers = [], []
    # The queries are a view of the first layer's q/k/v output: while they live, so does it.
    model.layers[0].attn.wqkv.register_forward_hook(lambda m, i, out: first_queries.append(weakref.ref(out)))
    model.norm.register_forward_hook(lambda m, i, out: alive_after_the_layers.append(first_queries[0]() is not None))
    session.prefill([list(range(40, 70))])
    assert alive_after_the_layers == [False]


def test_fps_per_group_picks_the_same_steps_for_a_groups_heads_by_fps_on_them_side_by_side(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    config = CompressionConfig(policy="beacon", budget=8, n_beacon=3, n_recent=4, fps_per_group=True)
    cache = KVCache.allocate(model.config, 2, 40, torch.float32, CPU)
    manager = CompressionManager(config, cache, model.config.n_heads, model.rope_cos, model.rope_sin)
    torch.manual_seed(16)
    candidates = torch.randn(2, model.config.n_heads, 9, model.config.head_dim)  # one layer's [B, H, N, D]
    got = manager._farthest(candidates, None)
    G = model.config.n_heads // model.config.n_kv_heads
    for b in range(2):
        for kv in range(model.config.n_kv_heads):
            side_by_side = torch.cat([candidates[b, h] for h in range(kv * G, (kv + 1) * G)], dim=-1)  # [N, G x D]
            steps = brute_force_fps(side_by_side, 3, [True] * 9)
            for h in range(kv * G, (kv + 1) * G):
                assert torch.equal(got[b, h], candidates[b, h, steps])


def test_a_lazy_refresh_runs_once_per_compaction(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    prompts = [[5 + i for i in range(7)]]
    for lazy in (False, True):
        config = CompressionConfig(policy="beacon", budget=8, hysteresis=12, window=3, n_beacon=3, n_recent=4, lazy_refresh=lazy)
        stats = generate(model, prompts, 60, eos_ids=frozenset(), options=RunOptions(compression=config)).compression
        assert len(stats.refresh_s) == (stats.compactions if lazy else 59 // 4)


def test_a_long_prompt_keeps_its_sinks_its_tail_and_its_best_scored_middle(tiny_checkpoint, monkeypatch):
    """Prefix compression: each long prompt keeps its first PREFIX_SINKS and last prefix_tail
    tokens and the prefix_budget middle tokens its policy scores best, per layer and KV head,
    scored with the prompt's last queries at their own positions; each kept slot holds exactly
    the key and value of its position; a short prompt is kept whole; later compactions leave the
    compressed prompt alone."""
    from compression.config import PREFIX_SINKS

    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    config = CompressionConfig(policy="snapkv", budget=8, hysteresis=4, window=3, n_recent=4, prefix_budget=6, prefix_tail=5)
    prompts = [torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(17)).tolist() for n in (31, 14)]  # 14 <= 4 + 6 + 5: kept whole
    scored = []
    monkeypatch.setitem(SCORERS, "snapkv", lambda x: (scored.append((x.recent.clone(), x.keys[..., 1].clone())), x.keys[..., 1].clone())[1])
    cache = KVCache.allocate(model.config, 2, config.slots_needed(31, 40), torch.float32, CPU)
    full = KVCache.allocate(model.config, 2, 31, torch.float32, CPU)
    prefill(model, full, prompts)
    manager = CompressionManager(config, cache, model.config.n_heads, model.rope_cos, model.rope_sin)
    prefill(model, cache, prompts, policy=manager)
    assert cache.prompt_length.tolist() == cache.length.tolist() == [PREFIX_SINKS + 6 + 5, 14] and cache.position.tolist() == [31, 14]
    assert len(scored) == model.config.n_layers  # row 0's layers only
    reference = queries_of(model, prompts[0])[:, :, :, -4:]  # the prompt's last 4 queries, pre-RoPE
    at = torch.arange(27, 31)
    for layer in range(model.config.n_layers):
        recent, scores = scored[layer]
        assert torch.allclose(recent, apply_rope(reference[layer], model.rope_cos[at][None], model.rope_sin[at][None]), atol=1e-5)
        positions = manager.slot_positions()[layer, 0]  # [H_kv, S]
        for h in range(model.config.n_kv_heads):
            best = (scores[0, h].topk(6).indices + PREFIX_SINKS).tolist()
            held = positions[h, :15].tolist()
            assert held == [0, 1, 2, 3, *sorted(best), 26, 27, 28, 29, 30]
            assert torch.equal(cache.k[layer, 0, h, :15], full.k[layer, 0, h, held]) and torch.equal(cache.v[layer, 0, h, :15], full.v[layer, 0, h, held])
    assert torch.equal(cache.k[:, 1, :, :14], full.k[:, 1, :, :14])
    prefix = cache.k[:, :, :, :15].clone()
    tokens, finished, eos = torch.tensor([3, 4]), torch.zeros(2, dtype=torch.bool), torch.tensor([-1])
    for _ in range(40):
        decode_step(model, cache, StepState(tokens, finished, eos, SamplingConfig()), manager)
        manager.after_step()
    assert manager.stats.compactions > 0 and torch.equal(cache.k[:, 0, :, :15], prefix[:, 0]) and torch.equal(cache.k[:, 1, :, :14], prefix[:, 1, :, :14])
    with pytest.raises(UserError, match="--kv-prefix-budget needs a policy that scores a prompt"):
        CompressionConfig(policy="h2o", prefix_budget=8)


def test_a_manager_resumes_from_a_snapshot_with_or_without_the_beacons(tiny_checkpoint):
    """The evaluation resumes every policy from the full cache's recorder (BeaconKV's buffer,
    [beacons | ring]) through the manager's own snapshot and resume: a policy without beacons takes
    the ring alone at the same offsets, H2O the attention sums too."""
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    recorder = CompressionConfig(policy="beacon", budget=64, window=4, n_beacon=4, n_recent=6)
    session = open_session(model, 2, recorder.slots_needed(9, 40), RunOptions(compression=recorder), eos_ids=frozenset())
    session.policy.track_received_attention("sum")
    session.prefill([[5] * 9, [7] * 6])
    for _ in range(9):
        session.step()
    source = session.policy
    saved = source.snapshot()
    for policy, beacons in (("beacon", 4), ("h2o", 0), ("streaming", 0)):
        config = CompressionConfig(policy=policy, budget=64, window=4, n_beacon=4, n_recent=6)
        twin = CompressionManager(config, source.cache, model.config.n_heads, model.rope_cos, model.rope_sin)
        twin.resume(saved)
        skip = 4 - beacons
        assert torch.equal(twin.buffer.queries, source.buffer.queries[:, :, :, skip:])
        assert torch.equal(twin.buffer.issued_at, source.buffer.issued_at) and int(twin.buffer.slot) == int(source.buffer.slot) - skip
        assert twin.received.keys() == source.received.keys() == {"sum"} and torch.equal(twin.received["sum"], source.received["sum"])
        assert (twin.buffer.recorded, twin.generated) == (source.buffer.recorded, source.generated) == (9, 9)
    h2o = CompressionManager(CompressionConfig(policy="h2o", budget=64, window=4, n_recent=6), source.cache, model.config.n_heads, model.rope_cos, model.rope_sin)
    with pytest.raises(ValueError, match="no record of the attention received as a sum"):
        h2o.resume(saved | {"received": {}})
    maxattn = CompressionManager(CompressionConfig(policy="maxattn", budget=64, window=4, n_recent=6), source.cache, model.config.n_heads, model.rope_cos, model.rope_sin)
    with pytest.raises(ValueError, match="no record of the attention received as a max"):
        maxattn.resume(saved)
