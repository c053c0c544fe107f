"""DTensor on any framework: conversions, redistribution and op dispatch, forward and gradients,
against the framework in one process (every rank computes the reference on the global values).

Gradient semantics are PyTorch DTensor's: for a loss on the global value (the same on every rank),
the gradient of a local shard is that shard's piece of the global gradient, and the gradient of a
Replicate or Partial value is the whole global gradient on every rank; ``to_local()`` marks the
gradient of the local value with the DTensor's own placements (a Partial value's local gradient is
a summand).
"""
import itertools

import numpy as np

from tests.frameworks import close, current, expect_error, grad_of, inp, t

GRAD_TOL = {"atol": 1e-4, "rtol": 1e-4}


# ============================================================================ layout helpers
def _placements(spec):
    from hyper_parallel import Partial, Replicate, Shard
    out = []
    for p in spec:
        if p == "R":
            out.append(Replicate())
        elif p == "P":
            out.append(Partial("sum"))
        else:
            out.append(Shard(int(p[1:])))
    return out


def local_piece(array, placements, mesh, partial_share=True):
    """This rank's local value of the global ``array`` laid out as ``placements``: a Partial mesh
    dim splits the value into unequal summands (rank-dependent), so sums are really tested."""
    from hyper_parallel.core.dtensor.layout import local_box
    coord = mesh.get_coordinate()
    box = local_box(array.shape, tuple(placements), tuple(mesh.mesh_shape), coord)
    piece = array[tuple(slice(s, s + n) for s, n in box)]
    if partial_share:
        for m, p in enumerate(placements):
            if p.is_partial():
                size = mesh.size(m)
                weights = np.arange(1, size + 1, dtype=np.float64)
                piece = piece * (weights[coord[m]] / weights.sum())
    return piece.astype(array.dtype)


def grad_piece(array, placements, mesh):
    """The expected local gradient: the piece for Shard dims, the whole for Replicate/Partial."""
    from hyper_parallel.core.dtensor.layout import grad_placements
    return local_piece(array, grad_placements(tuple(placements)), mesh, partial_share=False)


def _mesh(world_size, shape=None, names=None):
    from hyper_parallel import init_device_mesh
    return init_device_mesh("cpu", shape or (world_size,), mesh_dim_names=names)


# ============================================================================ conversions
def _pairs(layouts, every_pair):
    """Every (src, dst) pair, or a covering sample: each layout is a source three times and a
    destination three times, against varied partners (the 2x2 mesh has 196 pairs)."""
    if every_pair:
        return list(itertools.product(layouts, layouts))
    n = len(layouts)
    return [(layouts[i], layouts[(i + step) % n]) for i in range(n) for step in (0, 3, 7)]


