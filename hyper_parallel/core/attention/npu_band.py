"""``npu_fusion_attention``'s band / sparse-mode maths: the kernel call for a block of query rows.

Masking semantics (row i of Sq query rows, key j of Skv keys; in TND per sequence).
``atten_mask`` True means *masked out*.

* sparse_mode 0: no ``atten_mask`` -> no mask at all (pre/next tokens ignored); with a full
  ``atten_mask`` ((Sq, Skv), (B|1, N1|1, Sq, Skv)) it applies, together with the band
  ``i - pre_tockens <= j <= i + next_tockens`` (measured from the top-left corner).
* sparse_mode 1: the full ``atten_mask`` alone (pre/next ignored).
* sparse_mode 2: left-up causal, ``j <= i``.
* sparse_mode 3: right-down causal, ``j <= i + Skv - Sq``.
* sparse_mode 4: band from the bottom-right corner,
  ``i + (Skv-Sq) - pre_tockens <= j <= i + (Skv-Sq) + next_tockens``.
  (2, 3 and 4 take the compressed 2048x2048 ``atten_mask``, which is passed on unchanged.)

A block of query rows ``[r0, r0+L)`` sees only the keys ``[k0, k1)``; the call is cut to them and
the band re-expressed for the cut problem: left-up causal (2) becomes right-down causal (3) over
the visible key prefix, right-down causal stays 3, bands (4, and 0 with a mask and finite pre/next
tokens) get shifted pre/next tokens, an explicit mask is sliced to the rows and visible columns.
In TND the same is done per packed sequence and ``actual_seq_qlen`` / ``actual_seq_kvlen`` are
rebuilt for the local rows; sequences that need different band parameters run as a few kernel
calls whose outputs are concatenated along T.
"""
from typing import Any

from hyper_parallel.core.attention.npu_args import INT_MAX, as_int_list
from hyper_parallel.platform import get_platform


def local_band(mode: Any, pre: Any, nxt: Any, has_mask: Any, o: Any, lq: Any, sq: Any, skv: Any) -> Any:
    """Rewrite one (sq x skv) attention problem for its query rows [o, o+lq).

    Returns (k0, k1, mode, pre, next): the keys [k0, k1) the rows may see and the kernel
    arguments that give, on the cut problem (lq rows x k1-k0 keys), exactly the global mask; or
    None when no row of the block sees any key (a band expressing that needs a negative
    pre/next token count, outside the kernel's documented range: see empty_rows_call)."""
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
    if k1 <= k0:
        return None
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


def narrow(t: Any, dim: Any, start: Any, length: Any) -> Any:
    """A slice as a contiguous tensor (the NPU kernel wants dense inputs)."""
    if start == 0 and length == t.shape[dim]:
        return t
    return t.narrow(dim, start, length).contiguous()


def empty_rows_call(func: Any, a: Any, seq: Any = None) -> Any:
    """The result for query rows that see no key, from a call with valid arguments only: the rows
    attend one key with no mask (sparse_mode 0, default pre/next; in TND the caller has already
    cut every sequence to one key), then the output is 0 and the statistics are those of an empty
    row (max -inf, sum 0), as the single-device kernel gives for fully masked rows. masked_fill
    keeps q, k, v in the graph with zero gradients."""
    one = {"atten_mask": None, "sparse_mode": 0, "pre_tockens": INT_MAX, "next_tockens": INT_MAX}
    if seq is not None:
        one["key"], one["value"] = narrow(a["key"], seq, 0, 1), narrow(a["value"], seq, 0, 1)
    result = a.replaced(**one).call(func)
    out, row_max, row_sum = result[0], result[1], result[2]
    everything = out.new_ones(tuple(out.shape)).bool()
    fixed = [out.masked_fill(everything, 0.0), row_max.new_full(tuple(row_max.shape), float("-inf")),
             row_sum.new_zeros(tuple(row_sum.shape))]
    if isinstance(result, list):
        return fixed + list(result[3:])
    return tuple(fixed) + tuple(result[3:])


