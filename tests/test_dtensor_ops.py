"""Every dispatched DTensor op against the same computation on plain tensors.

For each check, every rank builds the same full inputs (seeded by the check's name), lays them out
as DTensors in the requested placements (Partial ones as random pieces that reduce to the input),
runs the op, and compares
* the forward value (``full_tensor()`` of every output) and, where given, the output placements;
* the local shard shapes against the layout the output claims;
* the gradient of every input for a random linear loss of the outputs: ``full_tensor()`` of
  ``.grad`` and its placements (the input's own, with Partial -> Replicate).
Checks run on 1-D meshes of 2 and 4 ranks (uneven and empty shards on purpose) and on a 2x2 mesh.
Many checks share one ``run_dist`` call; each rank returns the failures it saw.
"""
import os
import traceback
import warnings

import pytest

from tests.harness import run_dist

WORLD_SIZES = [2, 4]


from tests.op_checks import TOL, Checks, D, _mesh


def _elementwise_checks(c):
    import torch
    import torch.nn.functional as F
    from hyper_parallel import Partial, Replicate, Shard
    S, R, P = Shard, Replicate(), Partial()
    x, y = c.randn("ew", 7, 6), c.randn("ew2", 7, 6)
    row, col, one = c.randn("ew3", 6), c.randn("ew4", 7, 1), c.randn("ew5", 1, 6)
    c.check("add S0+S0", torch.add, D(x, S(0)), D(y, S(0)), out=(S(0),))
    c.check("add S0+S1", lambda a, b: a + b, D(x, S(0)), D(y, S(1)))
    c.check("add S1+R", lambda a, b: a + b, D(x, S(1)), D(y, R), out=(S(1),))
    c.check("add S0+row R (broadcast)", lambda a, b: a + b, D(x, S(0)), D(row, R), out=(S(0),))
    c.check("add S1+row S0 (broadcast)", lambda a, b: a + b, D(x, S(1)), D(row, S(0)), out=(S(1),))
    c.check("mul S0*col S0 (size-1 dim)", lambda a, b: a * b, D(x, S(1)), D(col, S(0)), out=(S(1),))
    c.check("mul S0*(1,6) S1", lambda a, b: a * b, D(x, S(0)), D(one, S(1)), out=(S(0),))
    c.check("sub R-R", torch.sub, D(x, R), D(y, R), out=(R,))
    c.check("add plain operand", lambda a: a + y, D(x, S(0)), out=(S(0),))
    c.check("relu/gelu/silu/tanh", lambda a: (F.relu(a), F.gelu(a), F.silu(a), torch.tanh(a), a.exp()),
            D(x, S(1)), out=(S(1),))
    c.check("pow/abs/neg", lambda a: (a ** 2, a.abs(), -a), D(x, S(0)), out=(S(0),))
    c.check("where/masked_fill", lambda a, b: (torch.where(a > 0, a, b), a.masked_fill(b > 0, 0.5)),
            D(x, S(0)), D(y, S(1)))
    c.check("compare", lambda a, b: (a > b, a == a), D(x, S(0)), D(y, S(0)), out=(S(0),))
    # Partial linearity
    c.check("P+P", lambda a, b: a + b, D(x, P), D(y, P), out=(P,))
    c.check("P-P", lambda a, b: a - b, D(x, P), D(y, P), out=(P,))
    c.check("P*2", lambda a: a * 2.0, D(x, P), out=(P,))
    c.check("-P", lambda a: -a, D(x, P), out=(P,))
    c.check("P*R", lambda a, b: a * b, D(x, P), D(y, R), out=(P,))
    c.check("P/R", lambda a, b: a / b.abs().add(1), D(x, P), D(y, R))
    c.check("R/P (not linear)", lambda a, b: a / (b * b + 1), D(x, R), D(y, P), out=(R,))
    c.check("P+R (not linear)", lambda a, b: a + b, D(x, P), D(y, R), out=(R,))
    c.check("P*P (not linear)", lambda a, b: a * b, D(x, P), D(y, P), out=(R,))
    c.check("exp(P)", torch.exp, D(x, P), out=(R,))
    c.check("P(sum)+P(avg)", lambda a, b: a + b, D(x, P), D(y, Partial("avg")), out=(R,))
    c.check("P(avg)+P(avg)", lambda a, b: a + b, D(x, Partial("avg")), D(y, Partial("avg")),
            out=(Partial("avg"),))
    c.check("P*S0", lambda a, b: a * b, D(x, P), D(y, S(0)), out=(S(0),))
    c.check("P(max) relu", F.relu, D(x, Partial("max")), out=(R,))