def conversions(rank, world_size, every_pair=True):
    """from_local / to_local / full_tensor / redistribute for every pair of placements, forward and
    backward, on a 1-D mesh (even and uneven shapes) and, on 4 ranks, a 2x2 mesh (uneven shape;
    ``every_pair=False``: a covering sample of its pairs)."""
    from hyper_parallel import DTensor
    cases = 0
    meshes = [(_mesh(world_size), ["S0", "S1", "R", "P"])]
    if world_size == 4:
        meshes.append((_mesh(world_size, (2, 2), ("a", "b")), None))
    for mesh, kinds in meshes:
        if kinds is not None:
            layouts = [[k] for k in kinds]
        else:
            layouts = [list(p) for p in itertools.product(["S0", "S1", "R", "P"], repeat=2)
                       if not (p[0] == p[1] and p[0][0] == "S")]
        shapes = ((2 * world_size, 3 * world_size), (world_size + 1, 5)) if kinds else ((world_size + 1, 5),)
        for shape in shapes:
            x = inp(f"conv{shape}", 0, shape)
            w = inp(f"convw{shape}", 0, shape)
            for src_s, dst_s in _pairs(layouts, every_pair or kinds is not None):
                src, dst = _placements(src_s), _placements(dst_s)
                what = f"{src_s}->{dst_s} {shape} on mesh {mesh.mesh_shape}"
                local = local_piece(x, src, mesh)

                def run(loc):
                    dt = DTensor.from_local(loc, mesh, src, shape=shape)
                    return dt.redistribute(placements=dst)
                out = run(t(local))
                assert tuple(out.shape) == shape and list(out.placements) == dst, what
                expected_local = local_piece(x, dst, mesh, partial_share=False)
                if any(p.is_partial() for p in dst):
                    close(out.full_tensor(), x, "forward " + what, **GRAD_TOL)
                else:
                    close(out.to_local(), expected_local, "forward " + what, **GRAD_TOL)
                # to_local() marks the gradient with the value's own placements (as PyTorch does):
                # for a Partial value each rank holds a summand of the global gradient
                w_local = local_piece(w, dst, mesh)
                (g,) = grad_of(lambda loc: (run(loc).to_local() * t(w_local)).sum(), t(local))
                close(g, grad_piece(w, src, mesh), "backward " + what, **GRAD_TOL)
                cases += 1
    # full_tensor / to_local(grad_placements) / run_check
    mesh = _mesh(world_size)
    x = inp("ft", 0, (world_size * 2, 3))
    from hyper_parallel import Shard
    dt = DTensor.from_local(t(local_piece(x, [Shard(0)], mesh)), mesh, [Shard(0)], run_check=True)
    close(dt.full_tensor(), x, "full_tensor")
    expect_error(ValueError, lambda: DTensor.from_local(t(np.zeros((rank + 1, 3), np.float32)), mesh, [Shard(0)],
                                                        run_check=True), "run_check")
    return cases


def distribute(rank, world_size):
    """distribute_tensor from rank 0's data and from each rank's own copy."""
    from hyper_parallel import Replicate, Shard, distribute_tensor
    mesh = _mesh(world_size)
    x = inp("dist", 0, (world_size * 2 + 1, 4))
    mine = x if rank == 0 else np.zeros_like(x)
    dt = distribute_tensor(t(mine), mesh, [Shard(0)])
    close(dt.full_tensor(), x, "distribute_tensor(src_data_rank=0)")
    dt = distribute_tensor(t(x), mesh, [Shard(1)], src_data_rank=None)
    close(dt.to_local(), local_piece(x, [Shard(1)], mesh), "distribute_tensor(src_data_rank=None)")
    dt = distribute_tensor(t(mine), mesh, [Replicate()])
    close(dt.to_local(), x, "distribute_tensor replicate")
    return True


