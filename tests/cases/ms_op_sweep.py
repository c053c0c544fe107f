"""The MindSpore operator surface on DTensors against MindSpore in one process.

Every operator below runs on DTensors in several placements per input, on a 1-D mesh and a 2x2
mesh, and must give single-process MindSpore's result -- values with NaN/inf at the same places,
dtype, global shape, and the gradient of every floating input through a scalar DTensor loss
returned to ``ms.grad`` -- or raise a clear error (NotImplementedError, ValueError, TypeError,
IndexError) on every rank. Each operator is reported as ``rule`` (planned by a sharding rule),
``fallback`` (replicated fallback, warned) or ``error``; a mismatch is a failure.

Imported by MindSpore workers only (no torch, no pytest).
"""
import warnings

import numpy as np

from tests.cases.dtensor import GRAD_TOL, _placements, grad_piece, local_piece
from tests.frameworks import current, inp, t

CLEAR_ERRORS = (NotImplementedError, ValueError, TypeError, IndexError)
# operators that fail on DTensors inside MindSpore itself (documented in docs/mindspore.md): any
# error counts as the expected one for them, never a wrong value
KNOWN_ERRORS = {
    "stack": "old-style primitive taking a tuple: MindSpore does not dispatch DTensors inside it",
    "layer_norm": "the legacy LayerNorm primitive's backward fails when run by the replicated fallback",
}
# casting down on a Partial value rounds each summand (as PyTorch DTensor does): fp16 tolerance
TOLERANCE = {"float16 round trip": {"atol": 2e-3, "rtol": 2e-3}}
NAN_INF = {(1, 2): np.nan, (0, 1): np.inf, (3, 0): -np.inf}


def _nan_input(shape, tag):
    x = inp(tag, 0, shape)
    for pos, value in NAN_INF.items():
        if len(pos) <= x.ndim and all(p < s for p, s in zip(pos, x.shape)):
            x[pos] = value
    return x