def _matmul_checks(c):
    import torch
    import torch.nn.functional as F
    from hyper_parallel import Partial, Replicate, Shard
    S, R, P = Shard, Replicate(), Partial()
    a, b = c.randn("mm_a", 6, 9), c.randn("mm_b", 9, 5)
    for pa in (R, S(0), S(1)):
        for pb in (R, S(0), S(1)):
            c.check(f"mm {pa}@{pb}", torch.mm, D(a, pa), D(b, pb))
    c.check("mm S1@S0 -> P", torch.mm, D(a, S(1)), D(b, S(0)), out=(P,))
    c.check("mm S0@R -> S0", torch.matmul, D(a, S(0)), D(b, R), out=(S(0),))
    c.check("mm R@S1 -> S1", lambda u, v: u @ v, D(a, R), D(b, S(1)), out=(S(1),))
    c.check("mm P@R -> P", torch.mm, D(a, P), D(b, R), out=(P,))
    c.check("mm R@P -> P", torch.mm, D(a, R), D(b, P), out=(P,))
    c.check("mm P@P", torch.mm, D(a, P), D(b, P))
    c.check("mm S0@plain", lambda u: u @ b, D(a, S(0)), out=(S(0),))
    c.check("rmatmul plain@S1", lambda v: a @ v, D(b, S(1)), out=(S(1),))
    x3, x3b = c.randn("mm3", 3, 6, 9), c.randn("mm3b", 3, 9, 5)
    for pa in (R, S(0), S(1), S(2)):
        for pb in (R, S(0), S(1)):
            c.check(f"matmul 3d {pa}@{pb}", torch.matmul, D(x3, pa), D(b, pb))
    for pa, pb in ((S(0), S(0)), (S(1), R), (S(2), S(1)), (R, S(2)), (S(0), R), (P, R)):
        c.check(f"bmm {pa}@{pb}", torch.bmm, D(x3, pa), D(x3b, pb))
    c.check("bmm S0@S0 -> S0", torch.bmm, D(x3, S(0)), D(x3b, S(0)), out=(S(0),))
    v9 = c.randn("vec", 9)
    c.check("matvec S0@R", torch.matmul, D(a, S(0)), D(v9, R), out=(S(0),))
    c.check("matvec S1@S0", torch.matmul, D(a, S(1)), D(v9, S(0)), out=(P,))
    c.check("vecmat S0@S0", torch.matmul, D(v9, S(0)), D(b, S(0)), out=(P,))
    xl, w, bias = c.randn("lin_x", 3, 6, 9), c.randn("lin_w", 5, 9), c.randn("lin_b", 5)
    for px in (R, S(0), S(1), S(2), P):
        for pw in (R, S(0), S(1)):
            c.check(f"linear x{px} w{pw} bias R", F.linear, D(xl, px), D(w, pw), D(bias, R))
    c.check("linear colwise", F.linear, D(xl, R), D(w, S(0)), D(bias, S(0)), out=(S(2),))
    c.check("linear rowwise", F.linear, D(xl, S(2)), D(w, S(1)), D(bias, R), out=(P,))
    c.check("linear no bias rowwise", F.linear, D(xl, S(-1)), D(w, S(1)), out=(P,))
    c.check("linear seq", F.linear, D(xl, S(1)), D(w, R), D(bias, R), out=(S(1),))


def _view_checks(c):
    import torch
    from hyper_parallel import Partial, Shard
    S, P = Shard, Partial()
    x = c.randn("view", 8, 3, 4)
    c.check("view S0 (8,12)", lambda t: t.view(8, 12), D(x, S(0)), out=(S(0),))
    c.check("reshape S0 -> (24,4)", lambda t: t.reshape(24, 4), D(x, S(0)), out=(S(0),))
    c.check("reshape S1 -> (8,12)", lambda t: t.reshape(8, 12), D(x, S(1)))
    c.check("reshape S2 -> (96,)", lambda t: torch.reshape(t, (-1,)), D(x, S(2)))
    c.check("flatten(1) S0", lambda t: t.flatten(1), D(x, S(0)), out=(S(0),))
    c.check("flatten S1", torch.flatten, D(x, S(1)))
    c.check("unflatten S0", lambda t: t.unflatten(0, (4, 2)), D(x, S(0)), out=(S(0),))
    c.check("unflatten S2", lambda t: t.unflatten(2, (2, 2)), D(x, S(2)))
    c.check("unsqueeze S1", lambda t: t.unsqueeze(1), D(x, S(1)), out=(S(2),))
    c.check("unsqueeze(-1) S2", lambda t: torch.unsqueeze(t, -1), D(x, S(2)), out=(S(2),))
    c.check("squeeze S1", lambda t: t.unsqueeze(0).squeeze(0), D(x, S(1)), out=(S(1),))
    c.check("view P", lambda t: t.view(24, 4), D(x, P), out=(P,))
    c.check("view_as / reshape_as", lambda t, u: (t.view_as(u), t.reshape_as(u)), D(x, S(0)),
            D(torch.zeros(8, 12), S(0)))
    u = c.randn("view_uneven", 7, 6)
    c.check("reshape uneven S0 (7,6)->(7,2,3)", lambda t: t.reshape(7, 2, 3), D(u, S(0)), out=(S(0),))
    c.check("reshape uneven S0 (7,6)->(42,)", lambda t: t.reshape(42), D(u, S(0)))
    c.check("reshape uneven S1 (7,6)->(7,3,2)", lambda t: t.reshape(7, 3, 2), D(u, S(1)))
    c.check("transpose S0", lambda t: t.transpose(0, 2), D(x, S(0)), out=(S(2),))
    c.check("transpose S1", lambda t: torch.transpose(t, 1, -1), D(x, S(1)), out=(S(2),))
    c.check("permute S2", lambda t: t.permute(2, 0, 1), D(x, S(2)), out=(S(0),))
    c.check("permute tuple S0", lambda t: torch.permute(t, (1, 2, 0)), D(x, S(0)), out=(S(2),))
    c.check("movedim S0", lambda t: t.movedim(0, -1), D(x, S(0)), out=(S(2),))
    c.check("movedim list S1", lambda t: torch.movedim(t, [1, 2], [0, 1]), D(x, S(1)), out=(S(0),))
    c.check("t S0", lambda t: t.t(), D(u, S(0)), out=(S(1),))
    c.check("t P", torch.t, D(u, P), out=(P,))
    c.check("contiguous S1", lambda t: t.transpose(0, 1).contiguous(), D(x, S(1)), out=(S(0),))
    c.check("expand S0", lambda t: t.unsqueeze(1).expand(8, 5, 3, 4), D(x, S(0)), out=(S(0),))


