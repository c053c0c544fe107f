"""One context-parallel attention call: distribute q, k, v for the mode, run the module, return
the output in the caller's layout."""
from dataclasses import dataclass

from hyper_parallel.core.context_parallel.layouts import input_placements, mode_placements
from hyper_parallel.core.context_parallel.load_balance import merge_head_tail, split_head_tail
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import HeadTailShard, Replicate, Shard
from hyper_parallel.platform import get_platform


@dataclass
class _Inputs:
    mesh: object            # the working mesh (CP, or CP composed with the caller's mesh)
    cp_dims: list           # working-mesh dims that split the sequence for CP (outer first)
    locals: list            # q, k, v local blocks (differentiable)
    placements: list        # their layouts on the working mesh
    shapes: list            # their global shapes
    policy: str             # "local" | "cp" | "foreign"
    own_mesh: object = None
    own_placements: tuple = ()


def _gather_inputs(style, cp_mesh, qkv):
    q = qkv[0]
    seq = style.seq_dim % q.ndim
    if not isinstance(q, DTensor):
        return _from_plain(style, cp_mesh, qkv, seq, "local")
    own = q.device_mesh
    if own == cp_mesh or (own.ndim == 1 and own.size() == cp_mesh.size() and own.rank_list == cp_mesh.rank_list):
        cp_local = [t.redistribute(placements=[Shard(seq)]).to_local() if isinstance(t, DTensor) else t
                    for t in qkv]
        inputs = _from_plain(style, cp_mesh, cp_local, seq, "cp")
        inputs.own_mesh, inputs.own_placements = own, (Shard(seq),)
        return inputs
    mesh = DeviceMesh.concatenate([cp_mesh, own])
    names = mesh.mesh_dim_names
    cp_dims = [names.index(n) for n in cp_mesh.mesh_dim_names]
    locals_, placements, shapes = [], [], []
    for t in qkv:
        if not isinstance(t, DTensor) or t.device_mesh != own:
            raise ValueError("ContextParallel: q, k and v must all be DTensors on the same mesh "
                             f"({own}) when q is one")
        other = [None] * mesh.ndim
        for m, p in zip([names.index(n) for n in own.mesh_dim_names], t.placements):
            other[m] = p
        other = [p if p is not None else Replicate() for p in other]
        placements.append(input_placements(mesh, t.ndim, seq, cp_dims, other))
        shape = list(t.shape)
        shape[seq] *= cp_mesh.size()
        shapes.append(tuple(shape))
        locals_.append(t.to_local())
    return _Inputs(mesh, cp_dims, locals_, placements, shapes, "foreign", own, q.placements)


def _from_plain(style, cp_mesh, qkv, seq, policy):
    _check_lengths(style, cp_mesh, qkv, seq)
    cp_dims = list(range(cp_mesh.ndim))
    placements, shapes = [], []
    for t in qkv:
        placements.append(input_placements(cp_mesh, t.ndim, seq, cp_dims))
        shape = list(t.shape)
        shape[seq] *= cp_mesh.size()
        shapes.append(tuple(shape))
    return _Inputs(cp_mesh, cp_dims, list(qkv), placements, shapes, policy)


def _check_lengths(style, cp_mesh, qkv, seq):
    """Every rank must pass blocks of one shape; checked with one tiny all-reduce so that all ranks
    raise together, before any data moves."""
    platform = get_platform()
    dims = []
    for t in qkv:
        dims.extend(int(s) for s in t.shape)
    probe = platform.tensor(dims + [-d for d in dims])
    for m in range(cp_mesh.ndim):
        probe = platform.all_reduce(probe, cp_mesh.get_group(m), "max", tag="shape_check")
    top, bottom = probe[:len(dims)].tolist(), [-x for x in probe[len(dims):].tolist()]
    if top != bottom:
        raise ValueError(f"ContextParallel: ranks passed q/k/v blocks of different shapes (per-dim max "
                         f"{top}, min {bottom}); every rank must pass an equal contiguous block of the "
                         f"sequence (pad the sequence to a multiple of the CP size)")


