"""Checkpoints of a parallelized Cell with each parameter's layout; loading reshards.

The platforms whose modules keep the local shard as the framework's own parameter (MindSpore: the
Cell's ``Parameter`` is the shard, the Cell's code sees a DTensor view of it) have no
``torch.distributed.checkpoint``; this module is their counterpart, with DCP's concepts: each rank
writes the blocks it owns with their global offsets (a replicated block once: by the rank at
coordinate 0 of every replicated mesh dim), and loading reads, for each parameter, the saved blocks
overlapping the block this rank needs -- whatever mesh, placements or number of processes saved
them.

A checkpoint is a directory: per saving rank, ``rank{r}.ckpt`` (a framework checkpoint of the
local blocks, under the parameters' names) and ``rank{r}.layout.json``::

    {"format": "hyper_parallel.layout/1", "rank": r, "world_size": n,
     "params": {name: {"global_shape": [...], "offsets": [...], "sizes": [...],
                       "mesh": {"shape": [...], "ranks": [...], "dim_names": [...]} | null,
                       "placements": [["Shard", 0], ["Replicate"], ...] | null}}}

``load_layout_checkpoint`` also takes a single-process framework checkpoint file (e.g.
``mindspore.save_checkpoint(net, "full.ckpt")``): every parameter in it is whole.
"""
from typing import Any
import json
import os
import re

import numpy as np

from hyper_parallel.core.dtensor.checkpoint import _encode_placement, checkpoint_box
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.platform import get_platform

__all__ = ["save_layout_checkpoint", "load_layout_checkpoint", "read_layouts"]

FORMAT = "hyper_parallel.layout/1"


def _parameters(module):
    """{name: parameter or its DTensor view} of ``module``, under the names the framework saves
    them with (shared parameters once). Optimizer state that mirrors a parameter -- named
    ``<prefix>.<parameter name>`` with the shape of its local shard, as MindSpore's optimizers name
    their moments (``moment1.w1.weight``) -- gets that parameter's layout, so passing the train
    step (network + optimizer) checkpoints and reshards the optimizer state too."""
    platform = get_platform()
    out = {}
    for _, cell in platform.named_modules(module):
        for _, param in platform.named_parameters(cell):
            local = param._local_tensor if isinstance(param, DTensor) else param
            name = platform.parameter_name(local)
            if isinstance(param, DTensor) or name not in out:
                out[name] = param
    sharded = {n: p for n, p in out.items() if isinstance(p, DTensor)}
    for name, param in list(out.items()):
        owner = next((sharded[n] for n in _suffixes(name) if n in sharded), None)
        if owner is not None and not isinstance(param, DTensor) and \
                tuple(param.shape) == tuple(owner._local_tensor.shape):
            out[name] = DTensor._make(param, owner._spec)
    return out


