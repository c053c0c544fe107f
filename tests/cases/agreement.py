"""check_agreement on any framework: a table of setting kinds x ways to disagree.

Each case: one rank (the last) passes another value; EVERY rank must raise a ValueError naming the
feature, the setting and this rank's value; then a collective must still work (the ranks are in
step). Values that mean the same setting (2 and 2.0, NaN and NaN) must agree. A repeated identical
call adds no collective; ``HP_CHECK_RANKS=every`` exchanges on every call.
"""
import os

import numpy as np

from tests.frameworks import close, expect_error, inp, np_of, t

# (setting name, the value of every other rank, the odd rank's value); names are unique per case so
# each case is the first call of its key
DISAGREE = [
    ("window", 4, 5),
    ("scale", 0.125, 0.12500001),
    ("softcap", float("nan"), 30.0),
    ("bound", float("inf"), float("-inf")),
    ("is_causal", True, False),
    ("flag_vs_int", True, 1),
    ("kv_exchange", "ring", "allgather"),
    ("sinks", None, (2, 4)),
    ("dims", (1, 2), (2, 1)),
    ("nothing_vs_zero", None, 0),
]
AGREE = [("int_float", 2, 2.0), ("nan", float("nan"), float("nan")), ("inf", float("inf"), float("inf"))]


def _in_step(mesh, what):
    """A collective after the error: every rank must reach it with buffers of one size."""
    from hyper_parallel import DTensor, Shard
    x = inp("agree-step", 0, (2 * mesh.size(), 3))
    me = mesh.get_local_rank(0)
    dt = DTensor.from_local(t(x[2 * me:2 * me + 2]), mesh, [Shard(0)])
    close(dt.full_tensor(), x, f"in step after {what}")


def table(rank, world_size):
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.agreement import Deferred, check_agreement, tensor_digest
    mesh = init_device_mesh("cpu", (world_size,), timeout=20)
    odd = rank == world_size - 1
    for name, value, other in DISAGREE:
        mine = other if odd else value
        expect_error(ValueError, lambda: check_agreement(mesh, "Feature", {name: mine, "same": 1},
                                                         fix="do the thing"),
                     "Feature", f"disagree on {name} (rank {rank} has {mine!r})", "Fix: do the thing")
        _in_step(mesh, name)
    for name, value, other in AGREE:
        check_agreement(mesh, "Feature", {name: other if odd else value})
    # tensors by metadata: dtype and shape
    a = t(np.zeros((2, 3), np.float32))
    b = t(np.zeros((2, 4), np.float32)) if odd else a
    expect_error(ValueError, lambda: check_agreement(mesh, "Feature", {"mask": b}), "disagree on mask",
                 f"float32 tensor of shape {tuple(b.shape)}")
    # a content digest, computed only when the exchange runs
    ids = t(np.array([0, 0, 1, 1 if not odd else 2], np.int64))
    expect_error(ValueError, lambda: check_agreement(mesh, "Feature", {"documents": Deferred(
        lambda: tensor_digest(ids))}), "disagree on documents")
    _in_step(mesh, "digest")
    # another set of names / another feature: the header fields
    names = {"a": 1, "b": 2} if odd else {"a": 1}
    expect_error(ValueError, lambda: check_agreement(mesh, "Other", names), "different sets of settings")
    expect_error(ValueError, lambda: check_agreement(mesh, "Linear" if odd else "Attention", {"x": 1}),
                 "reached different checks")
    _in_step(mesh, "header")
    return True


def schedule(rank, world_size):
    """No collective for a repeated key; a changed setting (on every rank) checks again; under
    HP_CHECK_RANKS=every every call checks, and an every_only digest is compared."""
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.agreement import Deferred, check_agreement, tensor_digest
    from hyper_parallel.core.comm_mode import CommDebugMode
    mesh = init_device_mesh("cpu", (world_size,), timeout=20)
    labels = t(np.arange(6, dtype=np.int64) + (rank == world_size - 1))
    settings = {"chunk": 3, "labels": Deferred(lambda: tensor_digest(labels), every_only=True)}
    with CommDebugMode() as first:
        check_agreement(mesh, "Sched", settings, signature=("sig", 1))
    with CommDebugMode() as later:
        for _ in range(3):
            check_agreement(mesh, "Sched", settings, signature=("sig", 1))
    with CommDebugMode() as changed:
        check_agreement(mesh, "Sched", dict(settings, chunk=4), signature=("sig", 1))
    assert first.get_total_counts() == 1 and changed.get_total_counts() == 1, (first.counts, changed.counts)
    assert later.get_total_counts() == 0, later.get_comm_counts()
    os.environ["HP_CHECK_RANKS"] = "every"
    try:
        expect_error(ValueError, lambda: check_agreement(mesh, "Sched", settings, signature=("sig", 1)),
                     "disagree on labels")
        _in_step(mesh, "labels")
        with CommDebugMode() as every:
            for _ in range(2):
                check_agreement(mesh, "Sched", {"chunk": 3}, signature=("sig", 1))
        assert every.get_total_counts() == 2, every.get_comm_counts()
    finally:
        os.environ.pop("HP_CHECK_RANKS", None)
    return True


