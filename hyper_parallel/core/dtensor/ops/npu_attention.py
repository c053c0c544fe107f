"""The sharding rule of ``torch_npu.npu_fusion_attention`` (Ascend's fused attention kernel).

The arguments and layouts are described in ``npu_attention_args``, the masks (sparse modes, the
pre/next-token band) and the rewrite of a call for a block of query rows in ``npu_attention_band``.

Per mesh dim the rule picks one of (cheapest first, see ``strategy_search.pick``):

* everything replicated;
* batch split on q, k, v alike (not TND; not with ``prefix``);
* heads split on q, k, v alike (N1 and N2 divisible by the mesh dim; in BSH/SBH the hidden dim is
  split, whole heads per rank): ``head_num`` becomes the local head count;
* queries split along the sequence, K/V replicated (all-gather-KV context parallelism, and the
  head-tail halves of load balancing): the kernel call is rewritten for the local query rows
  ``[r0, r0+L)`` (from the q layout's ``local_box``, so every half gets its own offset), which
  cuts the keys to the ones those rows can see and re-expresses the band for the cut problem.

* TND with query, key and value all split along T alike (data parallelism over packed
  sequences, as the reference does it): every rank's T range must hold whole sequences (the
  same ones for q and k/v); the kernel runs on the local tokens with ``actual_seq_qlen`` /
  ``actual_seq_kvlen`` rebased to the local range (core/attention/npu_packed.py).

Errors (ValueError): key/value split along the sequence outside that TND case (that needs ring
attention), a packed TND split that cuts a sequence, head counts
not divisible by the ranks splitting them, an unknown layout, sequence splits with ``pse`` /
``padding_mask``, prefix modes (5-8), or a TND explicit mask; TND cumulative lengths that do not
cover T.
"""
from typing import Any
from hyper_parallel.core.dtensor.layout import numel
from hyper_parallel.core.attention.npu_args import (NpuAttentionArgs, NpuAttentionGeometry,
                                                    packed_sequence_ends)
from hyper_parallel.core.attention.npu_band import call_dense_rows, call_tnd_rows, local_band, narrow
from hyper_parallel.core.attention.npu_packed import check_packed_split, local_packed_lengths, packed_split
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.ops.strategy_search import pick
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard

# local_band is this rule's band maths; it stays importable from here (tests check it directly)
__all__ = ["local_band", "npu_fusion_attention_rule"]
_SEQ_SPLIT_MODES = (0, 1, 2, 3, 4)


def _keep(p, dim):
    return p if p.is_shard(dim) else Shard(dim)