def _validate(style, inputs, ulysses_dims):
    q_local, k_local = inputs.locals[0], inputs.locals[1]
    head = style.head_dim % q_local.ndim
    seq = style.seq_dim % q_local.ndim
    ds = 1
    for m in ulysses_dims:
        ds *= inputs.mesh.size(m)
    for name, t in (("q", q_local), ("k/v", k_local)):
        if t.shape[head] % ds:
            raise ValueError(f"ContextParallel: {name} has {t.shape[head]} heads here, not divisible by "
                             f"ulysses_degree={ds}; choose a ulysses_degree that divides the head count "
                             f"(ulysses_degree=1 is all-gather KV and has no head constraint)")
    if style.load_balance and q_local.shape[seq] % 2:
        raise ValueError(f"ContextParallel(load_balance=True): the local sequence length "
                         f"{q_local.shape[seq]} is odd; it must split into two equal halves")


def _mode_dims(style, cp_mesh, inputs):
    """(ulysses dims, gather dims) on the working mesh."""
    if len(inputs.cp_dims) == 2:
        return [inputs.cp_dims[1]], [inputs.cp_dims[0]]
    ds = style.ulysses_degree or cp_mesh.size()
    return (list(inputs.cp_dims), []) if ds > 1 else ([], list(inputs.cp_dims))


def run_attention(style, cp_mesh, qkv, call):
    inputs = _gather_inputs(style, cp_mesh, qkv)
    ulysses_dims, gather_dims = _mode_dims(style, cp_mesh, inputs)
    if style.kv_exchange == "ring" and gather_dims:
        from hyper_parallel.core.context_parallel.ring_mode import run_ring
        return _deliver(style, inputs, run_ring(style, inputs, ulysses_dims, gather_dims[0], call))
    _validate(style, inputs, ulysses_dims)
    mesh, seq = inputs.mesh, style.seq_dim % inputs.locals[0].ndim
    head = style.head_dim % inputs.locals[0].ndim
    dts = [DTensor.from_local(t, mesh, p, shape=s) for t, p, s in
           zip(inputs.locals, inputs.placements, inputs.shapes)]
    _, kv_target = mode_placements(inputs.placements[1], mesh, dts[1].ndim, seq, head, ulysses_dims,
                                   gather_dims)
    k, v = (t.redistribute(placements=kv_target) for t in dts[1:])
    if style.load_balance:
        out_local = _load_balanced(style, inputs, k, v, call, seq)
    else:
        q_target, _ = mode_placements(inputs.placements[0], mesh, dts[0].ndim, seq, head, ulysses_dims,
                                      gather_dims)
        out = _first(call(dts[0].redistribute(placements=q_target), k, v))
        out_local = out.redistribute(placements=inputs.placements[0]).to_local()
    return _deliver(style, inputs, out_local)


def _load_balanced(style, inputs, k, v, call, seq):
    mesh, (cp_dim,) = inputs.mesh, inputs.cp_dims
    head_l, tail_l = split_head_tail(inputs.locals[0], seq, mesh, cp_dim)
    outs = []
    for half, local in enumerate((head_l, tail_l)):
        placements = list(inputs.placements[0])
        placements[cp_dim] = HeadTailShard(seq, half)
        q = DTensor.from_local(local, mesh, placements, shape=inputs.shapes[0])
        out = _first(call(q, k, v))
        if tuple(out.placements) != tuple(placements):
            out = out.redistribute(placements=placements)
        outs.append(out.to_local())
    return merge_head_tail(outs[0], outs[1], seq, mesh, cp_dim)


def _first(out):
    value = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(value, DTensor):
        raise ValueError("ContextParallel: the attention module must return the DTensor its attention "
                         "op produced (do not call .to_local() inside it)")
    return value


def _deliver(style, inputs, out_local):
    if style.use_local_output or inputs.policy == "local":
        return out_local
    return DTensor.from_local(out_local, inputs.own_mesh, inputs.own_placements)
