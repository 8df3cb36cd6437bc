"""The compiled decode step saved as a package (AOTInductor), for a plain run on CPU.

torch.compile's groups (engine/compile.py) are found again in every new process by tracing the
step and loading inductor's cached code, and every call into them passes through dynamo's cache
lookup. Here a group of blocks is exported once (torch.export), compiled ahead of time into a
package in inductor's cache folder, and loaded by a later process in milliseconds; a call goes
straight into the compiled code.

The package takes its blocks' weights as inputs, so that one package serves every group of one
structure, and each layer's whole cache buffer [B, H_kv, S, D]: it writes the new keys and values
into it and reads the first n slots, n being the mask's length. S and n are variables of the
compiled code; the batch, the tokens fed per row, the dtype and the weights' shapes are part of
the package's name. A speculative verify gets packages of its own (engine/verify.py).

It serves the plain cache (a float KVCache, no KV policy, one process): generate.py hands it to the
core's generate for a plain compiled run, engine/options.py picks it for a session of the plain
cache, and everything else keeps torch.compile's groups.
"""

import getpass
import hashlib
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from engine.block_groups import block_structure, group_size
from engine.cpu import inductor_options
from engine.decode import StepState
from kv.cache import RowsView
from models.transformer import Block, BlockGroups, LayerInputs, LayerKV, Transformer, run_blocks