def _suffixes(name):
    """``a.b.c`` -> ``b.c``, ``c``: the names a state entry ``<prefix>.<parameter>`` may mirror."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(1, len(parts))]


def _record(param, rank):
    """(layout entry, local tensor) this rank writes for ``param``, or None if another rank writes
    its block (a replicated copy) or it holds none."""
    if not isinstance(param, DTensor):
        shape = [int(s) for s in param.shape]
        entry = {"global_shape": shape, "offsets": [0] * len(shape), "sizes": shape, "mesh": None,
                 "placements": None}
        return (entry, param) if rank == 0 else None
    box = checkpoint_box(param)  # raises for Partial / head-tail layouts
    spec = param._spec
    coordinate = spec.mesh.get_coordinate()
    if box is None or any(c != 0 for c, p in zip(coordinate, spec.placements) if p.is_replicate()):
        return None
    mesh = spec.mesh
    entry = {"global_shape": [int(s) for s in spec.shape], "offsets": list(box[0]), "sizes": list(box[1]),
             "mesh": {"shape": [int(s) for s in mesh.mesh_shape], "ranks": [int(r) for r in mesh.rank_list],
                      "dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None},
             "placements": [list(_encode_placement(p)) for p in spec.placements]}
    return entry, param._local_tensor


def save_layout_checkpoint(module: Any, directory: Any) -> None:
    """Every rank writes its blocks of ``module``'s parameters and their layouts to ``directory``
    (created if missing; a shared filesystem across ranks), then waits for the others. Partial or
    head-tail placements raise ``ValueError`` on every rank before anything is written."""
    platform = get_platform()
    platform.check_execution_mode("save_layout_checkpoint")
    rank = platform.get_rank()
    records = {}
    for name, param in _parameters(module).items():
        record = _record(param, rank)
        if record is not None:
            records[name] = record
    os.makedirs(directory, exist_ok=True)
    _remove_stale(directory, platform.get_world_size())
    platform.save_tensor_file(os.path.join(directory, f"rank{rank}.ckpt"),
                              {name: local for name, (_, local) in records.items()})
    layout = {"format": FORMAT, "rank": rank, "world_size": platform.get_world_size(),
              "params": {name: entry for name, (entry, _) in records.items()}}
    with open(os.path.join(directory, f"rank{rank}.layout.json"), "w") as f:
        json.dump(layout, f, indent=1)
    if platform.get_world_size() > 1:
        platform.barrier()
        platform.synchronize()  # MindSpore queues the barrier like any op: wait until it is passed


class _Source:
    """The saved blocks of a checkpoint: ``blocks[name]`` = [(offsets, sizes, file, global shape)];
    files are read once, when a block in them is first needed."""

    def __init__(self, path):
        self.platform = get_platform()
        self.blocks, self._files = {}, {}
        if os.path.isdir(path):
            for layout in read_layouts(path):
                file = os.path.join(path, f"rank{layout['rank']}.ckpt")
                for name, e in layout["params"].items():
                    self.blocks.setdefault(name, []).append(
                        (tuple(e["offsets"]), tuple(e["sizes"]), file, tuple(e["global_shape"])))
        elif os.path.isfile(path):  # one process's full checkpoint: every parameter whole
            for name, array in self._read(path).items():
                shape = tuple(array.shape)
                self.blocks[name] = [((0,) * len(shape), shape, path, shape)]
        else:
            raise ValueError(f"no checkpoint at {path!r}: pass the directory "
                             f"save_layout_checkpoint wrote or a "
                             f"single-process checkpoint file")

    def _read(self, file):
        if file not in self._files:
            self._files[file] = self.platform.load_tensor_file(file)
        return self._files[file]

    def assemble(self, name, global_shape, offsets, sizes):
        """This block of parameter ``name`` from the saved blocks overlapping it."""
        blocks = self.blocks[name]
        saved_shape = blocks[0][3]
        if saved_shape != tuple(global_shape):
            raise ValueError(f"checkpoint parameter {name} has global shape {saved_shape}, the Cell's is "
                             f"{tuple(global_shape)}: load into a Cell of the saved architecture")
        out, covered = None, np.zeros(sizes, dtype=bool)
        for s_off, s_size, file, _ in blocks:
            lo = [max(a, b) for a, b in zip(offsets, s_off)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, s_off, s_size)]
            if any(h <= lw for lw, h in zip(lo, hi)) and len(sizes) > 0:
                continue
            data = self._read(file)[name]
            out = np.zeros(sizes, dtype=data.dtype) if out is None else out
            dst = tuple(slice(lw - o, h - o) for lw, h, o in zip(lo, hi, offsets))
            src = tuple(slice(lw - o, h - o) for lw, h, o in zip(lo, hi, s_off))
            out[dst] = data[src]
            covered[dst] = True
        if not covered.all():
            raise ValueError(f"checkpoint parameter {name}: the saved blocks do not cover this "
                             f"rank's block at "
                             f"offsets {tuple(offsets)} of size {tuple(sizes)} (a rank's files are missing)")
        return np.zeros(sizes, dtype=np.float32) if out is None else out  # an empty block


def read_layouts(directory: Any) -> Any:
    """The ``rank{r}.layout.json`` contents of a checkpoint directory, by rank."""
    names = sorted(f for f in os.listdir(directory) if f.endswith(".layout.json"))
    if not names:
        raise ValueError(f"{directory!r} holds no rank*.layout.json: not a save_layout_checkpoint directory")
    layouts = []
    for f in names:
        with open(os.path.join(directory, f)) as fh:
            layout = json.load(fh)
        if layout.get("format") != FORMAT:
            raise ValueError(f"{f}: unknown checkpoint format {layout.get('format')!r} (expected {FORMAT})")
        layouts.append(layout)
    expected = layouts[0]["world_size"]
    ranks = sorted(layout["rank"] for layout in layouts)
    if ranks != list(range(expected)) or any(layout["world_size"] != expected for layout in layouts):
        raise ValueError(f"{directory!r} holds layout files of ranks {ranks} saved by "
                         f"{sorted({layout['world_size'] for layout in layouts})} ranks: copy every rank's "
                         f"rank*.ckpt and rank*.layout.json of one save into it, and nothing else")
    return layouts


def _remove_stale(directory, world_size):
    """A save by fewer ranks into a directory that held a larger save: each rank removes the
    files of the ranks ``world_size + rank``, ``2 * world_size + rank``... (no rank reads them)."""
    rank = get_platform().get_rank()
    for f in os.listdir(directory):
        match = re.fullmatch(r"rank(\d+)\.(ckpt|layout\.json)", f)
        if match and int(match.group(1)) >= world_size and int(match.group(1)) % world_size == rank:
            os.remove(os.path.join(directory, f))


def _target(param):
    """(parameter to write, global shape, offsets, sizes) this rank loads, or None."""
    if not isinstance(param, DTensor):
        shape = tuple(int(s) for s in param.shape)
        return param, shape, (0,) * len(shape), shape
    box = checkpoint_box(param)
    if box is None:
        return None
    return param._local_tensor, tuple(param.shape), box[0], box[1]


def load_layout_checkpoint(module: Any, path: Any, strict: bool = True) -> Any:
    """Load ``path`` (a ``save_layout_checkpoint`` directory or a single-process checkpoint file)
    into ``module``'s parameters in place, each rank reading the block its layout needs. Returns
    (missing, unexpected) parameter names; with ``strict`` a missing one raises ``ValueError``
    (names in the file the Cell lacks, e.g. optimizer state, are only reported). No collectives."""
    platform = get_platform()
    platform.check_execution_mode("load_layout_checkpoint")
    source = _Source(path)
    params = _parameters(module)
    missing = sorted(n for n in params if n not in source.blocks)
    if missing and strict:
        raise ValueError(f"checkpoint {path!r} lacks parameters {missing}; pass strict=False "
                         f"to load the rest")
    for name, param in params.items():
        target = None if name in missing else _target(param)
        if target is not None:
            local, shape, offsets, sizes = target
            platform.assign_parameter(local, source.assemble(name, shape, offsets, sizes))
    return missing, sorted(n for n in source.blocks if n not in params)