def _softmax_sdpa_checks(c):
    import torch
    import torch.nn.functional as F
    from hyper_parallel import Partial, Replicate, Shard
    S, R, P = Shard, Replicate(), Partial()
    x = c.randn("softmax", 5, 7, 6)
    c.check("softmax(-1) S0", lambda t: F.softmax(t, dim=-1), D(x, S(0)), out=(S(0),))
    c.check("softmax(-1) S2", lambda t: t.softmax(-1), D(x, S(2)), out=(R,))
    c.check("softmax(1) S2", lambda t: torch.softmax(t, 1), D(x, S(2)), out=(S(2),))
    c.check("log_softmax(2) S1", lambda t: F.log_softmax(t, 2), D(x, S(1)), out=(S(1),))
    c.check("log_softmax(0) S0", lambda t: t.log_softmax(0), D(x, S(0)), out=(R,))
    c.check("softmax P", lambda t: F.softmax(t, -1), D(x, P), out=(R,))

    q, k, v = c.randn("q", 2, 4, 8, 4), c.randn("k", 2, 4, 8, 4), c.randn("v", 2, 4, 8, 4)
    qb, kb, vb = c.randn("qb", 4, 2, 5, 4), c.randn("kb", 4, 2, 5, 4), c.randn("vb", 4, 2, 5, 4)
    sdpa = F.scaled_dot_product_attention
    for causal in (False, True):
        c.check(f"sdpa heads S1 causal={causal}", lambda a, b, d: sdpa(a, b, d, is_causal=causal),
                D(q, S(1)), D(k, S(1)), D(v, S(1)), out=(S(1),))
        c.check(f"sdpa batch S0 causal={causal}", lambda a, b, d: sdpa(a, b, d, is_causal=causal),
                D(qb, S(0)), D(kb, S(0)), D(vb, S(0)), out=(S(0),))
        c.check(f"sdpa q seq S2 kv R causal={causal}", lambda a, b, d: sdpa(a, b, d, is_causal=causal),
                D(q, S(2)), D(k, R), D(v, R), out=(S(2),))
    q7 = c.randn("q7", 2, 4, 7, 4)
    k7, v7 = c.randn("k7", 2, 4, 7, 4), c.randn("v7", 2, 4, 7, 4)
    c.check("sdpa q seq S2 uneven causal", lambda a, b, d: sdpa(a, b, d, is_causal=True),
            D(q7, S(2)), D(k7, R), D(v7, R), out=(S(2),))
    c.check("sdpa q seq S2 causal scale", lambda a, b, d: sdpa(a, b, d, is_causal=True, scale=0.3),
            D(q, S(2)), D(k, R), D(v, R), out=(S(2),))
    mask = torch.rand((8, 8), generator=c.gen("mask")) > 0.4
    mask |= torch.eye(8, dtype=torch.bool)
    c.check("sdpa q seq S2 global mask (plain)", lambda a, b, d: sdpa(a, b, d, attn_mask=mask),
            D(q, S(2)), D(k, R), D(v, R), out=(S(2),))
    mask4 = torch.rand((2, 1, 8, 8), generator=c.gen("mask4")) > 0.4
    mask4 |= torch.eye(8, dtype=torch.bool)
    c.check("sdpa q seq S2 global mask (DTensor R)", lambda a, b, d, mk: sdpa(a, b, d, attn_mask=mk),
            D(q, S(2)), D(k, R), D(v, R), D(mask4, R), out=(S(2),))
    fmask = c.randn("fmask", 8, 8)
    c.check("sdpa heads S1 float mask", lambda a, b, d: sdpa(a, b, d, attn_mask=fmask),
            D(q, S(1)), D(k, S(1)), D(v, S(1)), out=(S(1),))
    c.check("sdpa q S2 k,v S2 (gathered)", lambda a, b, d: sdpa(a, b, d, is_causal=True),
            D(q, S(2)), D(k, S(2)), D(v, S(2)))


def _embedding_checks(c):
    import torch
    import torch.nn.functional as F
    from hyper_parallel import Partial, Replicate, Shard
    S, R, P = Shard, Replicate(), Partial()
    vocab = 11
    ids = torch.randint(0, vocab, (3, 5), generator=c.gen("ids"))
    ids[0, 0], ids[1, 1], ids[2, 2] = 2, vocab - 1, 0
    w = c.randn("emb_w", vocab, 6)
    c.check("emb w R ids R", F.embedding, D(ids, R), D(w, R), out=(R,))
    c.check("emb w R ids S0", F.embedding, D(ids, S(0)), D(w, R), out=(S(0),))
    c.check("emb w R ids S1", F.embedding, D(ids, S(1)), D(w, R), out=(S(1),))
    c.check("emb w R ids plain", lambda wt: F.embedding(ids, wt), D(w, R), out=(R,))
    c.check("emb colwise w S1 ids R", F.embedding, D(ids, R), D(w, S(1)), out=(S(2),))
    c.check("emb colwise w S1 ids S0", F.embedding, D(ids, S(0)), D(w, S(1)), out=(S(2),))
    c.check("emb rowwise w S0 ids R", F.embedding, D(ids, R), D(w, S(0)), out=(P,))
    c.check("emb rowwise w S0 ids S1", F.embedding, D(ids, S(1)), D(w, S(0)), out=(P,))
    c.check("emb rowwise w S0 ids plain", lambda wt: F.embedding(ids, wt), D(w, S(0)), out=(P,))
    c.check("emb w P", F.embedding, D(ids, R), D(w, P), out=(R,))
    for pw in (R, S(0), S(1)):
        for pad in (2, -1, 0):
            c.check(f"emb padding_idx={pad} w {pw}", lambda i, wt: F.embedding(i, wt, padding_idx=pad),
                    D(ids, R), D(w, pw))
    c.check("emb module-like 1-D ids rowwise", F.embedding, D(ids[0], R), D(w, S(0)), out=(P,))
    tiny = c.randn("emb_tiny", 3, 4)  # 3 rows on 4 ranks: one rank holds no row
    c.check("emb rowwise tiny vocab", F.embedding, D(ids % 3, R), D(tiny, S(0)), out=(P,))


