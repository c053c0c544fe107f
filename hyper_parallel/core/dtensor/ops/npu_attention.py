"""``torch_npu.npu_fusion_attention`` (Ascend's fused attention kernel) on DTensors.

Signature (torch_npu)::

    npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                         atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                         next_tockens=2147483647, inner_precise=0, prefix=None,
                         actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, ...)
    -> (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)

Layouts (N1 query heads = ``head_num``, N2 key/value heads, D head dim)::

    BSH  (B, S, N*D)    SBH (S, B, N*D)    BSND (B, S, N, D)    BNSD (B, N, S, D)
    TND  (T, N, D): sequences packed along T; ``actual_seq_qlen`` / ``actual_seq_kvlen`` are
         the cumulative end offsets of the sequences (e.g. [5, 12, 16] for lengths 5, 7, 4).

Masking semantics this rule relies on (row i of Sq query rows, key j of Skv keys; in TND per
sequence). ``atten_mask`` True means *masked out*.

* sparse_mode 0: no ``atten_mask`` -> no mask at all (pre/next tokens ignored); with a full
  ``atten_mask`` ((Sq, Skv), (B|1, N1|1, Sq, Skv)) it applies, together with the band
  ``i - pre_tockens <= j <= i + next_tockens`` (measured from the top-left corner).
* sparse_mode 1: the full ``atten_mask`` alone (pre/next ignored).
* sparse_mode 2: left-up causal, ``j <= i``.
* sparse_mode 3: right-down causal, ``j <= i + Skv - Sq``.
* sparse_mode 4: band from the bottom-right corner,
  ``i + (Skv-Sq) - pre_tockens <= j <= i + (Skv-Sq) + next_tockens``.
  (2, 3 and 4 take the compressed 2048x2048 ``atten_mask``, which is passed on unchanged.)
* ``softmax_max`` / ``softmax_sum``: fp32 (B, N1, Sq, 8), in TND (T, N1, 8).

Per mesh dim the rule picks one of (cheapest first, see ``strategy_search.pick``):

* everything replicated;
* batch split on q, k, v alike (not TND; not with ``prefix``);
* heads split on q, k, v alike (N1 and N2 divisible by the mesh dim; in BSH/SBH the hidden dim is
  split, whole heads per rank): ``head_num`` becomes the local head count;
* queries split along the sequence, K/V replicated (all-gather-KV context parallelism, and the
  head-tail halves of load balancing): the kernel call is rewritten for the local query rows
  ``[r0, r0+L)`` (from the q layout's ``local_box``, so every half gets its own offset): the keys
  a block can see are cut to ``[k0, k1)`` and the band is re-expressed for the cut problem —
  left-up causal (2) becomes right-down causal (3) over the visible key prefix, right-down causal
  stays 3, bands (4, and 0 with a mask and finite pre/next tokens) get shifted pre/next tokens, an
  explicit mask is sliced to the local rows and visible columns. In TND the same is done per packed
  sequence, and ``actual_seq_qlen`` / ``actual_seq_kvlen`` are rebuilt for the local rows (a
  packed batch whose sequences need different band parameters runs as a few kernel calls whose
  outputs are concatenated along T).

Errors (ValueError): key/value split along the sequence (that needs ring attention), head counts
not divisible by the ranks splitting them, an unknown layout, sequence splits with ``pse`` /
``padding_mask``, prefix modes (5-8), or a TND explicit mask; TND cumulative lengths that do not
cover T.
"""
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.ops.strategy_search import pick
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.platform import get_platform

INT_MAX = 2147483647
_PARAMS = ("query", "key", "value", "head_num", "input_layout", "pse", "padding_mask", "atten_mask",
           "scale", "keep_prob", "pre_tockens", "next_tockens", "inner_precise", "prefix",
           "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode", "gen_mask_parallel", "sync")
_DEFAULTS = {"pse": None, "padding_mask": None, "atten_mask": None, "scale": 1.0, "keep_prob": 1.0,
             "pre_tockens": INT_MAX, "next_tockens": INT_MAX, "inner_precise": 0, "prefix": None,
             "actual_seq_qlen": None, "actual_seq_kvlen": None, "sparse_mode": 0}
