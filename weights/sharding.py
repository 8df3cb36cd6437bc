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

from functools import partial
from pathlib import Path

import torch

from errors import UserError
from models.config import ModelConfig
from models.parallel import RankTransformer, TensorParallel
from weights.loader import Part, locate_tensors, place_state, read_config, read_state, stored_quantized, whole

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


def load_rank(checkpoint: Path, dtype: torch.dtype, device: torch.device, parallel: TensorParallel, quant: str = "none") -> RankTransformer:
    """This rank's part of the model of a checkpoint folder of 16/32-bit weights (quant: what was
    asked for, which only "none" is)."""
    config = read_config(checkpoint)
    if quant != "none" and stored_quantized(checkpoint):
        raise UserError(f"{checkpoint} is already quantized and runs as stored; leave out --quant (it is for 16/32-bit checkpoints)")
    if quant != "none":
        raise UserError(f"tensor parallelism runs 16/32-bit weights only; drop --quant {quant}, or run without torchrun")
    if stored_quantized(checkpoint):
        raise UserError(f"{checkpoint} is stored quantized and tensor parallelism runs 16/32-bit weights only; run it without torchrun, or give a 16/32-bit checkpoint")
    # Built first, so that a rank's part that cannot be cut fails on every rank at once, before the reading.
    with torch.device("meta"):
        model = RankTransformer(config, parallel)
    parts_of = partial(rank_parts, config=config, parallel=parallel)
    return place_state(model, read_state(locate_tensors(checkpoint, config), config, dtype, device, parts_of), device)
