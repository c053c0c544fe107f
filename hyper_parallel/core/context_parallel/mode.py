"""One context-parallel attention call: check and distribute q, k, v for the mode, run the module,
return the output in the caller's layout (read from the output, see output.py)."""
from typing import Any
import math
from dataclasses import dataclass, replace
from enum import Enum

from hyper_parallel.core.agreement_attention import attention_call
from hyper_parallel.core.bounded_cache import lifetime_key
from hyper_parallel.core.context_parallel.checks import (NAMES, agree_on_call, check_across_ranks,
                                                         check_layout, first_call_of_signature,
                                                         check_whole_sequence, normalise_dims,
                                                         suspect_whole_sequence)
from hyper_parallel.core.context_parallel.movement import mode_dtensors
from hyper_parallel.core.context_parallel.movement.mode_moves import input_placements
from hyper_parallel.core.context_parallel.load_balance import merge_head_tail, split_head_tail
from hyper_parallel.core.context_parallel.masks.mask_mode import with_masks
from hyper_parallel.core.context_parallel.masks.attention_masks import active_masks, check_masks
from hyper_parallel.core.context_parallel.output import first_output, to_caller
from hyper_parallel.core.context_parallel.overlap.pipeline import pipelinable, recording, run_overlapped
from hyper_parallel.core.context_parallel.ring.ring_mode import run_ring
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.attention.roles import AttentionRoles, expecting, tracking
from hyper_parallel.core.dtensor.placement_types import HeadTailShard, Replicate
from hyper_parallel.platform import get_platform


@dataclass
class _Inputs:
    mesh: object            # the working mesh (CP, or CP composed with the caller's mesh)
    cp_dims: list           # working-mesh dims that split the sequence for CP (outer first)
    locals: list            # q, k, v local blocks (differentiable)
    placements: list        # their layouts on the working mesh
    shapes: list            # their global shapes
    policy: str             # how q came in: an InputPolicy (a str)
    seq: int                # q/k/v's sequence and head dims, normalised
    head: int
    own_mesh: object = None
    own_dims: tuple = ()    # working-mesh dims of the caller's own mesh ("other_mesh")


def cp_dim_order(mesh: Any) -> Any:
    """The CP mesh's dims, outer sequence split first: a 2-D mesh is matched by its names
    ("co", "ds") in either order (rank (c, d) holds sequence block c·ds + d); a 1-D mesh is dim 0."""
    if mesh.ndim == 2:
        return [mesh.mesh_dim_names.index("co"), mesh.mesh_dim_names.index("ds")]
    return list(range(mesh.ndim))


def _seq_blocks(mesh, ndim, seq):
    """Placements on the CP mesh ``mesh`` of a tensor whose rank (c, d) holds block c·ds + d."""
    return input_placements(mesh, ndim, seq, cp_dim_order(mesh))


def _on_cp_mesh(mesh, cp_mesh):
    return mesh == cp_mesh or (mesh.ndim == 1 and mesh.size() == cp_mesh.size()
                               and mesh.rank_list == cp_mesh.rank_list)


class InputPolicy(str, Enum):
    """How q came in. A str: it equals, hashes and prints as its plain name ("plain")."""
    PLAIN = "plain"              # a plain tensor (this rank's block)
    CP_DTENSOR = "cp_dtensor"    # a DTensor on the CP mesh
    OTHER_MESH = "other_mesh"    # a DTensor on the caller's own mesh

    __str__ = str.__str__
    __hash__ = str.__hash__

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


def _policy(q, cp_mesh):
    if not isinstance(q, DTensor):
        return InputPolicy.PLAIN
    return InputPolicy.CP_DTENSOR if _on_cp_mesh(q.device_mesh, cp_mesh) else InputPolicy.OTHER_MESH


def _check_meshes(qkv, policy, cp_mesh):
    """k/v DTensors must live where q's policy can place them."""
    q = qkv[0]
    for name, t in zip(NAMES[1:], qkv[1:]):
        if not isinstance(t, DTensor):
            continue
        fits = (t.device_mesh == q.device_mesh if policy == InputPolicy.OTHER_MESH
                else _on_cp_mesh(t.device_mesh, cp_mesh))
        if not fits:
            where = (f"q's mesh {q.device_mesh}" if policy == InputPolicy.OTHER_MESH
                     else f"the CP mesh {cp_mesh}")
            raise ValueError(f"ContextParallel: {name} is a DTensor on {t.device_mesh}, not on {where}; pass "
                             f"q, k and v as DTensors on one mesh, or k and v as plain local blocks")


