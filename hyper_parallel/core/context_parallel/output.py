"""Bringing the attention output back to the caller's split.

The output's layout is read from the output itself, never assumed to be q's: a module may take
BNSD and return BSHD or (batch, seq, heads*dim), as Hugging Face's attention functions do. The
sequence dim of the output is

* the dim that the CP mesh dims which still split q's sequence (all-gather, ring, the co dim of
  the hybrid, load balancing) split in the output, or, when only Ulysses dims exist,
* the one dim whose global length is the sequence length and that no mesh dim splits (the Ulysses
  dims split the output's heads). If several dims qualify, an output with q's own global shape
  and heads split where q's are is taken in q's layout; otherwise it is an error.

Then every CP mesh dim is moved onto that dim, outer first, so each rank holds its contiguous
block of the output's sequence; splits by other mesh dims (TP heads) stay as the output has them.

The decision depends only on the output's layout and shape and on the inputs' signature, so it is
made once per signature (a steady-state call looks it up), and the move to the caller's split and
to a local tensor is one autograd function (``redistribute(...).to_local()`` fused: the same
collectives, the same gradient layouts, one graph node instead of two DTensor wrappers).
"""
from typing import Any
from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.core.bounded_cache import BoundedCache, lifetime_key
from hyper_parallel.core.dtensor.dtensor import DTensor, as_layout
from hyper_parallel.core.dtensor.layout import grad_placements, placements_from_orders, shard_orders
from hyper_parallel.core.dtensor.placement_types import Replicate
from hyper_parallel.core.dtensor.redistribute import redistribute_local
from hyper_parallel.platform import get_platform

_DECISIONS = BoundedCache(4096)


def _fail(out, why, fix="return the output with its sequence on a dim of its own length, e.g. in q's "
                        "layout or as (batch, seq, heads*dim)"):
    raise ValueError(f"ContextParallel: cannot bring the attention output (global shape {tuple(out.shape)}, "
                     f"placements {tuple(out.placements)}) back to the sequence split: {why}; {fix}")


def output_seq_dim(out: Any, inputs: Any, ulysses_dims: Any) -> Any:
    """The dim of ``out`` (a DTensor on the working mesh) that holds the sequence."""
    placements, seq_len = tuple(out.placements), inputs.shapes[0][inputs.seq]
    for m in inputs.cp_dims:
        if placements[m].is_partial():
            _fail(out, f"it is a partial sum over CP mesh dim {m} (did the module reduce over the sequence?)",
                  "return the per-token attention output")
    split = sorted({placements[m].dim for m in inputs.cp_dims
                    if m not in ulysses_dims and placements[m].is_shard()})
    if len(split) > 1:
        _fail(out, f"the CP ranks split its dims {split}, not one sequence dim")
    if split:
        if out.shape[split[0]] != seq_len:
            _fail(out, f"the CP ranks split its dim {split[0]} of length {out.shape[split[0]]}, not the "
                       f"sequence length {seq_len}")
        return split[0]
    sharded = {p.dim for p in placements if p.is_shard()}
    candidates = [d for d in range(out.ndim) if out.shape[d] == seq_len and d not in sharded]
    if len(candidates) == 1:
        return candidates[0]
    if inputs.seq in candidates and _in_q_layout(out, inputs, ulysses_dims):
        return inputs.seq
    if not candidates:
        _fail(out, f"no unsplit dim has the sequence length {seq_len}")
    _fail(out, f"dims {candidates} all have the sequence length {seq_len}, so the sequence dim is ambiguous")
    return None


def _in_q_layout(out, inputs, ulysses_dims):
    q_shape = tuple(inputs.shapes[0])
    return (tuple(out.shape) == q_shape and bool(ulysses_dims)
            and all(out.placements[m].is_shard(inputs.head) for m in ulysses_dims))


def caller_placements(placements: Any, mesh: Any, ndim: Any, seq: Any, cp_dims: Any) -> Any:
    """``placements`` with every CP mesh dim moved onto ``seq`` (contiguous blocks, outer first)."""
    orders = [[m for m in order if m not in cp_dims]
              for order in shard_orders(placements, mesh.mesh_shape, ndim)]
    orders[seq] = list(cp_dims) + orders[seq]
    non_shard = [Replicate() if (p.is_shard() or m in cp_dims) else p for m, p in enumerate(placements)]
    return placements_from_orders(orders, non_shard, mesh.mesh_shape)


def _decision(out, inputs, ulysses_dims):
    """(the output's seq dim, the caller's placements, its spec): cached per signature; every input
    of output_seq_dim / caller_placements is in the key, so a hit is the same decision."""
    spec = out._spec
    key = (lifetime_key(inputs.mesh), spec.placements, spec.shape, tuple(inputs.shapes[0]), inputs.seq,
           inputs.head, tuple(inputs.cp_dims), tuple(ulysses_dims))
    found = _DECISIONS.get(key)
    if found is not None and found[2].mesh is spec.mesh:
        return found
    seq = output_seq_dim(out, inputs, ulysses_dims)
    target = caller_placements(tuple(out.placements), inputs.mesh, out.ndim, seq, inputs.cp_dims)
    found = (seq, target, spec.with_placements(target), inputs.mesh)
    _DECISIONS[key] = found
    return found


def _local_forward(ctx, out, target_spec):
    spec = out._spec
    ctx.target_spec = target_spec
    ctx.grad_spec = spec.with_placements(grad_placements(spec.placements))
    local = redistribute_local(out._local_tensor, spec.mesh, spec.shape, spec.placements,
                               target_spec.placements)
    return local.view_as(local)   # a tensor of its own, as to_local's


def _local_backward(ctx, grad):
    # to_local's backward (the gradient in the target layout), then redistribute's (back to the
    # output's gradient layout)
    return as_layout(DTensor._make(get_platform().dense(grad), ctx.target_spec), ctx.grad_spec), None


def _to_local_as(out, target_spec):
    """``out.redistribute(target).to_local()`` as one differentiable step."""
    platform = get_platform()
    if not (platform.is_grad_enabled() and out.requires_grad):
        return _local_forward(_NoCtx(), out, target_spec)
    return _TO_CALLER_LOCAL(out, target_spec)


class _NoCtx:
    pass


_TO_CALLER_LOCAL = lazy_autograd_function("ToCallerLocal", _local_forward, _local_backward)


def to_caller(out: Any, inputs: Any, ulysses_dims: Any) -> Any:
    """(this rank's local block of the output, the output's seq dim, its placements on the working
    mesh)."""
    seq, target, target_spec, _ = _decision(out, inputs, ulysses_dims)
    return _to_local_as(out, target_spec), seq, target


def first_output(out: Any) -> Any:
    """The attention module's output DTensor (the first element of a tuple / list)."""
    value = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(value, DTensor):
        raise ValueError("ContextParallel: the attention module must return the DTensor its attention "
                         "op produced (do not call .to_local() inside it)")
    return value