class GroupOfBlocks(nn.Module):
    """Consecutive blocks over whole cache buffers: what a package computes. `view` wraps each
    layer's view of the slots read (a verify's attends position by position, engine/verify.py)."""

    def __init__(self, blocks: list[Block], view: Callable[[RowsView], LayerKV] | None = None):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.view = view

    def forward(self, x, cos, sin, slots, mask, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        n = mask.shape[-1]  # slots read
        kvs = [RowsView(k[:, :, :n], v[:, :, :n]) for k, v in zip(keys, values)]
        kvs = kvs if self.view is None else [self.view(kv) for kv in kvs]
        return run_blocks(list(self.blocks), x, LayerInputs(cos, sin, slots, mask), kvs)


class WeightsAsInputs(nn.Module):
    """A group whose weights are inputs, not constants of the graph: one package for every group alike."""

    def __init__(self, group: GroupOfBlocks):
        super().__init__()
        object.__setattr__(self, "group", group)  # not a submodule: its weights must not become the package's constants
        self.names = weight_names(group)

    def forward(self, x, cos, sin, slots, mask, keys, values, weights):
        with torch.nn.utils.stateless._reparametrize_module(self.group, dict(zip(self.names, weights))):
            return self.group.forward(x, cos, sin, slots, mask, keys, values)  # forward, not the call, which export would trace as a submodule's


def weight_names(group: GroupOfBlocks) -> list[str]:
    return [name for name, _ in group.named_parameters()] + [name for name, _ in group.named_buffers()]


def whole_buffer(view: torch.Tensor) -> torch.Tensor:
    """A layer's whole buffer [B, H_kv, S, D] from the view of its first slots [B, H_kv, n, D]
    (the plain cache's layers: each one a contiguous part of the [L, ...] buffer)."""
    B, H, _, D = view.shape
    return view.as_strided((B, H, view.stride(1) // D, D), view.stride())


def package_path(blocks: list[Block], rows: tuple[int, int], view: Callable[[RowsView], LayerKV] | None, dtype: torch.dtype, options: dict[str, object]) -> Path:
    """Where the package of this structure lives: inductor's cache folder, named by everything the
    compiled code depends on (rows: the batch and the tokens fed per row; the view, GroupOfBlocks;
    the torch version and the CPU kernels' width included)."""
    view_name = "step" if view is None else view.__name__
    identity = repr((torch.__version__, [block_structure(b) for b in blocks], rows, view_name, dtype, sorted(options.items())))
    return Path(inductor_cache()) / "saved_steps" / f"{hashlib.sha256(identity.encode()).hexdigest()[:32]}.pt2"


def inductor_cache() -> str:
    """Inductor's cache folder, found as torch finds it but without importing inductor (a second),
    which a run that loads its packages never needs."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")


def load_package(path: Path):
    """The package's compiled code, through torch's C++ loader: inductor's Python wrapper would
    import inductor and parse the call's input layout again at every call."""
    return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)


def build_package(path: Path, group: GroupOfBlocks, x: torch.Tensor, inputs: LayerInputs, keys: list[torch.Tensor], options: dict[str, object], max_slots: int) -> None:
    """Export the group on copies of its inputs (a session's tensors are inference tensors) and compile it."""
    from torch.export import Dim, export

    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.* is deprecated")  # raised inside torch's own export (2.13), nothing for the user to do
        weights = [dict(group.named_parameters(), **dict(group.named_buffers()))[name].clone() for name in weight_names(group)]
        example = (x.clone(), inputs.cos.clone(), inputs.sin.clone(), inputs.write_slots.clone(), inputs.mask.clone(), [k.clone() for k in keys], [k.clone() for k in keys], weights)
        fed = x.shape[1]  # a row holds at least one slot before the ones fed
        n, s = Dim("slots_read", min=fed + 1, max=max_slots), Dim("slots", min=fed + 1, max=max_slots)
        shapes = (None, None, None, None, {3: n}, [{2: s}] * len(keys), [{2: s}] * len(keys), [None] * len(weights))
        program = export(WeightsAsInputs(group), example, dynamic_shapes=shapes, strict=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.building.pt2")  # another process never loads a package half written
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=dict(options))  # a copy: it adds its own
        os.replace(partial, path)


def package_options(model: Transformer) -> dict[str, object]:
    return {k: v for k, v in inductor_options(model.device, tensor_parallel=False).items() if k != "cpp_wrapper"}


def saved_already(model: Transformer, batch: int, fed: int = 1, view: Callable[[RowsView], LayerKV] | None = None) -> bool:
    """Whether every group of the model's blocks has its package saved for this batch and number of
    tokens fed per row (and view, GroupOfBlocks): a run then loads it and compiles nothing."""
    size = group_size([block_structure(block) for block in model.layers])
    groups = [list(model.layers[first : first + size]) for first in range(0, len(model.layers), size)]
    return all(package_path(blocks, (batch, fed), view, model.dtype, package_options(model)).is_file() for blocks in groups)


def saved_blocks(model: Transformer, view: Callable[[RowsView], LayerKV] | None = None) -> BlockGroups:
    """The model's blocks run by packages: built on the first call of a structure unless saved,
    then loaded. `view`: how each layer attends (GroupOfBlocks), a package of its own."""
    size = group_size([block_structure(block) for block in model.layers])
    options = package_options(model)
    runners: dict[Path, object] = {}
    groups: dict[tuple[int, int], tuple[GroupOfBlocks, Path, list[torch.Tensor]]] = {}  # by first block and tokens fed

    def run(blocks: list[Block], x: torch.Tensor, inputs: LayerInputs, kvs: list[RowsView]) -> torch.Tensor:
        keys, values = [whole_buffer(kv.k) for kv in kvs], [whole_buffer(kv.v) for kv in kvs]
        if (id(blocks[0]), x.shape[1]) not in groups:
            group = GroupOfBlocks(blocks, view)
            tensors = dict(group.named_parameters(), **dict(group.named_buffers()))
            path = package_path(blocks, tuple(x.shape[:2]), view, x.dtype, options)
            groups[id(blocks[0]), x.shape[1]] = group, path, [tensors[name] for name in weight_names(group)]
        group, path, weights = groups[id(blocks[0]), x.shape[1]]
        if path not in runners:
            if not path.is_file():
                build_package(path, group, x, inputs, keys, options, model.config.max_position_embeddings)
            try:
                runners[path] = load_package(path)
            except RuntimeError:  # a package damaged on disk (a full disk, a copy cut short): built again
                build_package(path, group, x, inputs, keys, options, model.config.max_position_embeddings)
                runners[path] = load_package(path)
        with torch.profiler.record_function("saved step"):  # the package's kernels, one event for a profile (bench.py --profile)
            # The inputs in the order export flattened them.
            return runners[path].boxed_run([x, inputs.cos, inputs.sin, inputs.write_slots, inputs.mask, *keys, *values, *weights])[0]

    return BlockGroups(run, size)


class Saved:
    """The runner whose step runs saved packages of blocks, reading only the slots in use."""

    builds = True
    whole_cache = False
    graph = False

    def build(self, model: Transformer, step, state: StepState, advanced: list[torch.Tensor]):
        state.blocks = saved_blocks(model)
        return step
