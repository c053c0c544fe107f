"""q, k and v moved sequence -> heads by one all-to-all: the plan, run whole or split in two.

Each rank's send buffer holds, for every destination rank j, [q heads block j | k block j | v block j]
side by side on the head dim (q and k/v may differ in head count: GQA), so the one all-to-all hands
rank j every rank's blocks of its heads, and the results are slices of what arrives.

``run`` is one autograd function. Built by one ``cat`` of rank-block views, the send buffer is the
only copy forward makes: the all-to-all runs on its leading (rank) dim, so the platform needs no
staging copy of its own, and each result is a view of the received buffer (rank j's block is
sequence block j: merging the rank dim into the sequence dim is free when no dim before the
sequence is longer than 1, e.g. BSHD with batch 1; else the reshape copies once, as a per-tensor
all-to-all would). Backward mirrors it: the gradients are written into one buffer in the received
layout, one all-to-all sends them back, and each input's gradient is one copy out of it. The
results are DTensors whose gradients are taken in their own layouts, as ``DTensor.from_local`` does.

``start`` launches the same packed tensor through the platform's split collectives and returns
``finish``, so compute runs while it travels (overlap).
"""
from typing import Any
from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.core.context_parallel.movement.steps import Block, shared_step
from hyper_parallel.core.dtensor.dtensor import DTensor, as_layout
from hyper_parallel.core.dtensor.layout import grad_placements
from hyper_parallel.core.dtensor.spec import DTensorSpec
from hyper_parallel.platform import get_platform