def _norm_dropout_checks(c):
    import torch
    import torch.nn.functional as F
    from hyper_parallel import Partial, Replicate, Shard
    S, R, P = Shard, Replicate(), Partial()
    x = c.randn("norm", 4, 5, 6)
    w, b = c.randn("norm_w", 6), c.randn("norm_b", 6)
    w2 = c.randn("norm_w2", 5, 6)
    ln = F.layer_norm
    for px in (R, S(0), S(1), S(2), P):
        expect = (S(px.dim),) if px.is_shard() and px.dim < 2 else (R,)
        c.check(f"layer_norm {px}", lambda t, wt, bs: ln(t, (6,), wt, bs), D(x, px), D(w, R), D(b, R),
                out=expect)
        c.check(f"rms_norm {px}", lambda t, wt: F.rms_norm(t, (6,), wt, eps=1e-6), D(x, px), D(w, R),
                out=expect)
    c.check("layer_norm 2 dims S1", lambda t, wt: ln(t, (5, 6), wt), D(x, S(1)), D(w2, R), out=(R,))
    c.check("layer_norm 2 dims S0", lambda t, wt: ln(t, [5, 6], wt), D(x, S(0)), D(w2, S(1)), out=(S(0),))
    c.check("layer_norm no affine S0", lambda t: ln(t, (6,)), D(x, S(0)), out=(S(0),))
    c.check("layer_norm weight S0", lambda t, wt, bs: ln(t, (6,), wt, bs, 1e-3), D(x, S(1)), D(w, S(0)),
            D(b, P), out=(S(1),))
    c.check("rms_norm no weight S1", lambda t: F.rms_norm(t, (6,)), D(x, S(1)), out=(S(1),))
    c.check("rms_norm 2 dims S0", lambda t, wt: F.rms_norm(t, (5, 6), wt), D(x, S(0)), D(w2, R), out=(S(0),))

    c.check("dropout p=0 S0", lambda t: F.dropout(t, 0.0), D(x, S(0)), out=(S(0),))
    c.check("dropout eval S2", lambda t: F.dropout(t, 0.5, training=False), D(x, S(2)), out=(S(2),))
    c.check("torch.dropout train=False S1", lambda t: torch.dropout(t, 0.3, False), D(x, S(1)), out=(S(1),))
    c.check("torch.dropout p=0 kw", lambda t: torch.dropout(t, p=0.0, train=True), D(x, S(1)), out=(S(1),))
    c.check("dropout p=0 P stays P", lambda t: F.dropout(t, 0.0), D(x, P), out=(P,))
    c.check("dropout eval R", lambda t: F.dropout(t, 0.2, False), D(x, R), out=(R,))


def _dropout_statistics(c, placements, name):
    """p > 0: about p of the entries dropped, the rest scaled by 1 / (1 - p), and the gradient is
    the same mask (for an all-ones input the output itself)."""
    import torch
    import torch.nn.functional as F
    c.count += 1
    try:
        p = 0.25
        ones = torch.ones(64, 48)
        x = c.make(ones, placements, name)
        y = F.dropout(x, p)
        from hyper_parallel import Replicate
        want = tuple(Replicate() if q.is_partial() else q for q in placements)
        assert tuple(y.placements) == want, f"placements {y.placements}, expected {want}"
        full = y.full_tensor().detach()
        dropped = (full == 0).float().mean().item()
        assert abs(dropped - p) < 0.05, f"dropped fraction {dropped:.3f}, expected about {p}"
        kept = full[full != 0]
        torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - p)), **TOL)
        y.sum().backward()
        assert tuple(x.grad.placements) == tuple(Replicate() if q.is_partial() else q for q in placements)
        torch.testing.assert_close(x.grad.full_tensor(), full, **TOL, msg=lambda m: f"grad vs mask: {m}")
    except Exception as exc:  # noqa: BLE001
        c.failures.append(f"[{name}] {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")