# layout -> (batch dim, sequence dim, head dim (the hidden dim in BSH/SBH), heads packed in hidden)
LAYOUTS = {"BSH": (0, 1, 2, True), "SBH": (1, 0, 2, True), "BSND": (0, 1, 2, False),
           "BNSD": (0, 2, 1, False), "TND": (None, 0, 1, False)}
_SEQ_SPLIT_MODES = (0, 1, 2, 3, 4)


# ============================================================================ arguments
class _Args:
    """The call's arguments by name; ``given`` are the names the caller passed (only those, and
    the ones the rule changes, are passed on, so the kernel's own defaults stay in charge)."""

    def __init__(self, args, kwargs):
        self.values, self.given, self.extra = dict(_DEFAULTS), [], {}
        for name, value in zip(_PARAMS, args):
            self.values[name] = value
            self.given.append(name)
        if len(args) > len(_PARAMS):
            raise ValueError(f"npu_fusion_attention: {len(args)} positional arguments, at most "
                             f"{len(_PARAMS)} are known")
        for name, value in kwargs.items():
            if name in _PARAMS:
                self.values[name] = value
                if name not in self.given:
                    self.given.append(name)
            else:
                self.extra[name] = value

    def __getitem__(self, name):
        return self.values.get(name)

    def replaced(self, **changes):
        out = _Args((), {})
        out.values, out.given, out.extra = dict(self.values), list(self.given), dict(self.extra)
        for name, value in changes.items():
            out.values[name] = value
            if name not in out.given:
                out.given.append(name)
        return out

    def call(self, func):
        head = [self.values[n] for n in _PARAMS[:5]]
        kwargs = {n: self.values[n] for n in _PARAMS[5:] if n in self.given}
        kwargs.update(self.extra)
        return func(*head, **kwargs)


def _as_list(value):
    if value is None:
        return None
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [int(x) for x in value]


# ============================================================================ geometry
class _Geometry:
    def __init__(self, layout, q_shape, k_shape, head_num):
        if layout not in LAYOUTS:
            raise ValueError(f"npu_fusion_attention: input_layout {layout!r} is not one of "
                             f"{', '.join(LAYOUTS)}")
        self.layout = layout
        self.batch, self.seq, self.head, packed = LAYOUTS[layout]
        if len(q_shape) != (3 if layout in ("BSH", "SBH", "TND") else 4) or len(k_shape) != len(q_shape):
            raise ValueError(f"npu_fusion_attention: query {tuple(q_shape)} / key {tuple(k_shape)} do not "
                             f"match input_layout {layout}")
        self.n1 = int(head_num)
        if packed:
            if q_shape[2] % self.n1:
                raise ValueError(f"npu_fusion_attention: hidden size {q_shape[2]} is not a multiple of "
                                 f"head_num={self.n1} ({layout})")
            self.d = q_shape[2] // self.n1
            if k_shape[2] % self.d:
                raise ValueError(f"npu_fusion_attention: key hidden size {k_shape[2]} is not a multiple of "
                                 f"the head dim {self.d} ({layout})")
            self.n2 = k_shape[2] // self.d
        else:
            if q_shape[self.head] != self.n1:
                raise ValueError(f"npu_fusion_attention: head_num={self.n1} but query has "
                                 f"{q_shape[self.head]} heads ({layout})")
            self.d = q_shape[-1]
            self.n2 = k_shape[self.head]
        self.sq, self.skv = q_shape[self.seq], k_shape[self.seq]
        self.q_shape = tuple(q_shape)

    def stats_shape(self):
        """Shape of softmax_max / softmax_sum."""
        if self.layout == "TND":
            return (self.sq, self.n1, 8)
        return (self.q_shape[self.batch], self.n1, self.sq, 8)

    def stats_dim(self, dim):
        """The softmax_max/sum dim that a q tensor dim maps to."""
        if self.layout == "TND":
            return {0: 0, 1: 1}.get(dim)
        return {self.batch: 0, self.head: 1, self.seq: 2}.get(dim)