def _split(t, dim, n):
    """``t`` with ``dim`` cut into n equal blocks, the block index moved to a new leading dim (a view)."""
    shape = list(t.shape)
    return t.reshape(tuple(shape[:dim] + [n, shape[dim] // n] + shape[dim + 1:])).movedim(dim, 0)


def _merge(t, dim):
    """Inverse of ``_split``: the leading block dim folded back into ``dim`` (a view where strides allow)."""
    t = t.movedim(0, dim)
    shape = list(t.shape)
    return t.reshape(tuple(shape[:dim] + [shape[dim] * shape[dim + 1]] + shape[dim + 2:]))


def _pieces(buffer, dim, widths):
    """Consecutive slices of ``buffer`` along ``dim`` of the given widths (views)."""
    out, start = [], 0
    for w in widths:
        out.append(buffer[(slice(None),) * dim + (slice(start, start + w),)])
        start += w
    return out


def _equal_but(shapes, dim):
    shapes = [list(s) for s in shapes]
    for s in shapes:
        s[dim] = 0
    return all(s == shapes[0] for s in shapes)


class QKVAllToAll:
    """Tensors ``indices`` of q, k, v, equal but in head count, moved by one all-to-all."""

    __slots__ = ("mesh", "indices", "group", "n", "seq", "head", "widths", "targets", "specs", "grad_specs")

    def __init__(self, mesh: Any, indices: Any, step: Any, widths: Any, targets: Any, shapes: Any) -> None:
        self.mesh, self.indices = mesh, tuple(indices)
        self.group, self.n = mesh.get_group(step.mesh_dim), mesh.mesh_shape[step.mesh_dim]
        self.seq, self.head = step.dim, step.new_dim
        self.widths, self.targets = tuple(widths), [tuple(t) for t in targets]
        self.specs = tuple(DTensorSpec(mesh, t, tuple(s)) for t, s in zip(self.targets, shapes))
        self.grad_specs = tuple(s.with_placements(grad_placements(s.placements)) for s in self.specs)

    @classmethod
    def plan(cls, mesh: Any, shapes: Any, sources: Any, targets: Any, local_shapes: Any, dtypes: Any,
             indices: Any = (0, 1, 2)) -> Any:
        """The move of the tensors at ``indices`` (global ``shapes``, ``sources`` -> ``targets``,
        this rank's ``local_shapes`` and ``dtypes``, all indexed like q, k, v), or None where it is
        not one even sequence -> heads all-to-all of blocks of one dtype equal but in heads."""
        pick = lambda seq: [seq[i] for i in indices]  # noqa: E731
        step = shared_step(mesh, pick(shapes), pick(sources), pick(targets), "all_to_all")
        if step is None or len(set(pick(dtypes))) != 1:
            return None
        n, local = mesh.mesh_shape[step.mesh_dim], [tuple(s) for s in pick(local_shapes)]
        if (len({len(s) for s in local}) != 1 or not _equal_but(local, step.new_dim)
                or any(s[step.new_dim] % n for s in local)):
            return None
        return cls(mesh, indices, step, [s[step.new_dim] // n for s in local], pick(targets), pick(shapes))

    def run(self, locals_: Any) -> Any:
        """The moved tensors' DTensors (one differentiable all-to-all)."""
        platform = get_platform()
        if not (platform.is_grad_enabled() and any(platform.requires_grad(t) for t in locals_)):
            return list(_forward(_NoCtx(), self, *locals_))   # nothing to record: no autograd node
        return list(_FUNCTION(self, *locals_))

    def start(self, blocks: Any, observer: Any = None) -> Any:
        """Launch the move of ``blocks[i]`` for i in ``indices``; returns ``finish`` -> all blocks."""
        platform = get_platform()
        split = self.head
        parts = []
        for i in self.indices:
            shape = list(blocks[i].local.shape)
            parts.append(blocks[i].local.reshape(tuple(shape[:split] + [self.n, shape[split] // self.n]
                                                       + shape[split + 1:])))
        packed = platform.cat(parts, split + 1)
        shape = list(packed.shape)
        packed = packed.reshape(tuple(shape[:split] + [shape[split] * shape[split + 1]] + shape[split + 2:]))
        pending = platform.start_differentiable_collective("all_to_all", packed, self.group,
                                                           (split, self.seq), observer)

        def finish():
            # one split (its backward is one concatenation, not a zero-filled buffer per piece)
            pieces, out = pending.wait().split(list(self.widths), split), list(blocks)
            for i, piece, placements in zip(self.indices, pieces, self.targets):
                out[i] = Block(piece, placements, blocks[i].shape)
            return out
        return finish


def _forward(ctx, plan, *locals_):
    platform = get_platform()
    ctx.plan = plan
    # the send buffer (n, ..., heads of every tensor / n, ...): the one forward copy
    send = platform.cat([_split(t, plan.head, plan.n) for t in locals_], plan.head + 1)
    received = platform.all_to_all_single(send, plan.group, 0, 0)
    ctx.dtype, ctx.device = send.dtype, getattr(send, "device", None)
    return tuple(DTensor._make(_merge(piece, plan.seq), spec) for piece, spec in
                 zip(_pieces(received, plan.head + 1, plan.widths), plan.specs))


def _backward(ctx, *grads):
    platform = get_platform()
    plan = ctx.plan
    parts = []
    for grad, spec, grad_spec in zip(grads, plan.specs, plan.grad_specs):
        if grad is None:   # a result that reached no loss (frameworks that pass None for it)
            grad = platform.zeros(tuple(spec.local_shape), dtype=ctx.dtype, device=ctx.device)
        elif isinstance(grad, DTensor):
            # as DTensor.from_local's backward; a gradient already in place needs no plan lookup
            same = grad._spec.placements == grad_spec.placements and grad._spec.shape == grad_spec.shape
            grad = grad._local_tensor if same else as_layout(grad, grad_spec)._local_tensor
        parts.append(_split(grad, plan.seq, plan.n))
    # the received layout, all gradients side by side: one copy each, one all-to-all back
    sent_back = platform.all_to_all_single(platform.cat(parts, plan.head + 1), plan.group, 0, 0)
    out = [_merge(piece, plan.head).contiguous() for piece in _pieces(sent_back, plan.head + 1, plan.widths)]
    return (None,) + tuple(out)


class _NoCtx:
    pass


_FUNCTION = lazy_autograd_function("QKVAllToAll", _forward, _backward)