def _block_shape(t, policy, seq, cp_mesh):
    """The shape of the sequence block this rank contributes for ``t``."""
    shape = list(t.shape)
    if isinstance(t, DTensor) and policy != InputPolicy.OTHER_MESH:
        if shape[seq] % cp_mesh.size():
            raise ValueError(f"ContextParallel: a DTensor input has global sequence length {shape[seq]}, "
                             f"not divisible by the CP size {cp_mesh.size()}; pad the sequence to a "
                             f"multiple of it")
        shape[seq] //= cp_mesh.size()
    return tuple(shape)


def _q_block_length(style, q, policy, cp_mesh):
    """q's local sequence length on this rank (None where the dims are invalid: raised later)."""
    if not -q.ndim <= style.seq_dim < q.ndim:
        return None
    n = int(q.shape[style.seq_dim % q.ndim])
    return n // cp_mesh.size() if isinstance(q, DTensor) and policy == InputPolicy.CP_DTENSOR else n


def _prepare(style, cp_mesh, qkv):
    """Every check first (one small all-reduce, then checks every rank agrees on), then the inputs
    on the working mesh."""
    raw = [t.to_local() if isinstance(t, DTensor) else t for t in qkv]
    policy = _policy(qkv[0], cp_mesh)
    same = [False] * len(raw)
    if first_call_of_signature(style, cp_mesh, qkv):
        prints = suspect_whole_sequence(style, qkv, raw, _q_block_length(style, qkv[0], policy, cp_mesh),
                                        cp_mesh.size())
        same = check_across_ranks(cp_mesh, raw, prints)
    seq, head = normalise_dims(style, [t.ndim for t in raw])
    _check_meshes(qkv, policy, cp_mesh)
    shapes = [_block_shape(t, policy, seq, cp_mesh) for t in qkv]
    check_layout(style, shapes, seq, head, cp_mesh.size())
    check_whole_sequence(same, shapes, seq, cp_mesh.size())
    if policy == InputPolicy.OTHER_MESH:
        return _foreign(cp_mesh, qkv, seq, head)
    blocks = [t.redistribute(placements=_seq_blocks(t.device_mesh, t.ndim, seq)).to_local()
              if isinstance(t, DTensor) else t for t in qkv]
    cp_dims = cp_dim_order(cp_mesh)
    placements, shapes = [], []
    for t in blocks:
        placements.append(input_placements(cp_mesh, t.ndim, seq, cp_dims))
        shape = list(t.shape)
        shape[seq] *= cp_mesh.size()
        shapes.append(tuple(shape))
    own = qkv[0].device_mesh if policy == InputPolicy.CP_DTENSOR else None
    return _Inputs(cp_mesh, cp_dims, blocks, placements, shapes, policy, seq, head, own)


def _like_q(t, name, q):
    """k or v on q's mesh with q's placements there: a plain tensor counts as replicated (this CP
    rank's block, every head), and a differently split one is re-split, so the heads each rank
    holds line up with q's."""
    own = q.device_mesh
    if not isinstance(t, DTensor):
        t = DTensor.from_local(t, own, [Replicate()] * own.ndim)
    if tuple(t.placements) == tuple(q.placements):
        return t
    for d in range(t.ndim):
        parts = 1
        for m, p in enumerate(q.placements):
            parts *= own.size(m) if p.is_shard(d) else 1
        if t.shape[d] % parts:
            raise ValueError(f"ContextParallel: {name} has {t.shape[d]} entries on dim {d}, which q's "
                             f"placements {tuple(q.placements)} split {parts} ways; split k and v as q is "
                             f"split, or make that dim divisible")
    return t.redistribute(placements=tuple(q.placements))


def _foreign(cp_mesh, qkv, seq, head):
    q = qkv[0]
    own = q.device_mesh
    mesh = DeviceMesh.concatenate([cp_mesh, own])
    names = mesh.mesh_dim_names
    cp_dims = [names.index(cp_mesh.mesh_dim_names[m]) for m in cp_dim_order(cp_mesh)]
    own_dims = tuple(names.index(n) for n in own.mesh_dim_names)
    locals_, placements, shapes = [], [], []
    for name, t in zip(NAMES, qkv):
        t = _like_q(t, name, q)
        other = [Replicate()] * mesh.ndim
        for m, p in zip(own_dims, t.placements):
            other[m] = p
        placements.append(input_placements(mesh, t.ndim, seq, cp_dims, other))
        shape = list(t.shape)
        shape[seq] *= cp_mesh.size()
        shapes.append(tuple(shape))
        locals_.append(t.to_local())
    return _Inputs(mesh, cp_dims, locals_, placements, shapes, InputPolicy.OTHER_MESH, seq, head, own,
                   own_dims)


def _degree(mesh, ulysses_dims):
    return math.prod(mesh.size(m) for m in ulysses_dims)


