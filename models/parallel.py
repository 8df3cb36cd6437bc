"""Tensor parallelism: one model across N processes (ranks), and the two collectives the model calls.

Each rank holds about 1/N of every layer (Megatron's split, as gpt-fast and vLLM do it):
- q/k/v and gate/up are split by their outputs (the rows of their [out, in] weights; Megatron's
  column-parallel layers): a rank computes whole heads (its own KV heads, whose keys and values
  only it caches, with their query heads) and a slice of the MLP's hidden units. Where N does
  not divide the KV heads the blocks differ by one head (SmolLM2's 3 KV heads on 2 ranks: 1
  and 2); a rank needs at least one;
- o_proj and down_proj are split by their inputs (row-parallel): each rank's product is a
  partial sum of the output, and `reduce_sum` adds the N partial sums (one all-reduce after
  attention, one after the MLP);
- the embedding table and the LM head are split by vocabulary rows: a rank looks up only the
  tokens it holds (zeros for the others, summed by one all-reduce) and computes the logits of
  its rows, which `gather_vocab` puts side by side on every rank.
Norms and RoPE are replicated. Every rank ends a step with the same logits, so each samples the
same token with the same seed: no broadcast is needed.

A rank's model is the same Transformer, built from `shard_config` (the model's config with the
rank's heads and MLP width) by `rank_model`, which puts in the vocabulary's split and hooks the
sums onto the layers' outputs from outside: the model itself knows nothing of ranks. The KV cache
and the KV policies read their sizes from its config, so they hold and compress only the rank's
own KV heads.
"""

import os
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from errors import UserError
from models.config import ModelConfig
from models.linear import Linear
from models.transformer import Transformer


# The functional collectives' own ops, each waited at once; torch.compile traces them into its
# graphs. Not their wrappers (torch.distributed._functional_collectives), which keep the process
# group alive after it is destroyed, so that gloo's threads outlive the run (docs/tensor-parallel.md).
COLLECTIVES = torch.ops._c10d_functional


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    world: int
    group: dist.ProcessGroup

    def block(self, total: int) -> tuple[int, int]:
        """This rank's [first, end) of `total` things split as evenly as whole things split."""
        return self.rank * total // self.world, (self.rank + 1) * total // self.world

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """The vocabulary rows of the embedding table and LM head this rank holds (the same count
        on every rank, since the logits are gathered in equal blocks)."""
        return self.block(vocab_size)


def start(device: torch.device, timeout_s: float) -> tuple[TensorParallel, torch.device]:
    """Join the ranks torchrun started: gloo between CPU processes, NCCL between GPUs, one GPU per
    rank (its LOCAL_RANK). Returns this rank's place and its device."""
    if not dist.is_available():
        raise UserError("this torch build has no torch.distributed; run without torchrun, or install a torch that has it")
    backend = {"cpu": "gloo", "cuda": "nccl"}.get(device.type)
    if backend is None:
        raise UserError(f"tensor parallelism has no backend for {device.type} devices (gloo for CPU, NCCL for CUDA); use --device cpu or cuda")
    if backend == "nccl" and not dist.is_nccl_available():
        raise UserError("this torch build has no NCCL, which tensor parallelism on CUDA needs; use --device cpu (gloo)")
    if backend == "gloo" and not dist.is_gloo_available():
        raise UserError("this torch build has no gloo, which tensor parallelism on CPU needs; run without torchrun")
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"rank {local_rank} needs GPU {local_rank}, but {torch.cuda.device_count()} are visible; start at most that many ranks per machine")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as e:
        raise UserError(f"could not join the other ranks ({e}); launch with torchrun --nproc-per-node N") from None
    return TensorParallel(dist.get_rank(), dist.get_world_size(), dist.group.WORLD), device


def stop(parallel: TensorParallel, finished: bool) -> None:
    """Leave the ranks. After a run that finished, wait for every rank first, so that no rank tears
    its process group down while another's last collective is in flight (docs/tensor-parallel.md)."""
    if finished:
        try:
            dist.barrier(group=parallel.group)
        except RuntimeError:  # another rank ended on an error of its own, which it reports; this one's run is done
            pass
    if dist.is_initialized():
        dist.destroy_process_group()


def kv_head_place(config: ModelConfig, parallel: TensorParallel | None) -> tuple[int, int] | None:
    """This rank's first KV head among the whole model's `config`, and their count (None: one process holds them all)."""
    return None if parallel is None else (parallel.block(config.n_kv_heads)[0], config.n_kv_heads)


