"""ContextParallel (SPEC §6): GQA/MQA with fewer k/v heads than the Ulysses degree, and 2-D CP
meshes named ("co", "ds") in either order.

Every rank builds the full q, k, v from one seed and computes single-device attention on the full
sequence as the reference (k/v heads repeated with repeat_interleave, so query head h uses k/v
head h // (Hq/Hkv)); its own contiguous block then runs through the ContextParallel module, and
the output and dq, dk, dv blocks must match within 1e-5 (fp32). k/v heads below the degree are
replicated inside the style (r = ds / gcd(ds, Hkv) copies each), so dk/dv sum the copies'
gradients back to the caller's Hkv heads.
"""
import pytest

from tests.cases import context_parallel as neutral
from tests.harness import run_dist
from tests.harness.frameworks import framework_worlds, run_on

B, D = 2, 4
TOL = {"atol": 1e-5, "rtol": 1e-5}
LAYOUTS = {"bshd": (1, 2), "bnsd": (2, 1)}   # layout -> (seq_dim, head_dim)
UL = {"ulysses_degree": None}
POINTS = [(layout, kind, causal) for layout in LAYOUTS for kind in ("sdpa", "matmul")
          for causal in (True, False)]


def _shape(layout, S, H):
    return (B, S, H, D) if layout == "bshd" else (B, H, S, D)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _reference(q, k, v, layout, causal):
    """Single-device attention, GQA by repeat_interleave (independent of the module under test)."""
    import torch.nn.functional as F
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out.transpose(1, 2) if layout == "bshd" else out


def _block_index(mesh):
    """This rank's sequence block: its rank on a 1-D mesh, c·ds + d on a 2-D (co, ds) mesh, whatever
    the order of the names."""
    if mesh.ndim == 1:
        return mesh.get_local_rank(), mesh.size()
    return mesh.get_local_rank("co") * mesh.size("ds") + mesh.get_local_rank("ds"), mesh.size()


def _problem(layout, causal, Hq, Hkv, S=16, seed=0):
    """(full q, k, v; the output weight w; the reference's leaves, holding the gradients of
    sum(ref * w); the reference output), all from ``seed``."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(_shape(layout, S, h), generator=gen) for h in (Hq, Hkv, Hkv)]
    w = torch.randn(_shape(layout, S, Hq), generator=gen)
    ref_leaves = [_leaf(t) for t in full]
    ref = _reference(*ref_leaves, layout, causal)
    (ref * w).sum().backward()
    return full, w, ref_leaves, ref


def _check(mesh, style_kwargs, layout, kind, causal, Hq, Hkv, S=16, seed=0):
    """One call on this rank's block vs the reference: output, dq, dk, dv."""
    import torch
    from hyper_parallel import ContextParallel
    from tests.frameworks.torch_adapter import TorchAdapter

    seq, head = LAYOUTS[layout]
    full, w, ref_leaves, ref = _problem(layout, causal, Hq, Hkv, S, seed)

    index, parts = _block_index(mesh)
    leaves = [_leaf(t.chunk(parts, seq)[index]) for t in full]
    module = ContextParallel(seq_dim=seq, head_dim=head, **style_kwargs).apply(
        TorchAdapter.attention(kind, layout), mesh)
    out = module(*leaves, causal=causal)
    where = (f"{style_kwargs} mesh={mesh.mesh_dim_names}{mesh.mesh_shape} {layout} {kind} causal={causal} "
             f"Hq={Hq} Hkv={Hkv}")
    torch.testing.assert_close(out, ref.chunk(parts, seq)[index], **TOL, msg=lambda m: f"out {where}: {m}")
    (out * w.chunk(parts, seq)[index]).sum().backward()
    for name, leaf, ref_leaf in zip("qkv", leaves, ref_leaves):
        assert leaf.grad.shape == leaf.shape, (name, leaf.grad.shape, leaf.shape, where)
        torch.testing.assert_close(leaf.grad, ref_leaf.grad.chunk(parts, seq)[index], **TOL,
                                   msg=lambda m, n=name: f"d{n} {where}: {m}")
    return where


def _cp_mesh(world):
    from hyper_parallel import init_device_mesh
    return init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))


# ============================================================================ GQA below the degree
def _ulysses_gqa_case(rank, world, cases):
    mesh = _cp_mesh(world)
    return [_check(mesh, UL, *point, Hq=Hq, Hkv=Hkv) for Hq, Hkv in cases for point in POINTS]