def op_table():
    """(name, fn, input specs): an input spec is a shape (float32 normal), ("nan", shape) (normal
    with NaN/+inf/-inf), ("ids", shape, high) (int32 in [0, high)) or ("labels", shape, high)."""
    import mindspore as ms
    from mindspore import mint, ops
    mf = mint.nn.functional
    m46, m6 = (4, 6), (6,)
    nan = ("nan", m46)
    return [
        # elementwise (broadcasting, scalars, NaN-producing, bool and integer-valued results)
        ("add/sub broadcast", lambda a, b: a + b - b * 0.5, [m46, m6]),
        ("mul/div", lambda a, b: a * b / (b * b + 1.0), [m46, m46]),
        ("neg/exp/tanh", lambda a: -ops.exp(a) + ops.tanh(a), [m46]),
        ("log/sqrt (NaN for x<0)", lambda a: ops.log(a) + ops.sqrt(a), [m46]),
        ("sigmoid/relu/gelu/silu", lambda a: ops.sigmoid(a) + ops.relu(a) + ops.gelu(a) + ops.silu(a), [m46]),
        ("abs/pow/clamp", lambda a: ops.abs(a) + ops.pow(a, 2) + ops.clamp(a, -0.5, 0.5), [m46]),
        ("maximum/minimum NaN", lambda a, b: ops.maximum(a, b) + ops.minimum(a, b), [nan, m46]),
        ("where/masked_fill", lambda a, b: ops.where(a > 0, a, b).masked_fill(b < -1.0, 0.0), [m46, m46]),
        ("compare (bool)", lambda a, b: a > b, [m46, m46]),
        ("isnan/nan_to_num", lambda a: ops.nan_to_num(a, 0.0, 9.0, -9.0) + ops.isnan(a).astype(ms.float32),
         [nan]),
        ("floor/cast", lambda a: ops.floor(a * 3).astype(ms.int32), [m46]),
        ("float16 round trip", lambda a: a.astype(ms.float16).astype(ms.float32), [m46]),
        # matmul
        ("matmul", lambda a, b: ops.matmul(a, b), [m46, (6, 4)]),
        ("@ 3-D", lambda a, b: a @ b, [(2, 4, 6), (6, 2)]),
        ("bmm", lambda a, b: ops.bmm(a, b), [(2, 4, 6), (2, 6, 2)]),
        ("linear", lambda x, w, b: mf.linear(x, w, b), [m46, (2, 6), (2,)]),
        # reductions, NaN and inf included
        ("sum all/dim", lambda a: a.sum() + a.sum(1).sum(), [m46]),
        ("mean dim keepdim", lambda a: a.mean(0, keep_dims=True), [m46]),
        ("sum NaN", lambda a: a.sum(1), [nan]),
        ("amax/amin NaN", lambda a: a.amax(1) + a.amin(0).sum(), [nan]),
        ("amax/amin", lambda a: a.amax(1) + a.amin(0).sum(), [m46]),
        ("max/min all NaN", lambda a: a.max() + a.min(), [nan]),
        ("max/min all", lambda a: a.max() + a.min(), [m46]),
        ("max(dim) values NaN", lambda a: ops.max(a, 1)[0] + ops.min(a, 0)[0].sum(), [nan]),
        ("max(dim) values", lambda a: ops.max(a, 1)[0] + ops.min(a, 0)[0].sum(), [m46]),
        ("argmax", lambda a: ops.argmax(a, 1), [m46]),
        ("logsumexp", lambda a: ops.logsumexp(a, 1), [m46]),
        ("prod", lambda a: ops.prod(a, 1), [m46]),
        ("norm", lambda a: ops.norm(a) + ops.norm(a, 2, 1).sum(), [m46]),
        ("var/std", lambda a: a.var(1) + a.std(0).sum(), [m46]),
        ("cumsum", lambda a: ops.cumsum(a, 1), [m46]),
        # views
        ("reshape/view", lambda a: a.reshape(2, 2, 6).view(4, 6).reshape((24,)), [m46]),
        ("flatten/unsqueeze/squeeze", lambda a: a.flatten().unsqueeze(0).squeeze(0), [(4, 2, 3)]),
        ("swapaxes/permute/transpose", lambda a: ops.transpose(a.swapaxes(0, 1).permute(1, 0), (1, 0)), [m46]),
        ("broadcast_to", lambda a: ops.broadcast_to(a.unsqueeze(0), (2, 4, 6)), [m46]),
        # slicing
        ("getitem", lambda a: a[1:3, ::2] * 2 + a[0:2][:, 0:3], [m46]),
        ("getitem int/ellipsis", lambda a: a[..., 2] + a[1], [(4, 4)]),
        ("narrow/split/chunk", lambda a: a.narrow(1, 1, 2) + ops.split(a, 2, 1)[1] + ops.chunk(a, 3, 1)[0], [m46]),
        ("flip", lambda a: ops.flip(a, (1,)), [m46]),
        ("tril/triu", lambda a: ops.tril(a) + ops.triu(a, 1), [m46]),
        ("sort/topk", lambda a: ops.sort(a, 1)[0][:, :2] + ops.topk(a, 2, 1)[0], [m46]),
        # concatenation
        ("cat", lambda a, b: ops.cat((a, b), 0) + 1.0, [m46, m46]),
        ("mint.cat", lambda a, b: mint.cat((a, b), 1), [m46, m46]),
        ("stack", lambda a, b: ops.stack((a, b), 0), [m46, m46]),
        ("tile/repeat_interleave", lambda a: ops.tile(a, (1, 2)) + a.repeat_interleave(2, 1), [m46]),
        # softmax and normalisation
        ("softmax/log_softmax", lambda a: ops.softmax(a, -1) + ops.log_softmax(a, 0), [m46]),
        ("mint softmax", lambda a: mf.softmax(a, dim=1), [m46]),
        ("layer_norm", lambda a, w, b: ops.LayerNorm(-1, -1)(a, w, b)[0], [m46, m6, m6]),
        # embedding, gathers, losses
        ("embedding gather", lambda ids, tab: ops.gather(tab, ids, 0), [("ids", (2, 4), 4), m46]),
        ("gather axis 1", lambda a, ids: ops.gather(a, ids, 1), [m46, ("ids", (3,), 6)]),
        ("gather_elements", lambda a, ids: ops.gather_elements(a, 1, ids), [m46, ("ids", (4, 2), 6)]),
        ("cross_entropy", lambda a, y: ops.cross_entropy(a, y), [m46, ("labels", (4,), 6)]),
        ("dropout p=0", lambda a: ops.dropout(a, p=0.0), [m46]),
    ]


# the sample run on a 1-D mesh of 4 with uneven / empty pieces (sweep(uneven=True)): rules that
# reduce, contract, view, slice or concatenate a piece, and a few fallbacks (gathering empty pieces)
UNEVEN_SAMPLE = ("add/sub broadcast", "mul/div", "maximum/minimum NaN", "where/masked_fill", "matmul", "@ 3-D",
                 "bmm", "linear", "sum all/dim", "mean dim keepdim", "sum NaN", "amax/amin", "max/min all",
                 "max(dim) values", "argmax", "norm", "prod", "reshape/view", "swapaxes/permute/transpose",
                 "getitem", "narrow/split/chunk", "cat", "mint.cat", "softmax/log_softmax", "embedding gather",
                 "cross_entropy")