def _reduction_checks(c):
    import torch
    from hyper_parallel import Partial, Replicate, Shard
    S, R, P = Shard, Replicate(), Partial()
    x = c.randn("red", 5, 6, 7)
    for px in (R, S(0), S(1), S(2)):
        c.check(f"sum() {px}", torch.sum, D(x, px), out=(P,) if px.is_shard() else (R,))
        c.check(f"mean() {px}", lambda t: t.mean(), D(x, px), out=(P,) if px.is_shard() else (R,))
        c.check(f"sum(0) {px}", lambda t: t.sum(0), D(x, px))
        c.check(f"sum((0,2)) {px}", lambda t: torch.sum(t, (0, 2)), D(x, px))
        c.check(f"sum(-1, keepdim) {px}", lambda t: t.sum(-1, keepdim=True), D(x, px))
        c.check(f"mean(1) {px}", lambda t: t.mean(1), D(x, px))
        c.check(f"mean([0,1], keepdim) {px}", lambda t: torch.mean(t, dim=[0, 1], keepdim=True), D(x, px))
        c.check(f"amax(2) {px}", lambda t: t.amax(2), D(x, px))
        c.check(f"amax() {px}", torch.amax, D(x, px), out=(R,))
        c.check(f"amin((0,1), keepdim) {px}", lambda t: torch.amin(t, (0, 1), keepdim=True), D(x, px))
        c.check(f"amin(-3) {px}", lambda t: t.amin(dim=-3), D(x, px))
    c.check("sum(0) S0 -> P", lambda t: t.sum(0), D(x, S(0)), out=(P,))
    c.check("sum(0) S1 -> S0", lambda t: t.sum(0), D(x, S(1)), out=(S(0),))
    c.check("sum(0, keepdim) S1 -> S1", lambda t: t.sum(0, keepdim=True), D(x, S(1)), out=(S(1),))
    c.check("mean(2) S2 -> P", lambda t: t.mean(2), D(x, S(2)), out=(P,))
    c.check("mean(0) S2 -> S1", lambda t: t.mean(0), D(x, S(2)), out=(S(1),))
    c.check("amax(2) S2 -> R", lambda t: t.amax(2), D(x, S(2)), out=(R,))
    c.check("amin(0) S2 -> S1", lambda t: t.amin(0), D(x, S(2)), out=(S(1),))
    c.check("sum dtype float64", lambda t: t.sum(1, dtype=torch.float64), D(x, S(1)), out=(P,))
    c.check("mean dtype float64", lambda t: t.mean(1, dtype=torch.float64), D(x, S(1)), out=(P,))
    c.check("sum P", lambda t: t.sum(1), D(x, P), out=(P,))
    c.check("mean P(avg)", lambda t: t.mean(), D(x, Partial("avg")), out=(Partial("avg"),))
    c.check("sum P(max) -> R", lambda t: t.sum(0), D(x, Partial("max")), out=(R,))
    c.check("amax P -> R", lambda t: t.amax(0), D(x, P), out=(R,))
    c.check("amin P(min) -> R", lambda t: t.amin(1), D(x, Partial("min")), out=(R,))
    c.check("sum axis kw", lambda t: torch.sum(t, axis=2), D(x, S(2)), out=(P,))
    # max / min: full reduction, (values, indices) over a dim, elementwise with another tensor
    for px in (S(0), S(2), P):
        c.check(f"max() {px}", lambda t: t.max(), D(x, px), out=(R,))
        c.check(f"min() {px}", torch.min, D(x, px), out=(R,))
    c.check("max(1) S0", lambda t: torch.max(t, 1), D(x, S(0)), out=(S(0),))
    c.check("max(0) S0 (gathered)", lambda t: t.max(0), D(x, S(0)), out=(R,))
    c.check("min(dim=2, keepdim) S1", lambda t: t.min(dim=2, keepdim=True), D(x, S(1)), out=(S(1),))
    c.check("min(-1) S2 (gathered)", lambda t: torch.min(t, -1), D(x, S(2)), out=(R,))
    c.check("max(0) S2", lambda t: t.max(0)[0], D(x, S(2)), out=(S(1),))
    c.check("min(1) P", lambda t: t.min(1), D(x, P), out=(R,))
    c.check("max(a, b) S0,S0", torch.max, D(x, S(0)), D(x.flip(0), S(0)), out=(S(0),))
    c.check("min(a, b) S1,R", lambda u, v: u.min(v), D(x, S(1)), D(x.flip(1), R), out=(S(1),))


def _slicing_checks(c):
    import torch
    from hyper_parallel import Partial, Replicate, Shard
    S, R, P = Shard, Replicate(), Partial()
    x = c.randn("slice", 6, 7, 5)
    c.check("split(2, 0) S0", lambda t: t.split(2, 0), D(x, S(0)), out=(R,))
    c.check("split(2, 1) S0", lambda t: torch.split(t, 2, dim=1), D(x, S(0)), out=(S(0),))
    c.check("split([3,4], 1) S2", lambda t: t.split([3, 4], 1), D(x, S(2)), out=(S(2),))
    c.check("split(10, 0) S0 (one piece)", lambda t: t.split(10), D(x, S(0)), out=(S(0),))
    c.check("split([6], 0) S0 (one piece)", lambda t: torch.split(t, [6]), D(x, S(0)), out=(S(0),))
    c.check("split P", lambda t: t.split(3, 1), D(x, P), out=(P,))
    c.check("chunk(3, 1) S0", lambda t: t.chunk(3, 1), D(x, S(0)), out=(S(0),))
    c.check("chunk(2) S0", lambda t: torch.chunk(t, 2), D(x, S(0)), out=(R,))
    c.check("chunk(1, 0) S0", lambda t: t.chunk(1, 0), D(x, S(0)), out=(S(0),))
    c.check("chunk(2, -1) S1", lambda t: t.chunk(2, -1), D(x, S(1)), out=(S(1),))
    c.check("unbind(1) S0", lambda t: t.unbind(1), D(x, S(0)), out=(S(0),))
    c.check("unbind(0) S2", lambda t: torch.unbind(t, 0), D(x, S(2)), out=(S(1),))
    c.check("unbind(0) S0", lambda t: t.unbind(0), D(x, S(0)), out=(R,))
    c.check("unbind P", lambda t: t.unbind(2), D(x, P), out=(P,))
    c.check("narrow(1, 2, 3) S0", lambda t: t.narrow(1, 2, 3), D(x, S(0)), out=(S(0),))
    c.check("narrow(0, 0, 6) S0 whole", lambda t: torch.narrow(t, 0, 0, 6), D(x, S(0)), out=(S(0),))
    c.check("narrow(0, 1, 3) S0", lambda t: t.narrow(0, 1, 3), D(x, S(0)), out=(R,))
    c.check("narrow(-1, -3, 2) S1", lambda t: t.narrow(-1, -3, 2), D(x, S(1)), out=(S(1),))
    c.check("x[1] S1", lambda t: t[1], D(x, S(1)), out=(S(0),))
    c.check("x[1] S0", lambda t: t[1], D(x, S(0)), out=(R,))
    c.check("x[:, 2:5] S0", lambda t: t[:, 2:5], D(x, S(0)), out=(S(0),))
    c.check("x[:, 2:5] S1", lambda t: t[:, 2:5], D(x, S(1)), out=(R,))
    c.check("x[..., 1] S1", lambda t: t[..., 1], D(x, S(1)), out=(S(1),))
    c.check("x[None, :, 0] S2", lambda t: t[None, :, 0], D(x, S(2)), out=(S(2),))
    c.check("x[None, :, 0] S0", lambda t: t[None, :, 0], D(x, S(0)), out=(S(1),))
    c.check("x[:, None, ::2] S0", lambda t: t[:, None, ::2], D(x, S(0)), out=(S(0),))
    c.check("x[:, ::2] S1", lambda t: t[:, ::2], D(x, S(1)), out=(R,))
    c.check("x[1:4] S0", lambda t: t[1:4], D(x, S(0)), out=(R,))
    c.check("x[-6:] S0 whole", lambda t: t[-6:], D(x, S(0)), out=(S(0),))
    c.check("x[0:100, ..., -1] S0", lambda t: t[0:100, ..., -1], D(x, S(0)), out=(S(0),))
    c.check("x[2, -1] S2", lambda t: t[2, -1], D(x, S(2)), out=(S(0),))
    c.check("x[1, :, 3] P", lambda t: t[1, :, 3], D(x, P), out=(P,))
    c.check("x[Ellipsis] S1", lambda t: t[...], D(x, S(1)), out=(S(1),))