def call_dense_rows(func: Any, a: Any, geo: Any, mode: Any, r0: Any, rows: Any) -> Any:
    """The kernel call for query rows [r0, r0+rows) of a BSH/SBH/BSND/BNSD problem."""
    band = local_band(mode, int(a["pre_tockens"]), int(a["next_tockens"]),
                      a["atten_mask"] is not None, r0, rows, geo.sq, geo.skv)
    if band is None:
        return empty_rows_call(func, a, geo.seq)
    k0, k1, new_mode, pre, nxt = band
    changes = {}
    if (k0, k1) != (0, geo.skv):
        changes["key"] = narrow(a["key"], geo.seq, k0, k1 - k0)
        changes["value"] = narrow(a["value"], geo.seq, k0, k1 - k0)
    mask = a["atten_mask"]
    if mask is not None and new_mode in (0, 1):
        if mask.shape[-2] == geo.sq:
            mask = narrow(mask, mask.ndim - 2, r0, rows)
        if mask.shape[-1] == geo.skv:
            mask = narrow(mask, mask.ndim - 1, k0, k1 - k0)
        changes["atten_mask"] = mask
    if new_mode != mode:
        changes["sparse_mode"] = new_mode
    if (pre, nxt) != (int(a["pre_tockens"]), int(a["next_tockens"])):
        changes["pre_tockens"], changes["next_tockens"] = pre, nxt
    return a.replaced(**changes).call(func)


def call_tnd_rows(func: Any, a: Any, mode: Any, r0: Any, rows: Any) -> Any:
    """TND with query rows [r0, r0+rows) of the packed batch: per sequence, its local rows, the
    keys they see and the band; sequences with equal kernel arguments share one call."""
    cq = as_int_list(a["actual_seq_qlen"])
    pre0, next0 = int(a["pre_tockens"]), int(a["next_tockens"])
    platform = get_platform()
    results, row = [], 0
    for (new_mode, pre, nxt), n_rows, kv_ranges in _tnd_groups(a, mode, r0, rows):
        kv_lens, acc = [], 0
        for _, length in kv_ranges:
            acc += length
            kv_lens.append(acc)
        changes = {"query": narrow(a["query"], 0, row, n_rows),
                   "key": _gather_rows(platform, a["key"], kv_ranges),
                   "value": _gather_rows(platform, a["value"], kv_ranges),
                   "actual_seq_qlen": _cumulative_q(cq, r0, rows, row, n_rows), "actual_seq_kvlen": kv_lens}
        row += n_rows
        if new_mode is None:   # these sequences' local rows see no key
            results.append(empty_rows_call(func, a.replaced(**changes)))
            continue
        if new_mode != mode:
            changes["sparse_mode"] = new_mode
        if (pre, nxt) != (pre0, next0):
            changes["pre_tockens"], changes["next_tockens"] = pre, nxt
        results.append(a.replaced(**changes).call(func))
    if len(results) == 1:
        return results[0]
    first = results[0]
    merged = [platform.cat([r[i] for r in results], 0) for i in range(3)]
    if isinstance(first, list):
        return merged + list(first[3:])
    return tuple(merged) + tuple(first[3:])


def _tnd_groups(a, mode, r0, rows):
    """Runs of consecutive sequences with equal band arguments:
    [(mode, pre, next), local q rows, kv ranges [(start, length)]]."""
    cq, ckv = as_int_list(a["actual_seq_qlen"]), as_int_list(a["actual_seq_kvlen"])
    pre0, next0 = int(a["pre_tockens"]), int(a["next_tockens"])
    groups = []
    q_start = kv_start = 0
    for q_end, kv_end in zip(cq, ckv):
        lo, hi = max(q_start, r0), min(q_end, r0 + rows)
        if lo < hi:
            band = local_band(mode, pre0, next0, False, lo - q_start, hi - lo, q_end - q_start,
                              kv_end - kv_start)
            # rows that see no key keep one key of their sequence for the (valid) placeholder call
            k0, k1, new_mode, pre, nxt = band if band is not None else (0, 1, None, None, None)
            key = (new_mode, pre, nxt)
            if not groups or groups[-1][0] != key:
                groups.append([key, 0, []])
            groups[-1][1] += hi - lo
            groups[-1][2].append((kv_start + k0, k1 - k0))
        q_start, kv_start = q_end, kv_end
    return groups


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
    pieces = [narrow(t, 0, s, n) for s, n in merged]
    return pieces[0] if len(pieces) == 1 else platform.cat(pieces, 0)
