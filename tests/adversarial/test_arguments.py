"""Every numeric argument of every public entry point (SPEC §19): a generated table of entry point ×
argument × bad value (NaN, ±inf, 0, -1, True, 1.5 where an int is meant) — each a ValueError that
names the argument, raised before anything moves. Entry points without a mesh run in this process;
those that need one run as one table on 2 gloo ranks (every rank must raise)."""
import math

import pytest
import torch

import hyper_parallel as hp
from tests.harness import run_dist

NAN, INF = math.nan, math.inf
# what each kind of argument must refuse
POSITIVE_INT = (0, -1, True, 1.5, NAN, INF, "2")
NON_NEGATIVE_INT = (-1, True, 1.5, NAN, INF)
ANY_INT = (True, 1.5, NAN, INF, "1")
POSITIVE_FLOAT = (NAN, INF, -INF, 0, 0.0, -1.0, True, "1")
FINITE_FLOAT = (NAN, INF, -INF, True, "1")


def _qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 4, 8, generator=g) for _ in range(3)]


def _attention(name, value):
    q, k, v = _qkv()
    hp.attention(q, k, v, is_causal=True, **{name: value})


def _context_parallel(name, value):
    hp.ContextParallel(**{name: value})


def _auto(name, value):
    hp.ContextParallel(mode="auto", **{name: value})


def _async(name, value):
    hp.AsyncContextParallel(**{name: value})


def _chunked_ce(name, value):
    h, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    hp.chunked_cross_entropy(h, w, torch.zeros(2, 3, dtype=torch.long), **{name: value})


def _tiled_mlp(name, value):
    args = {"chunks": 2, "seq_dim": 1}
    args[name] = value
    hp.tiled_mlp(torch.nn.Linear(4, 4), **args)


def _delta_rule(name, value):
    from hyper_parallel.core.context_parallel.linear_attention.functional import delta_rule
    b, t, h, d = 1, 4, 2, 4
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, t, h, d, generator=g) for _ in range(3))
    delta_rule(q, k, v, -torch.rand(b, t, h, generator=g), torch.rand(b, t, h, generator=g), **{name: value})


def _init_device_mesh(name, value):
    hp.init_device_mesh("cpu", (1,), **{name: value})


def _mesh_shape(name, value):
    hp.init_device_mesh("cpu", (value,))


def _shard(name, value):
    hp.Shard(value)


def _strided_shard(name, value):
    hp.StridedShard(0, value)


def _attention_masks(name, value):
    with hp.attention_masks(padding_mask=torch.ones(1, 4, dtype=torch.bool), block_size=value):
        pass


def _qkv_indices(name, value):
    hp.ContextParallel(qkv_indices=(0, value, 2))


def _sequence_parallel(name, value):
    hp.SequenceParallel(**{name: value})


LOCAL = [
    (_attention, "softcap", POSITIVE_FLOAT),
    (_attention, "window", POSITIVE_INT),
    (_attention, "scale", FINITE_FLOAT),
    (_context_parallel, "ulysses_degree", POSITIVE_INT),
    (_context_parallel, "chunks", POSITIVE_INT),
    (_context_parallel, "seq_dim", ANY_INT),
    (_context_parallel, "head_dim", ANY_INT),
    (_async, "chunks", POSITIVE_INT),
    (_async, "ulysses_degree", POSITIVE_INT),
    (_auto, "memory_budget", POSITIVE_FLOAT),
    (_chunked_ce, "chunk_size", POSITIVE_INT),
    (_chunked_ce, "ignore_index", ANY_INT),
    (_tiled_mlp, "chunks", POSITIVE_INT),
    (_tiled_mlp, "seq_dim", ANY_INT),
    (_delta_rule, "chunk_size", POSITIVE_INT),
    (_delta_rule, "scale", FINITE_FLOAT),
    (_init_device_mesh, "timeout", POSITIVE_FLOAT),
    (_mesh_shape, "mesh_shape", (0, -2, True, 1.5, NAN, INF)),
    (_shard, "dim", ANY_INT),
    (_sequence_parallel, "sequence_dim", ANY_INT),
    (_strided_shard, "split_factor", POSITIVE_INT),
    (_attention_masks, "block_size", POSITIVE_INT),
    (_qkv_indices, "qkv_indices", ANY_INT),
]
LOCAL_CASES = [(fn, name, bad) for fn, name, bads in LOCAL for bad in bads]


def _id(case):
    fn, name, bad = case
    return f"{fn.__name__.lstrip('_')}-{name}-{bad!r}"


@pytest.mark.parametrize("case", LOCAL_CASES, ids=[_id(c) for c in LOCAL_CASES])
def test_local_entry_points_refuse(case):
    fn, name, bad = case
    with pytest.raises(ValueError, match=name):
        fn(name, bad)


def test_good_values_pass():
    """The checks refuse only what is wrong: the boundary values still run."""
    q, k, v = _qkv()
    out = hp.attention(q, k, v, is_causal=True, softcap=1e-3, window=1, scale=-0.5)
    assert torch.isfinite(out).all()
    hp.ContextParallel(ulysses_degree=1, chunks=1)
    hp.ContextParallel(mode="auto", memory_budget=1)
    hp.tiled_mlp(torch.nn.Linear(4, 4), 1, seq_dim=-1)


# ------------------------------------------------------------------ entry points that need a mesh
def _mesh_cases():
    import torch as _t

    from hyper_parallel import (Replicate, data_parallel, distribute_tensor, full, init_device_mesh,
                                shard_sequence, zeros)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    x = _t.zeros(2, 4)
    return mesh, [
        ("src_data_rank", lambda v: distribute_tensor(x, mesh, [Replicate()], src_data_rank=v),
         (True, 1.5, -1, 2)),
        ("size", lambda v: zeros(v, 2, device_mesh=mesh), (-1, True, 1.5, NAN)),
        ("size", lambda v: full((v, 2), 0.0, device_mesh=mesh), (-1, True, 1.5)),
        ("seq_dim", lambda v: shard_sequence(x, mesh, seq_dim=v), (True, 1.5, NAN, 5, -3)),
        ("bucket_mb", lambda v: data_parallel(_t.nn.Linear(2, 2), mesh, bucket_mb=v),
         (0, -1, NAN, INF, True)),
    ]


def _mesh_table(rank, world_size):
    mesh, cases = _mesh_cases()
    missed = []
    for name, fn, bads in cases:
        for bad in bads:
            try:
                fn(bad)
            except ValueError as e:
                if name not in str(e):
                    missed.append(f"{name}={bad!r}: {e}")
            except Exception as e:  # noqa: BLE001 -- the table reports every obscure error at once
                missed.append(f"{name}={bad!r}: {type(e).__name__}: {e}")
            else:
                missed.append(f"{name}={bad!r}: accepted")
    return missed


def test_mesh_entry_points_refuse_on_every_rank():
    assert run_dist(2, _mesh_table) == [[], []]
