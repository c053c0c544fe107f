"""MindSpore paths that could read a DTensor's own data (a placeholder) instead of its shard
(tests/mindspore/test_placeholder_reads.py; SPEC §19, issue 36 item 7): ``ms.Tensor(dt)``,
``Parameter.set_data(dt)``, ``assign_value``, ``ms.grad`` with respect to a DTensor, and every op that
takes a list / tuple of tensors with DTensors among them (old-style primitives such as ``ops.stack`` and
``ops.addn`` did not look inside the sequence). Each path gives what one process gives on the full
tensors, or raises an error naming the fix -- never the placeholder's (empty) value.

Imported by MindSpore workers only (no torch, no pytest); results are plain Python values.
"""
import copy

import numpy as np

from tests.frameworks import inp

ROWS, COLS = 4, 3
# path -> the fragment its error must contain
RAISES = {
    "ms.Tensor(dt)": "ms.Tensor(dtensor)", "ms.tensor(dt)": "ms.Tensor(dtensor)",
    "ms.Tensor(input_data=dt)": "ms.Tensor(dtensor)", "ms.Tensor(dt, float16)": "ms.Tensor(dtensor)",
    "param.set_data(dt)": "param.set_data(dtensor)", "param.assign_value(dt)": "param.set_data(dtensor)",
    "ops.assign(param, dt)": "in-place MindSpore operator Assign",
    "ms.grad wrt dt": "with respect to a DTensor argument",
    "ms.value_and_grad wrt dt": "with respect to a DTensor argument",
    "plain.copy_(dt)": "x.copy_(d)", "dt.register_hook": "local.register_hook(fn)",
    "dt.set_dtype": "dt.astype(dtype)", "ms.COOTensor(values=dt)": "a sparse tensor's values",
    "plain[0] = dt[0]": "a plain tensor cannot hold a distributed value",
    "plain[dt index] = 1": "a plain tensor cannot hold a distributed value",
}


def _values(w, x, whole, other, index):
    """path -> (function, numpy reference) for the paths that compute (``index``: a sharded DTensor
    holding [1, 0, 3, 2])."""
    import mindspore as ms
    import mindspore.numpy as mnp
    from mindspore import mint, ops
    plain = ms.Tensor(other)
    a, b = whole, other
    return {
        "ops.stack": (lambda: ops.stack([w, w]), np.stack([a, a])),
        "ops.stack axis 1": (lambda: ops.stack([w, x], 1), np.stack([a, a], 1)),
        "ops.stack axis -1 mixed": (lambda: ops.stack([plain, w], -1), np.stack([b, a], -1)),
        "ops.Stack(1)": (lambda: ops.Stack(1)((x, w)), np.stack([a, a], 1)),
        "ops.addn": (lambda: ops.addn([w, w, x]), 3 * a),
        "ops.AddN mixed": (lambda: ops.AddN()((plain, w)), a + b),
        "ops.concat": (lambda: ops.concat([w, x]), np.concatenate([a, a])),
        "ops.Concat(1) mixed": (lambda: ops.Concat(1)([w, plain]), np.concatenate([a, b], 1)),
        "ops.cat": (lambda: ops.cat((plain, w)), np.concatenate([b, a])),
        "mint.cat": (lambda: mint.cat([w, plain], 1), np.concatenate([a, b], 1)),
        "ops.hstack": (lambda: ops.hstack([w, w]), np.hstack([a, a])),
        "ops.vstack": (lambda: ops.vstack([w, plain]), np.vstack([a, b])),
        "ops.dstack": (lambda: ops.dstack([w, x]), np.dstack([a, a])),
        "ops.column_stack": (lambda: ops.column_stack([w, w]), np.column_stack([a, a])),
        "ops.meshgrid": (lambda: ops.meshgrid(w[:, 0], w[0]), np.meshgrid(a[:, 0], a[0])),
        "ops.block_diag": (lambda: ops.block_diag(w, x), _block_diag(a, a)),
        "ops.cartesian_prod": (lambda: ops.cartesian_prod(w[:, 0], w[1]), _cartesian(a[:, 0], a[1])),
        "ops.atleast_2d list": (lambda: ops.atleast_2d([w, w[0]]), [a, a[0:1]]),
        "ops.clip_by_global_norm": (lambda: ops.clip_by_global_norm([w, plain], 1.0),
                                    _clip_global([a, b], 1.0)),
        "mnp.stack": (lambda: mnp.stack([w, w]), np.stack([a, a])),
        "mnp.concatenate": (lambda: mnp.concatenate([w, plain]), np.concatenate([a, b])),
        "mnp.hstack": (lambda: mnp.hstack([w, x]), np.hstack([a, a])),
        "mnp.vstack": (lambda: mnp.vstack((w, w)), np.vstack([a, a])),
        "mnp.dstack": (lambda: mnp.dstack((w, plain)), np.dstack([a, b])),
        "mnp.column_stack": (lambda: mnp.column_stack((w, w)), np.column_stack([a, a])),
        "mnp.array": (lambda: mnp.array(w), a),
        "mnp.asarray": (lambda: mnp.asarray(w), a),
        "sum([dt, dt])": (lambda: sum([w, x]), 2 * a),
        "copy.copy": (lambda: copy.copy(w), a),
        "copy.deepcopy": (lambda: copy.deepcopy(w), a),
        "ops.depend": (lambda: ops.depend(plain, w), b),
        "plain[(dt index, 1)]": (lambda: plain[index, 1], b[:, 1][[1, 0, 3, 2]]),
        "plain[[dt index]]": (lambda: plain[[index]], b[[1, 0, 3, 2]]),
        "plain[dt index]": (lambda: plain[index], b[[1, 0, 3, 2]]),
    }