def _concat_checks(c):
    import torch
    from hyper_parallel import Partial, Replicate, Shard
    S, R, P = Shard, Replicate(), Partial()
    a, b = c.randn("cat_a", 4, 5), c.randn("cat_b", 3, 5)
    a2, b2 = c.randn("cat_a2", 4, 3), c.randn("cat_b2", 4, 5)
    c.check("cat dim0 S0,S0", lambda u, v: torch.cat([u, v]), D(a, S(0)), D(b, S(0)), out=(R,))
    c.check("cat dim0 S1,S1", lambda u, v: torch.cat([u, v], 0), D(a, S(1)), D(b, S(1)), out=(S(1),))
    c.check("cat dim0 S1,R", lambda u, v: torch.cat((u, v), dim=0), D(a, S(1)), D(b, R), out=(S(1),))
    c.check("cat dim1 S0,S0", lambda u, v: torch.cat([u, v], 1), D(a2, S(0)), D(b2, S(0)), out=(S(0),))
    c.check("cat dim1 S0,S1", lambda u, v: torch.cat([u, v], -1), D(a2, S(0)), D(b2, S(1)), out=(S(0),))
    c.check("cat dim0 S1,plain", lambda u: torch.cat([u, b]), D(a, S(1)), out=(S(1),))
    c.check("cat P,P", lambda u, v: torch.cat([u, v]), D(a, P), D(b, P), out=(P,))
    c.check("cat P,R", lambda u, v: torch.cat([u, v]), D(a, P), D(b, R), out=(P,))
    c.check("cat P,S1", lambda u, v: torch.cat([u, v]), D(a, P), D(b, S(1)), out=(S(1),))
    c.check("concat alias", lambda u, v: torch.concat([u, v], dim=1), D(a2, S(0)), D(b2, R), out=(S(0),))
    c.check("concatenate axis", lambda u, v: torch.concatenate([u, v], axis=0), D(a, S(1)), D(b, S(1)),
            out=(S(1),))
    x3, y3 = c.randn("cat3", 4, 6, 2), c.randn("cat3b", 4, 6, 3)
    c.check("cat dim2 S0 vs S1 (bigger wins)", lambda u, v: torch.cat([u, v], 2), D(x3, S(0)), D(y3, S(1)),
            out=(S(1),))
    c.check("cat same tensor twice", lambda u: torch.cat([u, u * 2, u], 1), D(a, S(0)), out=(S(0),))
    c.check("stack dim0 S0,S0", lambda u, v: torch.stack([u, v]), D(a, S(0)), D(a * 3, S(0)), out=(S(1),))
    c.check("stack dim1 S0,S1", lambda u, v: torch.stack([u, v], 1), D(a, S(0)), D(a + 1, S(1)))
    c.check("stack dim1 S0,S0", lambda u, v: torch.stack([u, v], 1), D(a, S(0)), D(a + 1, S(0)), out=(S(0),))
    c.check("stack dim-1 S1,R", lambda u, v: torch.stack([u, v], -1), D(a, S(1)), D(a - 1, R), out=(S(1),))
    c.check("stack dim1 S1,S1", lambda u, v: torch.stack((u, v), dim=1), D(a, S(1)), D(a, S(1)), out=(S(2),))
    c.check("stack P,P", lambda u, v: torch.stack([u, v]), D(a, P), D(a, P), out=(P,))


# ================================================================================ run_dist cases
def _run_1d(rank, world_size, families):
    c = Checks(_mesh((world_size,)))
    for family in families:
        _FAMILIES[family](c)
    return c.count, c.failures