def _inputs(specs, name):
    xs = []
    for i, spec in enumerate(specs):
        if spec and spec[0] == "nan":
            xs.append(_nan_input(spec[1], f"sw{name}{i}"))
        elif spec and spec[0] in ("ids", "labels"):
            gen = np.random.RandomState(len(name) + i)
            xs.append(gen.randint(0, spec[2], spec[1]).astype(np.int32))
        else:
            xs.append(inp(f"sw{name}{i}", 0, spec))
    return xs


def _choices(x, mesh_ndim, uneven_over=None):
    """Placements to try for input ``x``: every Shard dim, Replicate and Partial (floats) on a 1-D
    mesh; two mixed pairs on a 2-D mesh. With ``uneven_over=n`` (a 1-D mesh of n ranks, sampled):
    only the Shard dims that n does not divide -- torch.chunk-style uneven pieces, the last ones
    EMPTY for the sweep's shapes on 4 ranks (6 -> 2, 2, 2, 0; 2 -> 1, 1, 0, 0) -- or Shard(0) when
    every dim divides."""
    shards = [f"S{d}" for d in range(x.ndim)]
    partial = ["P"] if x.dtype == np.float32 else []
    if uneven_over:
        uneven = [f"S{d}" for d in range(x.ndim) if x.shape[d] % uneven_over]
        return [[p] for p in (uneven or shards[:1] or ["R"])]
    if mesh_ndim == 1:
        return [[p] for p in shards + ["R"] + partial]
    # sampled (world 4 is slow on a small machine): a shard on each mesh dim, and Partial
    last = shards[-1] if shards else "R"
    return [[shards[0] if shards else "R", last], ["P" if partial else "R", last]]


def _combos(xs, mesh_ndim, uneven_over=None):
    """Each placement of each input at least once, inputs varied together (not the product)."""
    choices = [_choices(x, mesh_ndim, uneven_over) for x in xs]
    n = max(len(c) for c in choices)
    return [[c[k % len(c)] for c in choices] for k in range(n)]


def _run_op(fn, xs, placements, mesh):
    """The op on DTensors of ``xs``: (output DTensor, gradients of the local float inputs through
    a scalar DTensor loss returned to ms.grad, weights used, used the fallback)."""
    from hyper_parallel import DTensor, Replicate
    from hyper_parallel.core.dtensor.dispatch import fallback
    locals_ = [t(local_piece(x, p, mesh)) for x, p in zip(xs, placements)]

    def dist(*locs):
        return fn(*[DTensor.from_local(loc, mesh, p, shape=x.shape) for loc, p, x in zip(locs, placements, xs)])
    fallback._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = dist(*locals_)
    used_fallback = any("no sharding rule" in str(c.message) for c in caught)
    float_pos = [i for i, x in enumerate(xs) if x.dtype == np.float32]
    grads = None
    if float_pos and "float" in str(out.dtype).lower():
        w = inp("sweepw", 0, tuple(out.shape))
        w_dt = DTensor.from_local(t(w), mesh, [Replicate()] * mesh.ndim)

        def loss(*flocs):
            locs = list(locals_)
            for i, f in zip(float_pos, flocs):
                locs[i] = f
            return (dist(*locs) * w_dt).sum()   # a scalar DTensor returned to ms.grad
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            grads = dict(zip(float_pos, current().grad(loss, *[locals_[i] for i in float_pos])))
        return out, grads, w, used_fallback
    return out, grads, None, used_fallback


def _compare(name, fn, xs, placements, mesh):
    """None when the DTensor result equals the single-process one, else what differs."""
    import mindspore as ms
    fw = current()
    ref = fn(*[t(x) for x in xs])
    out, grads, w, used_fallback = _run_op(fn, xs, placements, mesh)
    full = out.full_tensor()
    if tuple(out.shape) != tuple(ref.shape) or tuple(full.shape) != tuple(ref.shape):
        return used_fallback, f"global shape {tuple(out.shape)} (full {tuple(full.shape)}) != {tuple(ref.shape)}"
    if out.dtype != ref.dtype:
        return used_fallback, f"dtype {out.dtype} != {ref.dtype}"
    tol = TOLERANCE.get(name, GRAD_TOL)
    try:
        np.testing.assert_allclose(fw.numpy(full).astype(np.float64), fw.numpy(ref).astype(np.float64),
                                   equal_nan=True, **tol)
    except AssertionError as exc:
        return used_fallback, f"forward: {exc}"
    if grads is None:
        return used_fallback, None
    float_pos = sorted(grads)
    ref_grads = ms.grad(lambda *a: (fn(*_merge(xs, float_pos, a)) * t(w)).sum(),
                        grad_position=tuple(range(len(float_pos))))(*[t(xs[i]) for i in float_pos])
    ref_grads = ref_grads if isinstance(ref_grads, tuple) else (ref_grads,)
    for i, rg in zip(float_pos, ref_grads):
        expected = grad_piece(fw.numpy(rg), placements[i], mesh)
        try:
            np.testing.assert_allclose(fw.numpy(grads[i]).astype(np.float64), expected.astype(np.float64),
                                       equal_nan=True, **tol)
        except AssertionError as exc:
            return used_fallback, f"gradient of input {i}: {exc}"
    return used_fallback, None


