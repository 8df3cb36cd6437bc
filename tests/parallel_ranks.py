"""The ranks of a tensor-parallel test run, launched by tests/test_parallel.py under torchrun.

    torchrun --standalone --nproc-per-node 2 tests/parallel_ranks.py CASES.json OUT.json

Every rank runs each case of CASES.json (a list of `Case` fields) on its part of the model; rank
0 writes each case's tokens, and whether every rank produced the same, to OUT.json, with the
threads it still runs once the ranks have stopped. The test runs the same cases in one process
with `run_case(..., parallel=None)` and compares.
"""

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from compression.config import CompressionConfig
from engine.options import RunOptions, generate
from kv.paged import PageConfig
from engine.sampling import SamplingConfig
from engine.scheduler import Request, serve
from models import parallel
from models.parallel import TensorParallel, kv_head_place
from weights.forms import load_model
from weights.sharding import load_rank
from weights.loader import read_config

PROMPTS = ((1, 5, 9, 33, 7) * 6, (4, 8, 15, 16, 23, 42, 99) * 5, (3, 17))


@dataclass(frozen=True)
class Case:
    checkpoint: str
    new_tokens: int = 24
    dtype: str = "float32"
    policy: str = "none"
    compile: bool = False
    paged: bool = False
    continuous: bool = False  # continuous batching, two rows at a time
    temperature: float = 0.0
    prompts: tuple[tuple[int, ...], ...] = PROMPTS
    budget: int = 8  # the KV policy's; its hysteresis and window are half of it
    device: str = "cpu"  # cuda: one GPU per rank, NCCL (every case of a run on the same kind of device)
    cuda_graph: bool = False


def run_case(case: Case, tp: TensorParallel | None, device: torch.device | None = None) -> list[list[int]]:
    """The case's tokens per prompt, on this rank's part of the model (tp, on the rank's device) or
    on the whole of it (None)."""
    torch.manual_seed(0)
    checkpoint, dtype, device = Path(case.checkpoint), getattr(torch, case.dtype), device or torch.device(case.device)
    model = load_model(checkpoint, dtype, device) if tp is None else load_rank(checkpoint, dtype, device, tp)
    half = case.budget // 2
    kv_heads = kv_head_place(read_config(Path(case.checkpoint)), tp)
    compression = CompressionConfig() if case.policy == "none" else CompressionConfig(policy=case.policy, budget=case.budget, hysteresis=half, window=half, kv_heads=kv_heads)
    prompts = [list(p) for p in case.prompts]
    sampling = SamplingConfig(temperature=case.temperature, top_k=20)
    with torch.inference_mode():
        if case.continuous:
            requests = [Request(prompt, case.new_tokens) for prompt in prompts]
            return serve(model, requests, 2, eos_ids=frozenset(), sampling=sampling, options=RunOptions(compression=compression, pages=PageConfig(4), compile=case.compile, cuda_graph=case.cuda_graph)).tokens
        pages = PageConfig(4) if case.paged else None
        return generate(model, prompts, case.new_tokens, eos_ids=frozenset(), sampling=sampling, options=RunOptions(compile=case.compile, compression=compression, cuda_graph=case.cuda_graph, pages=pages)).tokens


def main(cases_file: str, out_file: str) -> None:
    cases = [Case(**fields | {"prompts": tuple(map(tuple, fields["prompts"]))}) for fields in json.loads(Path(cases_file).read_text())]
    tp, device = parallel.start(torch.device(cases[0].device), timeout_s=300)
    results = []
    for case in cases:
        tokens = run_case(case, tp, device)
        every_rank: list[object] = [None] * tp.world
        dist.all_gather_object(every_rank, tokens, group=tp.group)
        results.append({"case": asdict(case), "tokens": tokens, "ranks_agree": all(t == tokens for t in every_rank)})
    rank = tp.rank
    parallel.stop(tp, finished=True)
    del tp  # the last reference to the process group: destroying it ends gloo's threads
    if rank == 0:
        Path(out_file).write_text(json.dumps({"cases": results, "threads_after_stop": thread_names()}))


def thread_names() -> list[str]:
    """Every thread of this process by its kernel name, C++ threads included (Linux)."""
    return [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]


if __name__ == "__main__":
    main(*sys.argv[1:])