def _raising(ms, w, index):
    from mindspore import ops
    plain = ms.Tensor(np.zeros((ROWS, COLS), np.float32))
    param = ms.Parameter(ms.Tensor(np.zeros((ROWS, COLS), np.float32)), name="p")

    def fresh():
        return ms.Parameter(ms.Tensor(np.zeros((ROWS, COLS), np.float32)), name="q")
    return {
        "ms.Tensor(dt)": lambda: ms.Tensor(w), "ms.tensor(dt)": lambda: ms.tensor(w),
        "ms.Tensor(input_data=dt)": lambda: ms.Tensor(input_data=w),
        "ms.Tensor(dt, float16)": lambda: ms.Tensor(w, ms.float16),
        "param.set_data(dt)": lambda: fresh().set_data(w),
        "param.assign_value(dt)": lambda: fresh().assign_value(w),
        "ops.assign(param, dt)": lambda: ops.assign(param, w),
        "ms.grad wrt dt": lambda: ms.grad(lambda t: (t * t).sum())(w),
        "ms.value_and_grad wrt dt": lambda: ms.value_and_grad(lambda t: (t * 2).sum())(w),
        "plain.copy_(dt)": lambda: ms.Tensor(np.zeros((ROWS, COLS), np.float32)).copy_(w),
        "dt.register_hook": lambda: (w * 2).register_hook(lambda g: g),
        "dt.set_dtype": lambda: w.set_dtype(ms.float16),
        "ms.COOTensor(values=dt)": lambda: ms.COOTensor(ms.Tensor([[0, 1]], ms.int32), w[0, 0:1], (2, 2)),
        "plain[0] = dt[0]": lambda: plain.__setitem__(0, w[0]),
        "plain[dt index] = 1": lambda: plain.__setitem__(index, 1.0),
    }


def _block_diag(a, b):
    out = np.zeros((a.shape[0] + b.shape[0], a.shape[1] + b.shape[1]), a.dtype)
    out[:a.shape[0], :a.shape[1]], out[a.shape[0]:, a.shape[1]:] = a, b
    return out


def _cartesian(a, b):
    return np.stack(np.meshgrid(a, b, indexing="ij"), -1).reshape(-1, 2)


def _clip_global(xs, clip):
    norm = np.sqrt(sum((x.astype(np.float64) ** 2).sum() for x in xs))
    return [x * clip / max(norm, clip) for x in xs]


def _outcome(fn, want):
    """'right', 'wrong: ...' or 'raised: <type>: <message>'."""
    from hyper_parallel import DTensor
    try:
        got = fn()
    except Exception as exc:   # noqa: BLE001 -- the outcome is the report
        return f"raised: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    got = list(got) if isinstance(got, (list, tuple)) else [got]
    want = list(want) if isinstance(want, list) or (isinstance(want, tuple)) else [want]
    if len(got) != len(want):
        return f"wrong: {len(got)} outputs, expected {len(want)}"
    for g, e in zip(got, want):
        g = g.full_tensor() if isinstance(g, DTensor) else g
        g = g.asnumpy()
        if g.shape != np.shape(e) or not np.allclose(g, e, atol=1e-5):
            return f"wrong: shape {g.shape} (expected {np.shape(e)}) values {g.ravel()[:6].tolist()}"
    return "right"


def placeholder_reads(rank, world_size):
    """{path: outcome} for a row-sharded and a replicated DTensor of the same full value."""
    import mindspore as ms
    from hyper_parallel import DTensor, Replicate, Shard, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    whole, other = inp("ph-reads", 0, (ROWS, COLS)), inp("ph-reads-other", 0, (ROWS, COLS))
    rows = ROWS // world_size
    w = DTensor.from_local(ms.Tensor(whole[rows * rank:rows * (rank + 1)]), mesh, [Shard(0)])
    x = DTensor.from_local(ms.Tensor(whole), mesh, [Replicate()])
    order = np.array([1, 0, 3, 2], np.int64)
    index = DTensor.from_local(ms.Tensor(order[rows * rank:rows * (rank + 1)]), mesh, [Shard(0)])
    out = {name: _outcome(fn, want) for name, (fn, want) in _values(w, x, whole, other, index).items()}
    for name, fn in _raising(ms, w, index).items():
        out[name] = _outcome(fn, None)
    return out