def _stats_case(rank, world_size):
    from hyper_parallel import Partial, Replicate, Shard
    import torch
    c = Checks(_mesh((world_size,)))
    torch.manual_seed(1000 + rank)  # independent masks for the shards (see dropout.py)
    _dropout_statistics(c, (Shard(0),), "dropout p>0 S0")
    _dropout_statistics(c, (Shard(1),), "dropout p>0 S1")
    # replicated outputs with identically seeded ranks: the replicas agree
    torch.manual_seed(7)
    _dropout_statistics(c, (Partial(),), "dropout p>0 P -> R")
    x = c.make(torch.ones(16, 8), (Replicate(),), "dropout R")
    y = torch.nn.functional.dropout(x, 0.5)
    local = y.to_local().detach()
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, local.contiguous())
    if not all(torch.equal(g, gathered[0]) for g in gathered):
        c.failures.append("[dropout R] replicas differ although every rank was seeded alike")
    return c.count, c.failures


def _run_2d(rank, world_size):
    import torch
    import torch.nn.functional as F
    from hyper_parallel import Partial, Replicate, Shard
    S, R, P = Shard, Replicate(), Partial()
    c = Checks(_mesh((2, 2)))
    a, b = c.randn("2d_a", 6, 9), c.randn("2d_b", 9, 5)
    c.check("2d mm (S0,S1)@(R,S0)", torch.mm, D(a, S(0), S(1)), D(b, R, S(0)), out=(S(0), P))
    c.check("2d mm (S1,R)@(S0,S1)", torch.mm, D(a, S(1), R), D(b, S(0), S(1)), out=(P, S(1)))
    c.check("2d mm (S0,S0)@(R,R)", torch.mm, D(a, S(0), S(0)), D(b, R, R), out=(S(0), S(0)))
    c.check("2d add (S0,P)+(R,P)", lambda u, v: u + v, D(a, S(0), P), D(a * 2, R, P), out=(S(0), P))
    x = c.randn("2d_x", 5, 6, 7)
    c.check("2d sum(0) (S0,S1)", lambda t: t.sum(0), D(x, S(0), S(1)), out=(P, S(0)))
    c.check("2d mean() (S0,S2)", lambda t: t.mean(), D(x, S(0), S(2)), out=(P, P))
    c.check("2d mean(1) (S1,S1)", lambda t: t.mean(1), D(x, S(1), S(1)), out=(P, P))
    c.check("2d amax(2) (S2,S2)", lambda t: t.amax(2), D(x, S(2), S(2)), out=(R, R))
    c.check("2d amax(1) (S0,S2)", lambda t: t.amax(2), D(x, S(0), S(2)), out=(S(0), R))
    c.check("2d sum(2) (P,S2)", lambda t: t.sum(2), D(x, P, S(2)), out=(P, P))
    c.check("2d layer_norm (S0,S2)", lambda t: F.layer_norm(t, (7,)), D(x, S(0), S(2)), out=(S(0), R))
    c.check("2d softmax (S1,S0)", lambda t: t.softmax(0), D(x, S(1), S(0)), out=(S(1), R))
    c.check("2d getitem (S0,S1)", lambda t: t[:, 1:4, 2], D(x, S(0), S(1)), out=(S(0), R))
    c.check("2d cat (S0,S1),(S0,R)", lambda u, v: torch.cat([u, v], 2), D(x, S(0), S(1)), D(x, S(0), R),
            out=(S(0), S(1)))
    c.check("2d stack (S2,P)", lambda u, v: torch.stack([u, v], 1), D(x, S(2), P), D(x, S(2), P),
            out=(S(3), P))
    c.check("2d view (S0,S1)", lambda t: t.reshape(5, 42), D(x, S(0), S(1)))
    c.check("2d transpose (S0,S1)", lambda t: t.transpose(0, 1), D(x, S(0), S(1)), out=(S(1), S(0)))
    ids = torch.randint(0, 11, (3, 4), generator=c.gen("2d_ids"))
    w = c.randn("2d_w", 11, 6)
    c.check("2d embedding w (S0,S1)", F.embedding, D(ids, R, R), D(w, S(0), S(1)), out=(P, S(2)))
    c.check("2d embedding w (S0,S0)", F.embedding, D(ids, S(0), R), D(w, S(0), S(0)), out=(P, P))
    c.check("2d embedding w (R,S0) ids (S1,R)", F.embedding, D(ids, S(1), R), D(w, R, S(0)), out=(S(1), P))
    q = c.randn("2d_q", 2, 4, 6, 4)
    k, v = c.randn("2d_k", 2, 4, 6, 4), c.randn("2d_v", 2, 4, 6, 4)
    c.check("2d sdpa (S0,S1)", lambda qq, kk, vv: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True),
            D(q, S(0), S(1)), D(k, S(0), S(1)), D(v, S(0), S(1)), out=(S(0), S(1)))
    c.check("2d sdpa q (S1,S2) kv (S1,R)",
            lambda qq, kk, vv: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True),
            D(q, S(1), S(2)), D(k, S(1), R), D(v, S(1), R), out=(S(1), S(2)))
    return c.count, c.failures