@register_rule("npu_fusion_attention")
def npu_fusion_attention_rule(call: Any) -> Any:
    a = NpuAttentionArgs(call.args, call.kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    specs = qs, ks, vs = call.spec(q), call.spec(k), call.spec(v)
    if qs is None or ks is None or vs is None:
        return None
    geo = NpuAttentionGeometry(str(a["input_layout"]).upper(), qs.shape, ks.shape, a["head_num"])
    mode = int(a["sparse_mode"] or 0)
    sizes = [call.mesh.size(m) for m in range(call.mesh.ndim)]
    _check_input_splits(geo, sizes, specs)
    if a["pse"] is not None or a["padding_mask"] is not None:
        if any(not p.is_replicate() for s in specs for p in s.placements):
            raise ValueError("npu_fusion_attention: pse / padding_mask are not supported with sharded "
                             "query/key/value; replicate the inputs or drop them")
        return OpStrategy(inputs=[None] * len(call.specs),
                          outputs=[tuple(Replicate() for _ in sizes)] * len(_output_shapes(call, geo)))

    packed = packed_split(geo, specs)
    if packed:
        q_t, k_t, v_t, out = (list(s.placements) for s in specs + (qs,))
        check_packed_split(a, geo, call.mesh, specs)
    else:
        q_t, k_t, v_t, out = _choose_placements(a, geo, mode, sizes, specs)
    seq_split = not packed and any(p.is_shard(geo.seq) for p in q_t)
    if seq_split:
        _check_seq_split(a, geo, mode)
    _check_head_split(geo, sizes, q_t)

    inputs: list[Any] = [None] * len(call.specs)
    inputs[call.index(q)], inputs[call.index(k)], inputs[call.index(v)] = tuple(q_t), tuple(k_t), tuple(v_t)
    for name in ("atten_mask", "actual_seq_qlen", "actual_seq_kvlen"):
        i = call.index(a[name])
        if i is not None:  # masks are sliced locally from the replicated whole
            inputs[i] = tuple(Replicate() for _ in sizes)

    stats = tuple(p.with_dim(geo.stats_dim(p.dim)) if p.is_shard() else Replicate() for p in out)
    shapes = _output_shapes(call, geo)
    outputs = [tuple(out), stats, stats] + [tuple(Replicate() for _ in sizes)] * (len(shapes) - 3)
    q_box = qs.with_placements(tuple(q_t)).local_box()
    kv_box = ks.local_box() if packed else None
    return OpStrategy(inputs=inputs, outputs=outputs, local=_local_call(geo, mode, q_box, seq_split, kv_box))


def _check_input_splits(geo, sizes, specs):
    """K/V must not be split along the sequence; head splits must divide both head counts."""
    qs, ks, vs = specs
    packed = packed_split(geo, specs)
    for m, n in enumerate(sizes):
        for name, spec in (("key", ks), ("value", vs)):
            if spec.placements[m].is_shard(geo.seq) and not packed:
                raise ValueError(
                    f"npu_fusion_attention: {name} is split along the sequence on mesh dim {m} "
                    f"({spec.placements}); the kernel needs every key of the local queries. Use "
                    f"ContextParallel(kv_exchange='ring') for sequence-split K/V, or redistribute K/V "
                    f"to Replicate along the sequence (all-gather KV)")
        for name, spec in (("query", qs), ("key", ks), ("value", vs)):
            if spec.placements[m].is_shard(geo.head) and (geo.n1 % n or geo.n2 % n):
                raise ValueError(
                    f"npu_fusion_attention: {name} is split over heads on mesh dim {m} (size {n}) but "
                    f"the head counts (query {geo.n1}, key/value {geo.n2}) are not divisible by {n}; "
                    f"choose a ulysses_degree / tensor-parallel size that divides both")


def _choose_placements(a, geo, mode, sizes, specs):
    """Per mesh dim, the cheapest candidate: q, k, v and output placements (lists over mesh dims)."""
    qs, ks, vs = specs
    seq_ok = mode in _SEQ_SPLIT_MODES
    if geo.layout == "TND" and a["atten_mask"] is not None and mode in (0, 1):
        seq_ok = False
    numels = [numel(s.shape) for s in specs]
    q_t, k_t, v_t, out = [], [], [], []
    for m, n in enumerate(sizes):
        pq, pk, pv = qs.placements[m], ks.placements[m], vs.placements[m]
        cands = [([Replicate()] * 3, Replicate())]
        b = geo.batch
        if b is not None and a["prefix"] is None and qs.shape[b] % n == 0 and ks.shape[b] == qs.shape[b]:
            cands.append(([_keep(pq, b), _keep(pk, b), _keep(pv, b)], _keep(pq, b)))
        h = geo.head
        if geo.n1 % n == 0 and geo.n2 % n == 0:
            cands.append(([_keep(pq, h), _keep(pk, h), _keep(pv, h)], _keep(pq, h)))
        if seq_ok or pq.is_shard(geo.seq):
            cands.append(([_keep(pq, geo.seq), Replicate(), Replicate()], _keep(pq, geo.seq)))
        (tq, tk, tv), po = pick(cands, [pq, pk, pv], numels, n)
        q_t.append(tq)
        k_t.append(tk)
        v_t.append(tv)
        out.append(po)
    return q_t, k_t, v_t, out


def _check_head_split(geo, sizes, q_t):
    head_split = 1
    for p, n in zip(q_t, sizes):
        if p.is_shard(geo.head):
            head_split *= n
    if geo.n1 % head_split or geo.n2 % head_split:
        raise ValueError(f"npu_fusion_attention: heads are split {head_split} ways but the head counts "
                         f"(query {geo.n1}, key/value {geo.n2}) are not divisible by {head_split}")


def _check_seq_split(a, geo, mode):
    if mode not in _SEQ_SPLIT_MODES:
        raise ValueError(f"npu_fusion_attention: sparse_mode={mode} (prefix / varlen outer-cut modes) is "
                         f"not supported with queries split along the sequence; use sparse_mode 0-4")
    if geo.layout == "TND":
        if a["atten_mask"] is not None and mode in (0, 1):
            raise ValueError("npu_fusion_attention: an explicit atten_mask (sparse_mode 0/1) in TND layout "
                             "is not supported with queries split along T; use sparse_mode 2/3/4")
        packed_sequence_ends(a, geo)


def _output_shapes(call, geo):
    """Global output shapes: attention_out and the softmax statistics as documented; the reserved
    outputs after them as the kernel's meta function gives them (an empty tensor if it has none)."""
    try:
        shapes = list(call.out_shapes)
    except Exception:  # noqa: BLE001  (no meta kernel in this torch_npu build)
        shapes = [None, None, None, (0,)]
    shapes[:3] = [geo.q_shape, geo.stats_shape(), geo.stats_shape()]
    call._out_shapes = shapes
    return shapes


def _local_call(geo, mode, q_box, seq_split, kv_box=None):
    """The kernel call on this rank's shards, for q's local box ``q_box`` [(start, size)] per dim
    (``kv_box``: k/v's, when q, k, v are all split along T: packed TND)."""
    def npu_attention_on_block(call, args, kwargs):
        a = NpuAttentionArgs(args, kwargs)
        head_start, head_count = q_box[geo.head]
        if geo.layout in ("BSH", "SBH"):
            head_start, head_count = head_start // geo.d, head_count // geo.d
        changes = {}
        if head_count != geo.n1:
            changes["head_num"] = head_count
        mask = a["atten_mask"]
        if mask is not None and mask.ndim == 4 and mode in (0, 1):
            if geo.batch is not None and mask.shape[0] > 1:
                mask = narrow(mask, 0, *q_box[geo.batch])
            if mask.shape[1] > 1:
                mask = narrow(mask, 1, head_start, head_count)
            changes["atten_mask"] = mask
        if kv_box is not None:
            changes.update(local_packed_lengths(a, q_box[geo.seq], kv_box[geo.seq]))
        a = a.replaced(**changes)
        if not seq_split:
            return a.call(call.func)
        r0, rows = q_box[geo.seq]
        if geo.layout == "TND":
            return call_tnd_rows(call.func, a, mode, r0, rows)
        return call_dense_rows(call.func, a, geo, mode, r0, rows)
    return npu_attention_on_block
