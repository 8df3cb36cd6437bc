"""The full cache's pass, saved beside the results: a resumed run loads it instead of decoding
the whole batch again (45 min for SmolLM2's default run on a 2-core CPU).

What is saved is what the cells need: the full cache's predictions and log-probabilities, and
each snapshot a policy resumes from (the slots in use, the recorder's query buffer, H2O's sums).
The file carries the settings it was made with and is used only under the same ones, but for
the policies, BeaconKV's aggregation and defaults, and the budgets (a subset will do; any, when every
cell's cache is of other storage and so starts from the first token), which the full cache does
not depend on: a run of other policies (an ablation) can start from another run's pass (`--full-pass`).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from compression.config import CompressionConfig
from compression.manager import CompressionManager, CompressionStats
from kv.cache import KVCache
from errors import UserError
from evaluation.config import cells_attention_records, split_storage
from evaluation.runs import CPU, Run, State
from evaluation.saving import write_atomically_with
from models.transformer import Transformer


def save(path: Path, settings: dict, full: Run, snapshots: dict[int, State]) -> None:
    data = {
        "settings": settings,
        "full": {"predicted": full.predicted, "logprob": full.logprob, "steps": full.steps, "seconds": full.seconds, "kv_cache_bytes": full.kv_cache_bytes},
        "snapshots": {step: _state_to_dict(state) for step, state in snapshots.items()},
    }
    write_atomically_with(path, lambda partial: torch.save(data, partial))


def resumed_budgets(settings: dict) -> set[int]:
    """The budgets whose cells may resume from a snapshot: none when every policy keeps its cache
    in other storage, since such a cache differs from the first token on."""
    if all(split_storage(policy)[1] != "auto" for policy in settings.get("policies", ())):
        return set()
    return set(settings.get("budgets", ()))


def load(
    path: Path, settings: dict, model: Transformer, recorder: CompressionConfig, n_slots: int, required: bool = False
) -> tuple[Run, dict[int, State]] | None:
    """The saved pass, or None when there is none or it was made with other settings (or without
    the attention sums H2O resumes from, when this run has H2O). With `required` (a pass the
    user named) those are errors instead."""
    try:
        data = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, pickle.UnpicklingError) as e:
        if required:
            raise UserError(f"cannot read the full cache's pass from {path}: {e}; drop --full-pass to compute this run's own") from e
        return None
    saved, ours = _comparable(data["settings"]), _comparable(settings)
    differ = sorted(k for k in saved.keys() | ours.keys() if saved.get(k) != ours.get(k))
    if not resumed_budgets(settings) <= set(data["settings"].get("budgets", ())):
        differ.append("budgets (the pass holds snapshots for its own budgets only)")
    if not all(isinstance(saved.get("received"), dict) for saved in data["snapshots"].values()):
        differ.append("format (saved before the attention received was recorded by name; it cannot be resumed)")
    needed = cells_attention_records(tuple(settings.get("policies", ())))
    if lacking := needed - cells_attention_records(tuple(data["settings"].get("policies", ()))):
        differ.append(f"policies (this run scores by the attention received as a {', '.join(sorted(lacking))}, which the pass does not record)")
    if differ and required:
        raise UserError(f"{path} was saved with other settings ({', '.join(differ)}); drop --full-pass to compute this run's own")
    if differ:
        return None
    f = data["full"]
    full = Run("none", None, f["predicted"], f["logprob"], [], f["steps"], f["seconds"], CompressionStats(), f["kv_cache_bytes"], 0)
    snapshots = {step: _state_from_dict(saved, model, recorder, n_slots, bool(needed)) for step, saved in data["snapshots"].items()}
    return full, snapshots


def _comparable(settings: dict) -> dict:
    """What the full cache's pass depends on: not the folder, the policies, the aggregation or
    BeaconKV's defaults (its recorder is pinned); budgets only in that each needs its snapshot."""
    return {k: v for k, v in settings.items() if k not in ("out", "policies", "aggregation", "budgets", "beacon_defaults")}


def _state_to_dict(state: State) -> dict:
    cache, manager = state.cache, state.manager
    used = int(cache.length.max())  # the slots past every row's length hold nothing yet
    return {
        "k": cache.k[:, :, :, :used].clone(), "v": cache.v[:, :, :, :used].clone(),
        "length": cache.length, "position": cache.position, "prompt_length": cache.prompt_length,
        **manager.snapshot(),
        "tokens": state.tokens, "step": state.step, "predicted": state.predicted, "logprob": state.logprob, "after_step_due": state.after_step_due,
    }  # fmt: skip


def _state_from_dict(saved: dict, model: Transformer, recorder: CompressionConfig, n_slots: int, with_received: bool) -> State:
    B, used = saved["length"].shape[0], saved["k"].shape[3]
    cache = KVCache.allocate(model.config, B, n_slots, saved["k"].dtype, CPU)
    cache.k[:, :, :, :used] = saved["k"]
    cache.v[:, :, :, :used] = saved["v"]
    for counter in ("length", "position", "prompt_length"):
        getattr(cache, counter).copy_(saved[counter])
    manager = CompressionManager(recorder, cache, model.config.n_heads, model.rope_cos, model.rope_sin)
    # The attention received is recorded only for the policies that score by it: any other resumed from it would carry it.
    manager.resume(saved if with_received else saved | {"received": {}})
    return State(cache, manager, saved["tokens"], saved["step"], saved["predicted"], saved["logprob"], saved["after_step_due"])