def _fallback_case(rank, world_size):
    """Strict dispatch raises naming the op; without it the fallback warns once and is correct."""
    import torch
    from hyper_parallel import Replicate, Shard
    from hyper_parallel.core.dtensor.dispatch import fallback
    c = Checks(_mesh((world_size,)))
    x = c.randn("fallback", 6, 5)
    failures = []
    old = os.environ.get("HP_STRICT_DISPATCH")
    os.environ["HP_STRICT_DISPATCH"] = "1"
    try:
        # ops without a sharding rule (roll, cumprod and tril, the examples before, have rules now)
        for label, fn, word in (("torch.trace", lambda t: torch.trace(t), "trace"),
                                ("torch.linalg.pinv", lambda t: torch.linalg.pinv(t), "pinv"),
                                ("torch.block_diag", lambda t: torch.block_diag(t), "block_diag")):
            dt = c.make(x, (Shard(0),), label)
            try:
                fn(dt)
                failures.append(f"[strict {label}] no error raised")
            except NotImplementedError as exc:
                if word not in str(exc):
                    failures.append(f"[strict {label}] the message does not name {word!r}: {exc}")
        # ops with a rule still work in strict mode
        c.check("strict: ruled op works", lambda t: (t * 2).sum(0), D(x, Shard(0)))
    finally:
        if old is None:
            del os.environ["HP_STRICT_DISPATCH"]
        else:
            os.environ["HP_STRICT_DISPATCH"] = old

    for name in [n for n in fallback._warned if "trace" in n]:
        fallback._warned.discard(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c.check("fallback trace", lambda t: torch.trace(t), D(x, Shard(0)), out=(Replicate(),))
        c.check("fallback trace again", lambda t: torch.trace(t * 2), D(x, Shard(1)), out=(Replicate(),))
    flip_warnings = [w for w in caught if "trace" in str(w.message)]
    if len(flip_warnings) != 1:
        failures.append(f"[warn once] {len(flip_warnings)} warnings naming trace, expected 1: "
                        f"{[str(w.message) for w in caught]}")
    c.check("fallback advanced indexing", lambda t: t[[0, 2, 5]], D(x, Shard(0)), out=(Replicate(),))
    return c.count + 4, failures + c.failures


def _doc_rule_source():
    """The ``cumsum`` rule of docs/dtensor.md's worked example (its python code block)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "dtensor.md")
    with open(path) as f:
        blocks = [b.split("\n", 1)[1] for b in f.read().split("```python")[1:]]  # after the fence line
    sources = [b.split("```")[0] for b in blocks if '@register_rule("cumsum")' in b]
    assert len(sources) == 1, "docs/dtensor.md: no single code block registers the cumsum rule"
    return sources[0]


def _doc_example_case(rank, world_size, source):
    """Runs the worked example of docs/dtensor.md (ops/scan.py's rule, written out), then puts the
    registered rule back (the pool is reused)."""
    import torch
    from hyper_parallel import Partial, Replicate, Shard
    from hyper_parallel.core.dtensor.ops import registry
    from hyper_parallel.platform.torch import dtensor_base
    c = Checks(_mesh((world_size,)))
    funcs = (torch.cumsum, torch.Tensor.cumsum)
    saved_names = {f: dtensor_base.OP_NAMES.get(f) for f in funcs}
    saved_rule = registry._RULES.pop("cumsum", None)
    try:
        for f in funcs:
            dtensor_base.OP_NAMES[f] = "cumsum"
        exec(compile(source, "docs/dtensor.md", "exec"), {"__name__": "doc_example"})
        x = c.randn("cumsum", 6, 5)  # 6 rows on 4 ranks: 2, 2, 2, 0
        c.check("cumsum(0) S0", lambda t: torch.cumsum(t, 0), D(x, Shard(0)), out=(Shard(0),))
        c.check("cumsum(1) S0", lambda t: t.cumsum(1), D(x, Shard(0)), out=(Shard(0),))
        c.check("cumsum(0) P", lambda t: t.cumsum(0), D(x, Partial()), out=(Partial(),))
        c.check("cumsum(-1) S1", lambda t: t.cumsum(-1), D(x, Shard(1)), out=(Shard(1),))
        c.check("cumsum(0) P(max)", lambda t: t.cumsum(0), D(x, Partial("max")), out=(Replicate(),))
    finally:
        registry._RULES.pop("cumsum", None)
        if saved_rule is not None:
            registry._RULES["cumsum"] = saved_rule
        for f, name in saved_names.items():
            if name is None:
                dtensor_base.OP_NAMES.pop(f, None)
            else:
                dtensor_base.OP_NAMES[f] = name
    return c.count, c.failures


_FAMILIES = {
    "elementwise": _elementwise_checks,
    "matmul": _matmul_checks,
    "view": _view_checks,
    "softmax_sdpa": _softmax_sdpa_checks,
    "embedding": _embedding_checks,
    "norm_dropout": _norm_dropout_checks,
    "reductions": _reduction_checks,
    "slicing": _slicing_checks,
    "concat": _concat_checks,
}


# ================================================================================ tests
def _assert_clean(results, min_checks):
    failures = [f"rank {r}: {f}" for r, (_, fs) in enumerate(results) for f in fs]
    assert not failures, f"{len(failures)} failing check(s):\n" + "\n".join(failures[:12])
    counts = [n for n, _ in results]
    assert all(n >= min_checks for n in counts), f"ran only {counts} checks"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_existing_rules(world_size):
    """elementwise, matmul family, views / permutations, softmax and sdpa."""
    results = run_dist(world_size, _run_1d, ["elementwise", "matmul", "view", "softmax_sdpa"], timeout=240)
    _assert_clean(results, 120)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_new_rules(world_size):
    """embedding, norms, dropout, reductions, split / chunk / unbind / narrow / indexing, cat / stack."""
    results = run_dist(world_size, _run_1d,
                       ["embedding", "norm_dropout", "reductions", "slicing", "concat"], timeout=240)
    _assert_clean(results, 140)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dropout_statistics(world_size):
    _assert_clean(run_dist(world_size, _stats_case), 3)


def test_mesh_2x2():
    _assert_clean(run_dist(4, _run_2d, timeout=240), 20)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_docs_worked_example(world_size):
    """The "How to add a sharding rule" example of docs/dtensor.md works as written."""
    _assert_clean(run_dist(world_size, _doc_example_case, _doc_rule_source()), 5)


def test_strict_dispatch_and_warn_once():
    _assert_clean(run_dist(2, _fallback_case), 5)