def linear_attention(rank, world_size):
    """The delta rule and the causal convolution under CP when one rank's arguments differ."""
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.context_parallel.linear_attention import (context_parallel_causal_conv1d,
                                                                       context_parallel_delta_rule)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",), timeout=20)
    odd = rank == world_size - 1
    T, H, D = 2, 2, 4

    def args(batch=1):
        q, k, v = (t(inp(f"la-agree/{n}", rank, (batch, T, H, D))) for n in "qkv")
        g = t(-np.abs(inp("la-agree/g", rank, (batch, T, H))))
        beta = t(np.full((batch, T, H), 0.5, np.float32))
        return q, k, v, g, beta
    state = inp("la-agree/h0", 0, (1, H, D, D))
    cases = [  # (setting named, keyword arguments of most ranks, of the odd rank)
        ("initial_state", {}, {"initial_state": t(state)}),
        ("initial_state contents", {"initial_state": t(state)}, {"initial_state": t(state + 1)}),
        ("mode", {}, {"mode": "p2p"}),
        ("chunk_size", {}, {"chunk_size": 3}),
        ("scale", {"scale": 0.5}, {"scale": float("nan")}),
        ("q/k/v/g/beta", {}, {"batch": 2}),
    ]
    for name, kw, odd_kw in cases:
        mine = dict(odd_kw if odd else kw)
        inputs = args(mine.pop("batch", 1))
        expect_error(ValueError, lambda: context_parallel_delta_rule(*inputs, mesh, **mine),
                     "linear attention (delta rule)", f"disagree on {name}")
        _in_step(mesh, name)
    x = t(inp("la-agree/x", rank, (1, 3, 4)))
    for name, kernel, short in (("weight", 4 if not odd else 3, False), ("halo", 4, odd)):
        xs = t(inp("la-agree/x", rank, (1, 3, 2))) if short else x
        w = t(inp("la-agree/w", 0, (3, kernel)))
        expect_error(ValueError, lambda: context_parallel_causal_conv1d(xs, w, None, mesh),
                     "linear attention (causal conv)",
                     "disagree on " + ("weight" if name == "weight" else "block"))
        _in_step(mesh, name)
    return True


def chunked_loss(rank, world_size):
    """A vocab-parallel chunked_cross_entropy whose TP ranks disagree: options, shapes and the
    labels' values at the first call of a combination; the labels' values on every call only under
    HP_CHECK_RANKS=every (they change every step: a digest per step would be a host read per step)."""
    from hyper_parallel import Shard, chunked_cross_entropy, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",), timeout=20)
    odd = rank == world_size - 1
    V, E, N = 2 * world_size, 3, 4
    weight = distribute_tensor(t(inp("ce-agree/w", 0, (V, E))), mesh, [Shard(0)])
    hidden = t(inp("ce-agree/h", 0, (N, E)))
    labels = np.arange(N, dtype=np.int64) % V
    cases = [("chunk_size", {"chunk_size": 2}, {"chunk_size": 3}),
             ("ignore_index", {}, {"ignore_index": 0}),
             ("reduction", {}, {"reduction": "mean"}),
             ("labels (rank", {}, {"labels": labels[:-1], "hidden": hidden[:-1]})]
    for name, kw, odd_kw in cases:
        mine = dict(odd_kw if odd else kw)
        h, y = mine.pop("hidden", hidden), mine.pop("labels", labels)
        expect_error(ValueError, lambda: chunked_cross_entropy(h, weight, t(y), **mine),
                     "chunked_cross_entropy", "disagree on", name)
        _in_step(mesh, name)
    other = (labels + (1 if odd else 0)) % V
    # a new combination (hidden of 3 rows): its first call compares the labels' values too
    expect_error(ValueError, lambda: chunked_cross_entropy(hidden[:3], weight, t(other[:3])), "labels values")
    _in_step(mesh, "labels values at the first call")
    chunked_cross_entropy(hidden, weight, t(labels))    # a verified combination: no exchange after it
    chunked_cross_entropy(hidden, weight, t(other))     # later values unchecked by default: documented
    os.environ["HP_CHECK_RANKS"] = "every"
    try:
        expect_error(ValueError, lambda: chunked_cross_entropy(hidden, weight, t(other)), "labels values")
        _in_step(mesh, "labels values")
        close(chunked_cross_entropy(hidden, weight, t(labels)), chunked_cross_entropy(hidden, t(
            inp("ce-agree/w", 0, (V, E))), t(labels)), "agreeing labels under every")
    finally:
        os.environ.pop("HP_CHECK_RANKS", None)
    return True


def tp_input_every(rank, world_size):
    """A tensor-parallel input that differs per rank is a documented precondition; HP_CHECK_RANKS=every
    checks it (the Replicate values compared at the style's from_local), naming the module."""
    from hyper_parallel import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module
    from tests.cases.rank_disagree import E, F, _linear_kind
    from tests.frameworks import current
    fw = current()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",), timeout=20)
    mlp = fw.mlp(_linear_kind(), E, F)
    parallelize_module(mlp, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    x = inp("tp-every", 0, (2, E))
    bumped = (x + (0.25 if rank == world_size - 1 else 0.0)).astype(np.float32)
    os.environ["HP_CHECK_RANKS"] = "every"
    try:
        expect_error(ValueError, lambda: mlp(t(bumped)), "ColwiseParallel", "max difference 0.25",
                     "HP_CHECK_RANKS=every")
        _in_step(mesh, "tp input")
        out = mlp(t(x))
    finally:
        os.environ.pop("HP_CHECK_RANKS", None)
    close(mlp(t(x)), np_of(out), "agreeing input: same result with and without the check")
    return True