@pytest.mark.parametrize("world,cases", [(4, [(8, 1), (8, 2)]), (2, [(4, 1)])], ids=["4ranks", "2ranks"])
def test_ulysses_gqa_fewer_kv_heads_than_degree(world, cases):
    """Ulysses: Hq=8 with Hkv 1 (MQA) and 2 on 4 ranks, Hq=4 with Hkv=1 on 2 ranks; BSHD/BNSD,
    SDPA/matmul, causal or not."""
    done = run_dist(world, _ulysses_gqa_case, cases, timeout=600)
    assert [len(d) for d in done] == [len(cases) * len(POINTS)] * world


def _hybrid_gqa_case(rank, world):
    """Hybrid ds=2 on 4 ranks (1-D mesh tiled, and 2-D meshes in both name orders), all-gather and
    ring across groups, MQA (Hkv=1) and Hkv=3 (gcd(2, 3) = 1: r = 2) beside Hq=6."""
    from hyper_parallel import init_device_mesh
    meshes = [_cp_mesh(world),
              init_device_mesh("cpu", (2, 2), mesh_dim_names=("co", "ds")),
              init_device_mesh("cpu", (2, 2), mesh_dim_names=("ds", "co"))]
    done = []
    for mesh in meshes:
        style = {"ulysses_degree": 2} if mesh.ndim == 1 else {}
        for exchange in ("allgather", "ring"):
            kwargs = dict(style, kv_exchange=exchange)
            points = POINTS if exchange == "allgather" else [p for p in POINTS if p[1] == "sdpa"]
            done += [_check(mesh, kwargs, *point, Hq=8, Hkv=1) for point in points]
        done += [_check(mesh, style, "bnsd", "sdpa", True, Hq=6, Hkv=3),
                 _check(mesh, style, "bshd", "matmul", False, Hq=6, Hkv=3)]
    return done


def test_hybrid_gqa_fewer_kv_heads_than_degree():
    done = run_dist(4, _hybrid_gqa_case, timeout=900)
    assert len(set(map(len, done))) == 1 and len(done[0]) == 3 * (len(POINTS) + 4 + 2)


