"""The verify of speculative decoding (engine/speculative.py): feed a row's last token and its
drafts in one forward pass, keep the drafts the target agrees with, and step the row back over
the rest."""

import torch

from engine.cpu import inductor_options
from engine.generation import Session
from engine.saved_step import Saved, saved_blocks
from engine.sampling import SamplingConfig, filter_logits
from kv.cache import KVCache, sdpa
from models.transformer import BlockGroups, CacheRead, LayerInputs, LayerKV, run_blocks


def step_back(cache: KVCache, n: int) -> None:
    """Forget the one row's last n slots: the tokens fed there never were."""
    if n:
        cache.length -= n
        cache.position -= n


def accept(logits: torch.Tensor, drafts: list[int], sampling: SamplingConfig) -> tuple[int, int]:
    """logits [j + 1, V]: the target's, after its last token and after each of the j drafts.
    Returns how many drafts are kept, and the token that follows them."""
    j = len(drafts)
    fed = torch.tensor(drafts, device=logits.device)  # [j]
    if sampling.temperature == 0:
        best = logits.argmax(dim=-1)  # [j + 1]
        n_kept = (best[:j] == fed).long().cumprod(0).sum()
        n, token = torch.stack([n_kept, best[n_kept]]).tolist()
        return n, token
    probs = filter_logits(logits, sampling).softmax(dim=-1)  # [j + 1, V]
    drafted = probs[:j].gather(1, fed[:, None])[:, 0]  # [j] each draft's probability under the target
    n_kept = (torch.rand(j, device=logits.device) < drafted).long().cumprod(0).sum()
    # After a rejected draft, the target's distribution without it; after the last draft, as it is.
    residual = torch.cat([probs[:j].scatter(1, fed[:, None], 0.0), probs[j:]])  # [j + 1, V]
    row = residual[n_kept]
    exponential = -torch.log(torch.rand_like(row, dtype=torch.float32).clamp_min(1e-20))  # float32: a reduced-precision draw can round to 1.0
    token = (row / exponential).argmax()  # a draw from row / row.sum() (the exponential race)
    n, token = torch.stack([n_kept, token]).tolist()
    return n, token


class AttendByPosition:
    """A verify's view of one layer: each fed position attends alone, over exactly the slots up to
    its own, as a decode step reads them. One attention over all of them sums in another order,
    and in bfloat16 that turns greedy tokens at near ties. The other ops treat positions apart;
    the 4- and 8-bit products compute each row alone, so there a position's logits are the plain
    step's bit for bit, while a float GEMM over several rows may round apart by ~1e-6."""

    def __init__(self, view: LayerKV):
        self.view = view  # the layer's first held + T slots

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.view.write(k, v, slots)

    def attend(self, q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, before_rope: torch.Tensor) -> torch.Tensor:
        k, v = self.view.read(q.dtype)  # [1, H_kv, held + T, D] each
        S, T = k.shape[2], q.shape[2]
        in_use = torch.ones(1, 1, 1, S, dtype=torch.bool, device=q.device)  # [B, 1, 1, S] as the step's, sliced per position
        out = []
        for i in range(T):
            n = S - T + 1 + i  # the slots up to position i's own
            out.append(sdpa(q[:, :, i : i + 1], k[:, :, :n], v[:, :, :n], in_use[..., :n]))
        return torch.cat(out, dim=2)  # [1, H, T, D]


def verify_blocks(blocks: list[torch.nn.Module], x: torch.Tensor, inputs: LayerInputs, kvs: list[LayerKV]) -> torch.Tensor:
    """run_blocks under a name of its own: compiled, its graphs and guards stay apart from the decode step's."""
    return run_blocks(blocks, x, inputs, kvs)


def compiled_verify(model: torch.nn.Module, size: int) -> BlockGroups:
    compiled = torch.compile(verify_blocks, fullgraph=True, options=inductor_options(model.device, tensor_parallel=False))

    def run(blocks: list[torch.nn.Module], x: torch.Tensor, inputs: LayerInputs, kvs: list[AttendByPosition]) -> torch.Tensor:
        for kv in kvs:  # one graph for every number of slots held
            for tensor, dim in kv.view.slots_read():
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        return compiled(blocks, x, inputs, kvs)

    return BlockGroups(run, size)


class Verifier:
    """Feeds the session's one row several tokens in one forward pass. When the session's step
    runs compiled blocks or saved packages, so does the verify (at the one width speculative.py
    then allows: each width is a graph or a package of its own to compile)."""

    def __init__(self, session: Session):
        self.session = session
        self.compiled: BlockGroups | None = None
        self.saved = isinstance(session.runner, Saved)

    def groups(self) -> BlockGroups | None:
        """The verify's blocks: saved packages of its own under a saved step, compiled once the
        session's step has compiled its groups, else eager (None)."""
        if self.compiled is None and self.saved:
            self.compiled = saved_blocks(self.session.model, AttendByPosition)
        elif self.compiled is None and self.session.state.blocks is not None:
            self.compiled = compiled_verify(self.session.model, self.session.state.blocks.size)
        return self.compiled

    def forward(self, tokens: list[int]) -> torch.Tensor:
        """Logits [T, V] after each of the tokens, fed after what the row holds."""
        session, cache = self.session, self.session.cache
        held, T, device = session.lengths[0], len(tokens), cache.length.device
        cache.fit(0, held + T)
        steps = torch.arange(T, device=device)
        slots = cache.length[:, None] + steps  # [1, T] slots to write
        groups = self.groups()
        if self.saved:  # the package wraps each layer's view itself, and reads as many slots as the mask is long
            read = CacheRead(cache.layers(held + T), slots, torch.ones(1, 1, T, held + T, dtype=torch.bool, device=device))
        else:
            read = CacheRead([AttendByPosition(view) for view in cache.layers(held + T)], slots, None)
        logits = session.model(torch.tensor([tokens], device=device), cache.position[:, None] + steps, read, groups=groups)
        cache.length += T
        cache.position += T
        return logits[0]


def verify(verifier: Verifier, last: int, drafts: list[int], sampling: SamplingConfig) -> tuple[int, int]:
    """Feed the last sampled token and the drafts into the session's one row, keep the drafts the
    target agrees with, and hand back the rest's slots. Returns the drafts kept and the next token,
    which the session holds as its next token to feed."""
    session = verifier.session
    cache, state = session.cache, session.state
    logits = verifier.forward([last, *drafts])  # [j + 1, V]
    n_kept, token = accept(logits, drafts, sampling)
    step_back(cache, len(drafts) - n_kept)
    session.lengths[0] += n_kept + 1
    cache.fit(0, session.lengths[0])
    state.tokens[0] = token
    state.finished[:1] = torch.isin(state.tokens[:1], state.eos)
    return n_kept, token
