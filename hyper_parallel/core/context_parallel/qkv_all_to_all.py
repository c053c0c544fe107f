"""q, k and v moved sequence -> heads by one all-to-all, as one autograd function.

Each rank's send buffer holds, for every destination rank j, [q heads block j | k block j | v block j]
side by side on the head dim (q and k/v may differ in head count: GQA). Built by one ``cat`` of
rank-block views, it is the only copy forward makes: the all-to-all runs on its leading (rank) dim,
so the platform needs no staging copy of its own (where the group's ranks are in the backend's
order), and every received block lands where the result needs it.
Each result is a view of the received buffer: rank j's block is sequence block j, so merging the
rank dim into the sequence dim is free when no dim before the sequence is longer than 1 (BSHD with
batch 1); otherwise the reshape copies once, as a per-tensor all-to-all would.

Backward mirrors it: the three gradients are written into one buffer in the received layout (one
copy each, whatever their strides), one all-to-all sends them back, and each input's gradient is
one copy out of it. No stacked zero-filled buffers, no summing of slice gradients, one collective.

The results are DTensors of the caller's target specs; their gradients are taken in those layouts
exactly as ``DTensor.from_local`` does (``as_layout`` to the specs' gradient placements).
"""
from hyper_parallel.core.dtensor.dtensor import DTensor, as_layout
from hyper_parallel.core.dtensor.layout import grad_placements
from hyper_parallel.platform import get_platform


class QKVPlan:
    """What one fused move needs, fixed per signature (built once, reused every call)."""

    __slots__ = ("group", "n", "seq", "head", "widths", "specs", "grad_specs")

    def __init__(self, group, n, seq, head, widths, specs):
        self.group, self.n, self.seq, self.head = group, n, seq, head
        self.widths = tuple(widths)     # each tensor's head count after the move (its heads / n)
        self.specs = tuple(specs)       # the results' DTensor specs
        self.grad_specs = tuple(s.with_placements(grad_placements(s.placements)) for s in specs)


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
    for grad, spec, grad_spec, width in zip(grads, plan.specs, plan.grad_specs, plan.widths):
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


_FUNCTIONS = {}


class _NoCtx:
    pass


def move_qkv(plan, locals_):
    """q, k, v local blocks (sequence split) -> their DTensors in ``plan.specs`` (heads split), by one
    differentiable all-to-all (see the module docstring)."""
    platform = get_platform()
    if not (platform.is_grad_enabled() and any(platform.requires_grad(t) for t in locals_)):
        return list(_forward(_NoCtx(), plan, *locals_))   # nothing to record: skip the autograd node
    fn = _FUNCTIONS.get(platform.name)
    if fn is None:
        fn = _FUNCTIONS[platform.name] = platform.make_autograd_function("QKVAllToAll", _forward, _backward)
    return list(fn(plan, *locals_))