def kv_repeats(q_heads: Any, kv_heads: Any, ds: Any) -> Any:
    """How many copies of each k/v head Ulysses of degree ``ds`` needs (1: none).

    With Hkv % ds != 0 (GQA/MQA below the degree, e.g. 8 KV heads on ds=16), each KV head is
    repeated r = ds / gcd(ds, Hkv) times in place (repeat_interleave), so Hkv·r = lcm(Hkv, ds)
    heads split evenly over ds ranks. The grouping is unchanged: with g = Hq/Hkv, query head h used
    KV head h // g, and with g' = Hq/(Hkv·r) it uses h // g', a copy of KV head h // g' // r = h // g.
    The rank holding query heads [j·Hq/ds, (j+1)·Hq/ds) then holds exactly their KV copies
    [j·Hkv·r/ds, (j+1)·Hkv·r/ds). r is minimal: any r' with ds | Hkv·r' is a multiple of r."""
    if kv_heads == 0 or kv_heads % ds == 0:
        return 1
    return ds // math.gcd(ds, kv_heads)


def _repeat_heads(t, r, head):
    """Each head of ``t`` r times in place, differentiably (backward sums the copies' gradients)."""
    if r == 1:
        return t
    shape = list(t.shape)
    shape[head] *= r
    copies = get_platform().cat([t.unsqueeze(head + 1)] * r, head + 1)
    return copies.reshape(tuple(shape))


def _validate(style, inputs, ulysses_dims):
    """Raise on what no mode can run; return the inputs with k/v heads replicated where fewer
    k/v heads than the Ulysses degree (or a count it does not divide) need it."""
    q_local, k_local = inputs.locals[0], inputs.locals[1]
    ds = _degree(inputs.mesh, ulysses_dims)
    heads = q_local.shape[inputs.head]
    if heads % ds:
        raise ValueError(f"ContextParallel: q has {heads} heads here, not divisible by ulysses_degree={ds}; "
                         f"choose a ulysses_degree that divides the head count (ulysses_degree=1 is "
                         f"all-gather KV and has no head constraint)")
    if style.load_balance and q_local.shape[inputs.seq] % 2:
        raise ValueError(f"ContextParallel(load_balance=True): the local sequence length "
                         f"{q_local.shape[inputs.seq]} is odd; it must split into two equal halves")
    r = kv_repeats(heads, k_local.shape[inputs.head], ds)
    if r == 1:
        return inputs
    locals_ = list(inputs.locals[:1]) + [_repeat_heads(t, r, inputs.head) for t in inputs.locals[1:]]
    shapes = list(inputs.shapes[:1])
    for shape in inputs.shapes[1:]:
        shape = list(shape)
        shape[inputs.head] *= r
        shapes.append(tuple(shape))
    return replace(inputs, locals=locals_, shapes=shapes)


def _mode_dims(style, cp_mesh, inputs):
    """(ulysses dims, gather dims) on the working mesh."""
    if len(inputs.cp_dims) == 2:
        return [inputs.cp_dims[1]], [inputs.cp_dims[0]]
    ds = style.ulysses_degree or cp_mesh.size()
    return (list(inputs.cp_dims), []) if ds > 1 else ([], list(inputs.cp_dims))


def prepare(style: Any, cp_mesh: Any, qkv: Any) -> Any:
    """Every check, then (inputs on the working mesh, ulysses dims, gather dims, active masks)."""
    agree_on_call(style, cp_mesh, qkv, active_masks())   # first: the ranks run this call alike
    inputs = _prepare(style, cp_mesh, qkv)
    ulysses_dims, gather_dims = _mode_dims(style, cp_mesh, inputs)
    inputs = _validate(style, inputs, ulysses_dims)
    masks = active_masks()
    if masks is not None:   # packed documents / padding: masks.py, applied at the attention op
        try:
            check_masks(masks, inputs.shapes[0][0], inputs.shapes[0][inputs.seq],
                        inputs.shapes[1][inputs.seq])
        except ValueError as exc:   # the sizes were read through seq_dim: it may be the culprit
            raise ValueError(f"{exc} (sizes read with {_label(style)}; seq_dim=1, head_dim=2 for BSHD "
                             f"blocks, seq_dim=2, head_dim=1 for BNSD)") from None
    return inputs, ulysses_dims, gather_dims, masks


def run_attention(style: Any, cp_mesh: Any, qkv: Any, call: Any) -> Any:
    # the phases as ranges of a framework profiler's trace (the collectives inside have their own)
    platform = get_platform()
    with platform.profile_range("hyper_parallel::context_parallel::prepare"):
        inputs, ulysses_dims, gather_dims, masks = prepare(style, cp_mesh, qkv)
    with platform.profile_range("hyper_parallel::context_parallel::attention"):
        return run_prepared(style, inputs, ulysses_dims, gather_dims, masks, call)