def _gqa_errors_and_volume_case(rank, world):
    """q heads not divisible by the degree stays a ValueError before any data moves; k/v below the
    degree send the closed form with Hkv replaced by lcm(Hkv, ds)."""
    import math

    import torch
    from hyper_parallel import CommDebugMode, ContextParallel
    from tests.frameworks.torch_adapter import TorchAdapter

    mesh = _cp_mesh(world)
    module = ContextParallel(seq_dim=1, head_dim=2).apply(TorchAdapter.attention(), mesh)
    q, k = torch.randn(B, 4, 6, D), torch.randn(B, 4, 1, D)
    with CommDebugMode() as comm:
        try:
            module(q, k, k)
        except ValueError as exc:
            assert "q has 6 heads" in str(exc) and "ulysses_degree=4" in str(exc), exc
        else:
            raise AssertionError("no ValueError for 6 q heads on ulysses_degree=4")
    assert set(comm.get_comm_counts()) <= {"shape_check"}, comm.summary()

    S, Hq, P = 16, 8, world
    report = {}
    for name, kwargs, u in (("ulysses", {}, P), ("hybrid", {"ulysses_degree": 2}, 2)):
        for Hkv in (1, 2):
            r = P // u
            hkv = math.lcm(Hkv, u)   # k/v heads after replication
            want = {"all_to_all": 4 * (u - 1) * B * (S // P) * D * (2 * Hq + 2 * hkv) // u}
            if r > 1:
                want["all_gather"] = 4 * 2 * (r - 1) * B * S * hkv * D // (r * u)
            leaves = [_leaf(torch.randn(B, S // P, h, D)) for h in (Hq, Hkv, Hkv)]
            module = ContextParallel(seq_dim=1, head_dim=2, **kwargs).apply(TorchAdapter.attention(), mesh)
            with CommDebugMode() as fwd:
                out = module(*leaves, causal=True)
            with CommDebugMode() as bwd:
                out.sum().backward()
            got_f = {op: n for op, n in fwd.get_comm_bytes().items() if op != "shape_check"}
            got_b = {op: n for op, n in bwd.get_comm_bytes().items() if op != "shape_check"}
            want_b = {("reduce_scatter" if op == "all_gather" else op): n for op, n in want.items()}
            assert got_f == want, f"{name} Hkv={Hkv}: forward bytes {got_f} != {want}\n{fwd.summary()}"
            assert got_b == want_b, f"{name} Hkv={Hkv}: backward bytes {got_b} != {want_b}\n{bwd.summary()}"
            report[f"{name}{Hkv}"] = got_f
            torch.distributed.barrier()
    return report


def test_gqa_errors_and_communication_volume():
    report = run_dist(4, _gqa_errors_and_volume_case, timeout=600)
    assert all(r == report[0] for r in report)


# ============================================================================ 2-D mesh names
def _mesh_orders_case(rank, world):
    """A ("ds", "co") mesh gives what a ("co", "ds") mesh gives (blocks by name: c·ds + d), with
    plain blocks and with DTensors on the mesh (DTensor in -> DTensor out, same global tensor)."""
    import torch
    from hyper_parallel import CommDebugMode, ContextParallel, init_device_mesh
    from hyper_parallel.core.dtensor.dtensor import DTensor
    from hyper_parallel.core.context_parallel.mode import cp_dim_order
    from hyper_parallel.core.dtensor.layout import placements_from_orders
    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
    from tests.frameworks.torch_adapter import TorchAdapter

    done, volumes = [], []
    for names in (("co", "ds"), ("ds", "co")):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        for point in POINTS:
            done.append(_check(mesh, {}, *point, Hq=4, Hkv=4))
        done.append(_check(mesh, {"ulysses_degree": 2}, "bshd", "sdpa", True, Hq=8, Hkv=2))
        # DTensor in -> DTensor out on the mesh
        S, H = 16, 4
        gen = torch.Generator().manual_seed(3)
        full = [torch.randn(B, S, H, D, generator=gen) for _ in range(3)]
        ndim_orders = [[] for _ in range(4)]
        ndim_orders[1] = cp_dim_order(mesh)
        placements = placements_from_orders(ndim_orders, [Replicate()] * 2, mesh.mesh_shape)
        index, parts = _block_index(mesh)
        dts = [DTensor.from_local(t.chunk(parts, 1)[index], mesh, placements, shape=t.shape) for t in full]
        module = ContextParallel(seq_dim=1, head_dim=2).apply(TorchAdapter.attention(), mesh)
        out = module(*dts, causal=True)
        assert isinstance(out, DTensor) and out.device_mesh == mesh, type(out)
        torch.testing.assert_close(out.full_tensor(), _reference(*full, "bshd", True), **TOL)
        # a DTensor split the mesh's way ([Shard(1), Shard(1)]) is the same global tensor
        plain = [d.redistribute(placements=[Shard(1), Shard(1)]) for d in dts]
        out2 = module(*plain, causal=True)
        torch.testing.assert_close(out2.full_tensor(), _reference(*full, "bshd", True), **TOL)
        done.append(f"dtensor {names}")
        # the same collectives and bytes as the other order
        leaves = [_leaf(t.chunk(parts, 1)[index]) for t in full]
        with CommDebugMode() as comm:
            module(*leaves, causal=True).sum().backward()
        volumes.append({op: n for op, n in comm.get_comm_bytes().items() if op != "shape_check"})
    assert volumes[0] == volumes[1], volumes
    # a wrong name or a degree that contradicts the mesh
    for names, kwargs, words in ((("co", "x"), {}, "('co', 'ds')"),
                                 (("ds", "co"), {"ulysses_degree": 4}, "ds size 2")):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        try:
            ContextParallel(**kwargs).apply(TorchAdapter.attention(), mesh)
        except ValueError as exc:
            assert words in str(exc), exc
        else:
            raise AssertionError(f"no ValueError for mesh {names} {kwargs}")
    return done


def test_2d_mesh_names_in_either_order():
    done = run_dist(4, _mesh_orders_case, timeout=600)
    assert len(set(map(len, done))) == 1 and len(done[0]) == 2 * (len(POINTS) + 2)


# ============================================================================ both platforms
@pytest.mark.parametrize("framework,world", [p for p in framework_worlds(2, 4) if p.values[1] == 4])
def test_gqa_below_degree_neutral(framework, world):
    """The platform-neutral case (tests/cases/context_parallel.py) with k/v heads below the degree,
    on torch modules and MindSpore Cells: Ulysses with MQA and Hkv=2, hybrid 2x2 with MQA."""
    plan = [(UL, [("bshd", "sdpa", True, 1), ("bnsd", "matmul", False, 2)]),
            ({"ulysses_degree": 2}, [("bnsd", "sdpa", False, 1), ("bshd", "matmul", True, 1)])]
    done = run_on(framework, world, neutral.cp_grid, plan, 16, timeout=400)
    assert [len(d) for d in done] == [4] * world