def _merge(xs, float_pos, floats):
    out = [t(x) for x in xs]
    for i, f in zip(float_pos, floats):
        out[i] = f
    return out


def sweep(rank, world_size, mesh_shape, names=None, uneven=False):
    """Every op of :func:`op_table` (or those in ``names``) on the mesh ``mesh_shape``: returns
    ``(rows, failures)``; rows are (op, status, placements tried), failures name op, placements and
    the difference. ``uneven`` (1-D mesh): only placements giving uneven / empty pieces."""
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    rows, failures = [], []
    for name, fn, specs in op_table():
        if (names is not None and name not in names) or (uneven and name not in UNEVEN_SAMPLE):
            continue
        xs = _inputs(specs, name)
        statuses = set()
        uneven_over = mesh_shape[0] if uneven and len(mesh_shape) == 1 else None
        for combo in _combos(xs, mesh.ndim, uneven_over):
            placements = [_placements(c) for c in combo]
            what = f"{name} {['/'.join(c) for c in combo]} on mesh {tuple(mesh_shape)}"
            try:
                used_fallback, problem = _compare(name, fn, xs, placements, mesh)
            except CLEAR_ERRORS as exc:
                statuses.add(f"error ({type(exc).__name__})")
                continue
            except Exception as exc:   # noqa: BLE001  (an unclear error is a failure, reported)
                if name in KNOWN_ERRORS:
                    statuses.add(f"error ({type(exc).__name__}, known)")
                    continue
                failures.append(f"{what}: unclear error {type(exc).__name__}: {exc}"[:600])
                continue
            statuses.add("fallback" if used_fallback else "rule")
            if problem is not None:
                failures.append(f"{what}: {problem}"[:600])
        rows.append((name, " + ".join(sorted(statuses)) or "-"))
    return rows, failures


def core_empty_piece_cases(rank, world_size):
    """Reductions that core's rules compute with a raw ``.sum()`` on the local piece, which
    MindSpore's CPU kernels leave uninitialised when that piece is empty (6 over 4 ranks: 2, 2, 2,
    0): the mean rule's Partial piece (``reductions._mean_local``) and the vocab-parallel
    embedding's empty-table link (``embedding._vocab_parallel_local``). Returns {case: max abs
    error or the error raised}, the same on every rank; memory is filled with 7.0 first so that the
    uninitialised value is visible."""
    import mindspore as ms
    from mindspore import ops
    from hyper_parallel import DTensor, init_device_mesh
    from tests.cases.dtensor import local_piece
    mesh = init_device_mesh("cpu", (world_size,))
    a, table = inp("cepa", 0, (4, 6)), inp("cept", 0, (6, 4))
    ids = np.random.RandomState(0).randint(0, 6, (2, 4)).astype(np.int32)
    cases = {"mean over all, Shard(1)": (lambda x: x.mean(), [a], ["S1"]),
             "mean over dim 1, Shard(1)": (lambda x: x.mean(1), [a], ["S1"]),
             "embedding gather, table Shard(0)": (lambda i, w: ops.gather(w, i, 0), [ids, table], ["R", "S0"])}
    out = {}
    for name, (fn, xs, pls) in cases.items():
        ref = current().numpy(fn(*[t(x) for x in xs]))
        ds = [DTensor.from_local(t(local_piece(x, _placements([p]), mesh)), mesh, _placements([p]), shape=x.shape)
              for x, p in zip(xs, pls)]
        for k in (1, 4, 8, 24):
            (ms.Tensor(np.full((k,), 7.0, np.float32)) * 1.0).asnumpy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                got = current().numpy(fn(*ds).full_tensor())
                out[name] = float(np.abs(got.astype(np.float64) - ref).max())
            except Exception as exc:   # noqa: BLE001  (reported)
                out[name] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def table(rows_by_mesh):
    """The printed table: op -> status on each mesh."""
    meshes = list(rows_by_mesh)
    names = [name for name, _ in rows_by_mesh[meshes[0]]]
    status = {m: dict(rows) for m, rows in rows_by_mesh.items()}
    width = max(len(n) for n in names) + 2
    lines = ["op".ljust(width) + "".join(f"mesh {m}".ljust(22) for m in meshes)]
    for n in names:
        lines.append(n.ljust(width) + "".join(status[m].get(n, "-").ljust(22) for m in meshes))
    return "\n".join(lines)


__all__ = ["op_table", "sweep", "table"]