def run_prepared(style: Any, inputs: Any, ulysses_dims: Any, gather_dims: Any, masks: Any, call: Any) -> Any:
    """The call in its mode, from ``prepare``'s checked inputs: the caller's output."""
    call = agreeing(inputs.mesh, call, lifetime_key(style))
    if masks is not None and not (style.kv_exchange == "ring" and gather_dims):
        call = with_masks(masks, call, inputs.seq, _label(style))
    if style.kv_exchange == "ring" and gather_dims:
        return deliver(style, inputs, *run_ring(style, inputs, ulysses_dims, gather_dims[0], call))
    call = _promising(style, inputs, ulysses_dims, gather_dims, call)
    if pipelinable(style, inputs, masks):   # overlap=True: head chunks pipelined (overlap.py)
        done = run_overlapped(style, inputs, ulysses_dims, gather_dims, call)
        if done is not None:
            return deliver(style, inputs, *done)
        call = recording(style, inputs, ulysses_dims, gather_dims, call)
    # one fused all-to-all for q, k, v and one all-gather for k, v where the layout allows
    q, k, v = mode_dtensors(inputs.mesh, inputs.locals, inputs.placements, inputs.shapes, inputs.seq,
                            inputs.head, ulysses_dims, gather_dims)
    if style.load_balance:
        return deliver(style, inputs, *_load_balanced(inputs, k, v, call))
    out = first_output(call(q, k, v))
    return deliver(style, inputs, *to_caller(out, inputs, ulysses_dims))


def agreeing(mesh: Any, call: Any, site: Any) -> Any:
    """``call`` with its attention kernel told to compare its settings across ``mesh``'s ranks;
    ``site`` (the style's lifetime key) keeps one module's verified settings from covering another's."""
    def agreed(*args, **kwargs):
        with attention_call(mesh, "ContextParallel", site):
            return call(*args, **kwargs)
    return agreed


def _promising(style, inputs, ulysses_dims, gather_dims, call):
    """``call`` with the attention kernel told how this mode splits q (core/attention/roles.py)."""
    splits = tuple([(m, "heads") for m in ulysses_dims] + [(m, "seq") for m in gather_dims])
    roles = AttentionRoles(inputs.mesh, splits, inputs.shapes[0][inputs.seq], _label(style))
    # the sequence dim is also followed to the kernel, once per signature (attention_roles.tracking)
    key = (lifetime_key(style), inputs.mesh, tuple(inputs.shapes), tuple(map(tuple, inputs.placements)))

    def promised(*args, **kwargs):
        with expecting(roles), tracking(key, args[:3], inputs.seq, roles.label):
            return call(*args, **kwargs)
    return promised


def _label(style):
    return f"ContextParallel(seq_dim={style.seq_dim}, head_dim={style.head_dim})"


def _load_balanced(inputs, k, v, call):
    mesh, (cp_dim,) = inputs.mesh, inputs.cp_dims
    head_l, tail_l = split_head_tail(inputs.locals[0], inputs.seq, mesh, cp_dim)
    outs, layouts = [], set()
    for half, local in enumerate((head_l, tail_l)):
        placements = list(inputs.placements[0])
        placements[cp_dim] = HeadTailShard(inputs.seq, half)
        q = DTensor.from_local(local, mesh, placements, shape=inputs.shapes[0])
        out = first_output(call(q, k, v))
        p = tuple(out.placements)
        split = p[cp_dim]
        if not (isinstance(split, HeadTailShard) and split.half == half
                and out.shape[split.dim] == inputs.shapes[0][inputs.seq]):
            raise ValueError(f"ContextParallel(load_balance=True): the attention output (global shape "
                             f"{tuple(out.shape)}, placements {p}) no longer holds this rank's query rows on "
                             f"one sequence dim; return the per-token attention output")
        layouts.add(p[:cp_dim] + (split.dim,) + p[cp_dim + 1:])
        outs.append(out.to_local())
    if len(layouts) != 1:
        raise ValueError(f"ContextParallel(load_balance=True): the two halves of the output came back in "
                         f"different layouts {sorted(map(str, layouts))}")
    seq = split.dim
    return merge_head_tail(outs[0], outs[1], seq, mesh, cp_dim), seq, p


def deliver(style: Any, inputs: Any, out_local: Any, seq: Any, placements: Any) -> Any:
    """This rank's output block as the caller gets it (local, or a DTensor on its mesh)."""
    if style.use_local_output or inputs.policy == InputPolicy.PLAIN:
        return out_local
    if inputs.policy == InputPolicy.CP_DTENSOR:
        own = inputs.own_mesh
        return DTensor.from_local(out_local, own, _seq_blocks(own, out_local.ndim, seq))
    return DTensor.from_local(out_local, inputs.own_mesh, [placements[m] for m in inputs.own_dims])
