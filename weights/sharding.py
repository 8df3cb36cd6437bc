"""Which part of each checkpoint tensor a rank of a tensor-parallel run loads (models/parallel.py).

Every engine tensor is made of one or more Hugging Face tensors, concatenated along rows
(weights/loader.engine_sources). Under tensor parallelism a rank takes of each:
- q, k, v, gate, up (weights and biases): its block of output rows: whole KV heads, and the
  query heads that read them;
- o_proj and down_proj weights: its block of input columns; their biases are added once, by
  rank 0 (the other ranks hold zeros), since the ranks' outputs are summed;
- the embedding table and the LM head: its block of vocabulary rows;
- norms: all of it.
Only those parts are read from the files, so a rank's memory holds about 1/N of the weights.
"""

from dataclasses import dataclass

from models.config import ModelConfig
from models.parallel import TensorParallel

Span = tuple[int, int]  # [first, end)


@dataclass(frozen=True)
class Part:
    """The rows and columns of one checkpoint tensor that go into an engine tensor (None: all of them)."""

    name: str
    rows: Span | None = None
    columns: Span | None = None


def whole(sources: list[str]) -> list[Part]:
    return [Part(name) for name in sources]


def rank_parts(engine_name: str, sources: list[str], config: ModelConfig, parallel: TensorParallel | None) -> list[Part] | None:
    """The parts of `sources` this rank loads into `engine_name`, in order; None for a bias this
    rank holds as zeros. config is the whole model's."""
    if parallel is None:
        return whole(sources)
    first, end = parallel.block(config.n_kv_heads)
    D, G = config.head_dim, config.n_heads // config.n_kv_heads
    kv_rows, q_rows = (first * D, end * D), (first * G * D, end * G * D)  # query head h reads KV head h // G
    mlp = parallel.block(config.intermediate_size)
    if engine_name in ("embed.weight", "lm_head.weight"):
        return [Part(sources[0], rows=parallel.vocab_rows(config.vocab_size))]
    if engine_name.endswith(("attn.wqkv.weight", "attn.wqkv.bias")):
        q, k, v = sources
        return [Part(q, rows=q_rows), Part(k, rows=kv_rows), Part(v, rows=kv_rows)]
    if engine_name.endswith(("mlp.w_gate_up.weight", "mlp.w_gate_up.bias")):
        return [Part(name, rows=mlp) for name in sources]
    if engine_name.endswith("attn.wo.weight"):
        return [Part(sources[0], columns=q_rows)]
    if engine_name.endswith("mlp.w_down.weight"):
        return [Part(sources[0], columns=mlp)]
    if engine_name.endswith(("attn.wo.bias", "mlp.w_down.bias")):
        return whole(sources) if parallel.rank == 0 else None
    return whole(sources)


def parts_shape(parts: list[Part], shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of the engine tensor `parts` make, given each checkpoint tensor's whole shape."""
    rows = sum(_extent(p.rows, shapes[p.name][0]) for p in parts)
    first = parts[0]
    if len(shapes[first.name]) == 1:
        return (rows,)
    return (rows, _extent(first.columns, shapes[first.name][1]))


def _extent(span: Span | None, size: int) -> int:
    return size if span is None else span[1] - span[0]