def from_rank0(value: object, parallel: TensorParallel | None) -> object:
    """Rank 0's value on every rank (what only rank 0 can read, such as stdin)."""
    if parallel is None:
        return value
    held = [value]
    dist.broadcast_object_list(held, src=0, group=parallel.group)
    return held[0]


def shard_config(config: ModelConfig, parallel: TensorParallel) -> ModelConfig:
    """This rank's part of the model: its KV heads with their query heads, its block of the MLP
    width, and the vocabulary whole (the rank holds a block of its rows, and gathers all the logits)."""
    world = parallel.world
    if world > config.n_kv_heads:
        raise UserError(
            f"{world} ranks cannot split this model's {config.n_kv_heads} key-value heads: each rank holds whole KV heads; "
            f"start at most {config.n_kv_heads} ranks"
        )
    if config.vocab_size % world:
        divisors = [n for n in range(1, config.n_kv_heads + 1) if config.vocab_size % n == 0]
        raise UserError(
            f"{world} ranks cannot split this model's vocabulary of {config.vocab_size} into equal blocks; "
            f"start a number of ranks that divides it: {', '.join(map(str, divisors))}"
        )
    first, end = parallel.block(config.n_kv_heads)
    group = config.n_heads // config.n_kv_heads
    mlp_first, mlp_end = parallel.block(config.intermediate_size)
    return replace(config, n_heads=(end - first) * group, n_kv_heads=end - first, intermediate_size=mlp_end - mlp_first)


def reduce_sum(x: torch.Tensor, parallel: TensorParallel | None) -> torch.Tensor:
    """The sum of every rank's x (partial products of a row-split layer); x itself on one rank."""
    if parallel is None:
        return x
    # gloo sums in float32 (docs/tensor-parallel.md: its 16-bit sum is slower, or missing); the
    # result is rounded once on the way back.
    widened = x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)
    summed = COLLECTIVES.all_reduce(x.float() if widened else x, "sum", parallel.group.group_name)
    return COLLECTIVES.wait_tensor(summed).to(x.dtype)


def gather_vocab(logits: torch.Tensor, parallel: TensorParallel | None) -> torch.Tensor:
    """[..., V/N] each rank's logits -> [..., V] all of them, in vocabulary order, on every rank."""
    if parallel is None:
        return logits
    parts = logits.movedim(-1, 0).contiguous()  # [V/N, ...]
    gathered = COLLECTIVES.all_gather_into_tensor(parts, parallel.world, parallel.group.group_name)  # [V, ...]
    return COLLECTIVES.wait_tensor(gathered).movedim(0, -1)


class VocabPartEmbedding(nn.Embedding):
    """A rank's block of the embedding table's rows. Each rank looks up the tokens it holds and
    contributes zeros for the others: the sum over ranks is every token's row, exactly."""

    def __init__(self, first: int, rows: int, dim: int, parallel: TensorParallel):
        super().__init__(rows, dim, _weight=torch.empty(rows, dim))
        self.first, self.parallel = first, parallel

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, C]
        held = (tokens >= self.first) & (tokens < self.first + self.num_embeddings)  # [B, T]
        rows = super().forward(torch.where(held, tokens - self.first, 0))  # [B, T, C]
        return reduce_sum(rows * held.unsqueeze(-1).to(rows.dtype), self.parallel)


class VocabPartHead(Linear):
    """A rank's block of the LM head's rows; the logits of every rank, gathered in vocabulary order."""

    def __init__(self, dim: int, rows: int, parallel: TensorParallel):
        super().__init__(dim, rows, bias=False)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_vocab(super().forward(x), self.parallel)


class RankTransformer(Transformer):
    """This rank's part of the model of `config` (the whole model's): its config is the part's
    (shard_config), the vocabulary whole. The row-split layers' partial outputs (o_proj and
    down_proj) are summed over the ranks by hooks on the attention and the MLP."""

    def __init__(self, config: ModelConfig, parallel: TensorParallel):
        part = shard_config(config, parallel)
        super().__init__(part)
        self.parallel = parallel
        first, end = parallel.vocab_rows(part.vocab_size)
        self.embed = VocabPartEmbedding(first, end - first, part.hidden_size, parallel)
        self.lm_head = VocabPartHead(part.hidden_size, end - first, parallel)
        for block in self.layers:
            for summed in (block.attn, block.mlp):
                summed.register_forward_hook(lambda module, inputs, out: reduce_sum(out, parallel))