def _keep(p, dim):
    return p if p.is_shard(dim) else Shard(dim)


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


# ============================================================================ the rule
@register_rule("npu_fusion_attention")
def npu_fusion_attention_rule(call):
    a = _Args(call.args, call.kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    qs, ks, vs = call.spec(q), call.spec(k), call.spec(v)
    if qs is None or ks is None or vs is None:
        return None
    layout = str(a["input_layout"]).upper()
    geo = _Geometry(layout, qs.shape, ks.shape, a["head_num"])
    mode = int(a["sparse_mode"] or 0)
    mesh = call.mesh
    sizes = [mesh.size(m) for m in range(mesh.ndim)]

    for m, n in enumerate(sizes):
        for name, spec in (("key", ks), ("value", vs)):
            if spec.placements[m].is_shard(geo.seq):
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

    extras = [a["pse"], a["padding_mask"]]
    if any(x is not None for x in extras):
        if any(not p.is_replicate() for s in (qs, ks, vs) for p in s.placements):
            raise ValueError("npu_fusion_attention: pse / padding_mask are not supported with sharded "
                             "query/key/value; replicate the inputs or drop them")
        return OpStrategy(inputs=[None] * len(call.specs),
                          outputs=[tuple(Replicate() for _ in sizes)] * len(_output_shapes(call, geo)))

    seq_ok = mode in _SEQ_SPLIT_MODES
    if layout == "TND" and a["atten_mask"] is not None and mode in (0, 1):
        seq_ok = False
    numels = [_numel(s.shape) for s in (qs, ks, vs)]
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

    seq_split = any(p.is_shard(geo.seq) for p in q_t)
    if seq_split:
        _check_seq_split(a, geo, mode)
    head_split = 1
    for p, n in zip(q_t, sizes):
        if p.is_shard(geo.head):
            head_split *= n
    if geo.n1 % head_split or geo.n2 % head_split:
        raise ValueError(f"npu_fusion_attention: heads are split {head_split} ways but the head counts "
                         f"(query {geo.n1}, key/value {geo.n2}) are not divisible by {head_split}")

    inputs = [None] * len(call.specs)
    inputs[call.index(q)], inputs[call.index(k)], inputs[call.index(v)] = tuple(q_t), tuple(k_t), tuple(v_t)
    for name in ("atten_mask", "actual_seq_qlen", "actual_seq_kvlen"):
        i = call.index(a[name])
        if i is not None:  # masks are sliced locally from the replicated whole
            inputs[i] = tuple(Replicate() for _ in sizes)

    stats = tuple(p.with_dim(geo.stats_dim(p.dim)) if p.is_shard() else Replicate() for p in out)
    shapes = _output_shapes(call, geo)
    outputs = [tuple(out), stats, stats] + [tuple(Replicate() for _ in sizes)] * (len(shapes) - 3)
    q_box = qs.with_placements(tuple(q_t)).local_box()
    return OpStrategy(inputs=inputs, outputs=outputs, local=_local_call(geo, mode, q_box, seq_split))


def _check_seq_split(a, geo, mode):
    if mode not in _SEQ_SPLIT_MODES:
        raise ValueError(f"npu_fusion_attention: sparse_mode={mode} (prefix / varlen outer-cut modes) is "
                         f"not supported with queries split along the sequence; use sparse_mode 0-4")
    if geo.layout == "TND":
        if a["atten_mask"] is not None and mode in (0, 1):
            raise ValueError("npu_fusion_attention: an explicit atten_mask (sparse_mode 0/1) in TND layout "
                             "is not supported with queries split along T; use sparse_mode 2/3/4")
        cq, ckv = _as_list(a["actual_seq_qlen"]), _as_list(a["actual_seq_kvlen"])
        if cq is None or ckv is None or len(cq) != len(ckv) or not cq:
            raise ValueError("npu_fusion_attention: TND needs actual_seq_qlen and actual_seq_kvlen of equal "
                             "length (cumulative sequence ends)")
        if cq[-1] != geo.sq or ckv[-1] != geo.skv:
            raise ValueError(f"npu_fusion_attention: with queries split along T the packed sequences must "
                             f"cover T exactly (actual_seq_qlen ends at {cq[-1]}, T={geo.sq}; "
                             f"actual_seq_kvlen ends at {ckv[-1]}, T={geo.skv})")


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


# ============================================================================ local execution
def local_band(mode, pre, nxt, has_mask, o, lq, sq, skv):
    """Rewrite one (sq x skv) attention problem for its query rows [o, o+lq).

    Returns (k0, k1, mode, pre, next): the keys [k0, k1) the rows may see and the kernel
    arguments that give, on the cut problem (lq rows x k1-k0 keys), exactly the global mask."""
    inf_pre, inf_next = pre >= INT_MAX, nxt >= INT_MAX
    if mode == 1 or (mode == 0 and (not has_mask or (inf_pre and inf_next))):
        return 0, skv, mode, pre, nxt
    # the visible keys of row i are i + [lo, hi] (None = unbounded)
    if mode == 0:
        lo, hi = (None if inf_pre else -pre), (None if inf_next else nxt)
    elif mode == 2:
        lo, hi = None, 0
    elif mode == 3:
        lo, hi = None, skv - sq
    elif mode == 4:
        d = skv - sq
        lo, hi = (None if inf_pre else d - pre), (None if inf_next else d + nxt)
    else:
        raise ValueError(f"npu_fusion_attention: sparse_mode={mode} cannot be split along the sequence")
    k0 = 0 if lo is None else min(max(0, o + lo), skv)
    k1 = skv if hi is None else max(min(skv, o + lq + hi), 0)
    if k1 <= k0:  # no row of the block sees any key: keep every key, the band says it all
        k0, k1 = 0, skv
    lo_l = None if lo is None else lo + o - k0
    hi_l = None if hi is None else hi + o - k0
    if mode == 0:
        return (k0, k1, 0, INT_MAX if lo_l is None else _cap(-lo_l),
                INT_MAX if hi_l is None else _cap(hi_l))
    d_l = (k1 - k0) - lq
    if lo_l is None and hi_l == d_l:
        return k0, k1, 3, pre, nxt
    return (k0, k1, 4, INT_MAX if lo_l is None else _cap(d_l - lo_l),
            INT_MAX if hi_l is None else _cap(hi_l - d_l))


def _cap(x):
    return min(int(x), INT_MAX)


def _narrow(t, dim, start, length):
    """A slice as a contiguous tensor (the NPU kernel wants dense inputs)."""
    if start == 0 and length == t.shape[dim]:
        return t
    return t.narrow(dim, start, length).contiguous()


def _local_call(geo, mode, q_box, seq_split):
    """The kernel call on this rank's shards, for q's local box ``q_box`` [(start, size)] per dim."""
    def local(call, args, kwargs):
        a = _Args(args, kwargs)
        head_start, head_count = q_box[geo.head]
        if geo.layout in ("BSH", "SBH"):
            head_start, head_count = head_start // geo.d, head_count // geo.d
        changes = {}
        if head_count != geo.n1:
            changes["head_num"] = head_count
        mask = a["atten_mask"]
        if mask is not None and mask.ndim == 4 and mode in (0, 1):
            if geo.batch is not None and mask.shape[0] > 1:
                mask = _narrow(mask, 0, *q_box[geo.batch])
            if mask.shape[1] > 1:
                mask = _narrow(mask, 1, head_start, head_count)
            changes["atten_mask"] = mask
        a = a.replaced(**changes)
        if not seq_split:
            return a.call(call.func)
        r0, rows = q_box[geo.seq]
        if geo.layout == "TND":
            return _tnd_call(call.func, a, geo, mode, r0, rows)
        return _dense_call(call.func, a, geo, mode, r0, rows)
    return local


def _dense_call(func, a, geo, mode, r0, rows):
    k0, k1, new_mode, pre, nxt = local_band(mode, int(a["pre_tockens"]), int(a["next_tockens"]),
                                            a["atten_mask"] is not None, r0, rows, geo.sq, geo.skv)
    changes = {}
    if (k0, k1) != (0, geo.skv):
        changes["key"] = _narrow(a["key"], geo.seq, k0, k1 - k0)
        changes["value"] = _narrow(a["value"], geo.seq, k0, k1 - k0)
    mask = a["atten_mask"]
    if mask is not None and new_mode in (0, 1):
        if mask.shape[-2] == geo.sq:
            mask = _narrow(mask, mask.ndim - 2, r0, rows)
        if mask.shape[-1] == geo.skv:
            mask = _narrow(mask, mask.ndim - 1, k0, k1 - k0)
        changes["atten_mask"] = mask
    if new_mode != mode:
        changes["sparse_mode"] = new_mode
    if (pre, nxt) != (int(a["pre_tockens"]), int(a["next_tockens"])):
        changes["pre_tockens"], changes["next_tockens"] = pre, nxt
    return a.replaced(**changes).call(func)


def _tnd_call(func, a, geo, mode, r0, rows):
    """TND with query rows [r0, r0+rows) of the packed batch: per sequence, its local rows, the
    keys they see and the band; sequences with equal kernel arguments share one call."""
    cq, ckv = _as_list(a["actual_seq_qlen"]), _as_list(a["actual_seq_kvlen"])
    pre0, next0 = int(a["pre_tockens"]), int(a["next_tockens"])
    groups = []   # [key (mode, pre, next), q rows, kv ranges [(start, length)]]
    q_start = kv_start = 0
    for q_end, kv_end in zip(cq, ckv):
        lo, hi = max(q_start, r0), min(q_end, r0 + rows)
        if lo < hi:
            k0, k1, new_mode, pre, nxt = local_band(mode, pre0, next0, False, lo - q_start, hi - lo,
                                                    q_end - q_start, kv_end - kv_start)
            key = (new_mode, pre, nxt)
            if not groups or groups[-1][0] != key:
                groups.append([key, 0, []])
            groups[-1][1] += hi - lo
            groups[-1][2].append((kv_start + k0, k1 - k0))
        q_start, kv_start = q_end, kv_end
    platform = get_platform()
    results, row = [], 0
    for (new_mode, pre, nxt), n_rows, kv_ranges in groups:
        q_lens = _cumulative_q(cq, r0, rows, row, n_rows)
        kv_lens, acc = [], 0
        for _, length in kv_ranges:
            acc += length
            kv_lens.append(acc)
        changes = {"query": _narrow(a["query"], 0, row, n_rows),
                   "key": _gather_rows(platform, a["key"], kv_ranges),
                   "value": _gather_rows(platform, a["value"], kv_ranges),
                   "actual_seq_qlen": q_lens, "actual_seq_kvlen": kv_lens}
        if new_mode != mode:
            changes["sparse_mode"] = new_mode
        if (pre, nxt) != (pre0, next0):
            changes["pre_tockens"], changes["next_tockens"] = pre, nxt
        results.append(a.replaced(**changes).call(func))
        row += n_rows
    if len(results) == 1:
        return results[0]
    first = results[0]
    merged = [platform.cat([r[i] for r in results], 0) for i in range(3)]
    if isinstance(first, list):
        return merged + list(first[3:])
    return tuple(merged) + tuple(first[3:])


def _cumulative_q(cq, r0, rows, row, n_rows):
    """Cumulative local query lengths of the sequences covering local rows [row, row+n_rows)."""
    lo_g, hi_g = r0 + row, r0 + row + n_rows
    ends, start = [], 0
    for end in cq:
        a, b = max(start, lo_g), min(end, hi_g)
        if a < b:
            ends.append(b - lo_g)
        start = end
    return ends


def _gather_rows(platform, t, ranges):
    """Rows [start, start+length) of every range, concatenated along dim 0."""
    merged = []
    for start, length in ranges:
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((start, length))
    pieces = [_narrow(t, 0, s, n) for s, n in merged]
    return pieces[0] if len(pieces) == 1 else platform.cat(pieces, 0)