# ============================================================================ op dispatch
def op_cases():
    """(name, function of global tensors, input shapes, placement choices per input): the common
    operator surface, spelled through the framework's own functional ops and Tensor methods."""
    X = current().ops
    S0, S1, S2, R, P = "S0", "S1", "S2", "R", "P"
    qkv8, qkv4 = [(1, 4, 8, 2)] * 3, [(1, 2, 4, 2)] * 3
    return [
        ("add broadcast", lambda a, b: a + b, [(4, 6), (6,)], [[S0, S1, R], [R, S0]]),
        ("mul/sub/div scalars", lambda a: (a * 3.0 - 1.0) / 2.0 + 1.0 - a, [(4, 6)], [[S0, S1, R, P]]),
        ("partial + partial", lambda a, b: a + b, [(4, 6), (4, 6)], [[P], [P, R]]),
        ("exp/tanh/relu", lambda a: X.exp(a) * X.tanh(a) + X.relu(a), [(4, 6)], [[S0, S1, P]]),
        ("where/masked_fill", lambda a: X.where(a > 0, a, a * 0.1).masked_fill(a < -1.0, 0.0), [(4, 6)],
         [[S0, S1]]),
        ("matmul", lambda a, b: a @ b, [(4, 6), (6, 8)], [[S0, S1, R], [S0, S1, R]]),
        ("matmul 3d", lambda a, b: X.matmul(a, b), [(2, 4, 6), (6, 8)], [[S0, S1, S2], [R, S1]]),
        ("bmm", lambda a, b: X.bmm(a, b), [(4, 4, 6), (4, 6, 2)], [[S0, S2], [S0, S1]]),
        ("linear", lambda x, w, b: X.linear(x, w, b), [(4, 6), (8, 6), (8,)], [[S0, R], [S0, R], [S0, R]]),
        ("reshape/view", lambda a: a.reshape(2, 2, 6).view(4, 6).reshape((24,)), [(4, 6)], [[S0, S1, R]]),
        ("flatten/unsqueeze/squeeze", lambda a: a.flatten(0, 1).unsqueeze(0).squeeze(0), [(4, 2, 3)],
         [[S0, S2]]),
        ("transpose/permute/T", lambda a: a.transpose(0, 1).permute(1, 0).T.swapaxes(0, 1), [(4, 6)],
         [[S0, S1, P]]),
        ("softmax", lambda a: X.softmax(a, -1) + X.softmax(a, 0), [(4, 6)], [[S0, S1, R]]),
        ("log_softmax", lambda a: X.log_softmax(a, -1), [(4, 6)], [[S0, S1]]),
        ("sum/mean/amax", lambda a: a.sum(-1) + a.mean(-1) + a.amax(-1) + a.sum(dim=0, keepdim=True).mean(),
         [(4, 6)], [[S0, S1, P]]),
        ("cat", lambda a, b: X.cat([X.cat([a, b], 0), X.cat([b, a], 0)], 1), [(4, 6), (4, 6)],
         [[S0, S1], [S1, R]]),
        ("split/chunk/narrow", lambda a: a.split(2, 1)[1] + a.chunk(3, 1)[0] * 2 + a.narrow(1, 2, 2),
         [(4, 6)], [[S0, S1]]),
        ("getitem", lambda a: a[1:3, ::2] * 2 + a[0:2][:, 0:3] + a[..., 1:4][2:], [(4, 6)], [[S0, S1, R]]),
        ("dropout p=0", lambda a: X.dropout(a, 0.0), [(4, 6)], [[S0, P]]),
        ("float16 round trip", lambda a: X.half_roundtrip(a) * 2, [(4, 6)], [[S0, S1]]),
        ("sdpa causal", lambda q, k, v: X.sdpa(q, k, v, causal=True), qkv8, [[S1, S2, R], [S1, R], [S1, R]]),
        ("sdpa mask", lambda q, k, v, m: X.sdpa(q, k, v, mask=m > 0), qkv4 + [(4, 4)],
         [[S2, R], [R], [R], [R]]),
        ("cumsum", lambda a: X.cumsum(a, 1) * 2, [(4, 6)], [[S0, S1]]),
    ] + current().extra_op_cases()


def ops_dispatch(rank, world_size, names=None):
    """Every op case, every combination of the listed input placements, forward and gradient."""
    import warnings
    from hyper_parallel import DTensor
    fw = current()
    mesh = _mesh(world_size)
    checked = []
    for name, fn, shapes, choices in op_cases():
        if names is not None and name not in names:
            continue
        xs = [inp(f"op{name}{i}", 0, s) for i, s in enumerate(shapes)]
        reference = fn(*[t(x) for x in xs])
        gw = inp(f"opw{name}", 0, tuple(reference.shape))
        ref_grads = grad_of(lambda *a: (fn(*a) * t(gw)).sum(), *[t(x) for x in xs])
        for combo in itertools.product(*choices):
            placements = [_placements([c]) for c in combo]
            what = f"{name} {combo}"
            locals_ = [t(local_piece(x, p, mesh)) for x, p in zip(xs, placements)]

            def dist(*locs):
                dts = [DTensor.from_local(loc, mesh, p, shape=x.shape)
                       for loc, p, x in zip(locs, placements, xs)]
                return fn(*dts)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the replicated fallback of ops without a rule
                out = dist(*locals_)
                assert isinstance(out, DTensor), f"{what}: got {type(out)}"
                close(out.full_tensor(), fw.numpy(reference), "forward " + what, **GRAD_TOL)
                grads = grad_of(lambda *locs: (dist(*locs).full_tensor() * t(gw)).sum(), *locals_)
            for i, (g, p) in enumerate(zip(grads, placements)):
                close(g, grad_piece(fw.numpy(ref_grads[i]), p, mesh), f"grad {i} of {what}", **GRAD_TOL)
            checked.append(what)
    return len(checked)


def embedding_lookup(rank, world_size):
    """An embedding lookup on a vocab-sharded (Shard(0): Partial output), column-sharded
    (Shard(1): Shard(-1) output) or replicated table, with replicated or sharded ids: forward, the
    output placements, the table's gradient, and no replicated fallback on the way."""
    import warnings
    from hyper_parallel import DTensor, Partial, Shard
    X = current().ops
    mesh = _mesh(world_size)
    vocab, dim = 4 * world_size + 1, 6
    table = inp("emb", 0, (vocab, dim))
    ids = np.random.RandomState(3).randint(0, vocab, (2, 2 * world_size)).astype(np.int32)
    reference = current().numpy(X.embedding(t(ids), t(table)))
    gw = inp("embw", 0, reference.shape)
    (ref_grad,) = grad_of(lambda w: (X.embedding(t(ids), w) * t(gw)).sum(), t(table))
    expected_out = {"S0": [Partial("sum")], "S1": [Shard(2)]}
    checked = 0
    for w_spec, ids_spec in itertools.product(("S0", "S1", "R"), ("R", "S0", "S1")):
        w_place, ids_place = _placements([w_spec]), _placements([ids_spec])
        ids_dt = DTensor.from_local(t(local_piece(ids, ids_place, mesh)), mesh, ids_place, shape=ids.shape)
        what = f"embedding table {w_spec} ids {ids_spec}"

        def lookup(local_table):
            return X.embedding(ids_dt, DTensor.from_local(local_table, mesh, w_place, shape=table.shape))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = lookup(t(local_piece(table, w_place, mesh)))
            (g,) = grad_of(lambda w: (lookup(w).full_tensor() * t(gw)).sum(), t(local_piece(table, w_place, mesh)))
        fallbacks = [str(c.message) for c in caught if "no sharding rule" in str(c.message)]
        assert not fallbacks, f"{what}: {fallbacks}"
        if w_spec in expected_out:
            assert list(out.placements) == expected_out[w_spec], f"{what}: {out.placements}"
        close(out.full_tensor(), reference, "forward " + what)
        close(g, grad_piece(current().numpy(ref_grad), w_place, mesh), "table gradient " + what)
        checked += 1
    return checked


def fallback_and_strict(rank, world_size):
    """An op without a rule warns once and runs replicated; HP_STRICT_DISPATCH=1 raises instead;
    operations a DTensor cannot honour on a shard raise."""
    import os
    import warnings
    from hyper_parallel import DTensor, Replicate, Shard
    from hyper_parallel.core.dtensor.dispatch import fallback
    fw = current()
    mesh = _mesh(world_size)
    x = inp("fb", 0, (world_size * 2, 3))
    dt = DTensor.from_local(t(local_piece(x, [Shard(0)], mesh)), mesh, [Shard(0)])
    fallback._warned.clear()  # the pool process may have warned about it in an earlier case
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fw.ops.trace(dt)   # no sharding rule on either platform
        fw.ops.trace(dt)
    messages = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert len(messages) == 1 and "trace" in messages[0].lower(), messages
    assert list(out.placements) == [Replicate()]
    close(out.full_tensor(), np.trace(x), "fallback trace", **GRAD_TOL)
    os.environ["HP_STRICT_DISPATCH"] = "1"
    try:
        expect_error(NotImplementedError, lambda: fw.ops.trace(dt), "HP_STRICT_DISPATCH")
    finally:
        del os.environ["HP_STRICT_DISPATCH"]
    for bad in fw.unsupported_dtensor_operations(dt):
        try:
            bad()
        except (NotImplementedError, TypeError):
            pass
        else:
            raise AssertionError("an unsupported DTensor operation did not raise")
    assert len(dt) == world_size * 2 and dt.numel() == x.size and dt.dim() == 2
    return True
