"""ContextParallel (Ulysses, all-gather KV, hybrid, head-tail load balance) vs single-process
attention on the full sequence, forward and dq/dk/dv, on any framework.

Every rank builds the full q, k, v and the output weight w from one seed, computes the reference
(out, and the gradients of sum(out * w)) with the plain module, then runs its own contiguous block
through the ContextParallel module; its local loss is sum(out_block * w_block), so the gradients of
the local q, k, v blocks are the blocks of the reference gradients.
"""
import numpy as np

from tests.frameworks import close, current, expect_error, grad_of, inp, t

B, D = 2, 4
LAYOUTS = {"bshd": (1, 2), "bnsd": (2, 1)}   # layout -> (seq_dim, head_dim)
GRID = [(layout, kind, causal) for layout in LAYOUTS for kind in ("sdpa", "matmul") for causal in (True, False)]
UL, AG, LB = {"ulysses_degree": None}, {"ulysses_degree": 1}, {"ulysses_degree": 1, "load_balance": True}


def _shape(layout, S, H):
    return (B, S, H, D) if layout == "bshd" else (B, H, S, D)


def _block(array, dim, index, parts):
    return np.split(array, parts, axis=dim)[index]


def _cp_mesh(world_size):
    from hyper_parallel import init_device_mesh
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))


def check(rank, world_size, mesh, style_kwargs, layout="bshd", kind="sdpa", causal=True, H=8, S=16,
          mask=None, Hkv=None, split=False):
    """One ContextParallel call on this rank's block vs the reference: output and dq, dk, dv.
    ``mask``: an optional global (S, S) bool array (True = may attend); ``Hkv``: fewer k/v heads
    (GQA); ``split``: the call made as ``start_attention(...).finish()``."""
    from hyper_parallel import ContextParallel, start_attention
    fw = current()
    seq, head = LAYOUTS[layout]
    tag = f"{layout}{kind}{causal}{H}{S}{mask is None}{Hkv}"
    q, w = (inp(f"cp{tag}{i}", 0, _shape(layout, S, H)) for i in "qw")
    k, v = (inp(f"cp{tag}{i}", 0, _shape(layout, S, Hkv or H)) for i in "kv")
    mask_t = None if mask is None else t(mask)
    ref_cell = fw.attention(kind, layout)

    def reference(q_, k_, v_):
        return ref_cell(q_, k_, v_, mask=mask_t, causal=causal)
    ref_out = reference(t(q), t(k), t(v))
    ref_grads = grad_of(lambda a, b, c: (reference(a, b, c) * t(w)).sum(), t(q), t(k), t(v))

    cell = fw.attention(kind, layout)
    ContextParallel(seq_dim=seq, head_dim=head, **style_kwargs).apply(cell, mesh)
    me, n = mesh.get_local_rank(0), mesh.size()
    blocks = [t(_block(x, seq, me, n)) for x in (q, k, v)]
    w_block = t(_block(w, seq, me, n))

    def dist(a, b, c):
        if split:
            return start_attention(cell, a, b, c, mask=mask_t, causal=causal).finish()
        return cell(a, b, c, mask=mask_t, causal=causal)
    what = f"{'split ' if split else ''}{style_kwargs} {layout} {kind} causal={causal} H={H} Hkv={Hkv} S={S} mask={mask is not None}"
    out = dist(*blocks)
    assert fw.is_plain_tensor(out), f"{what}: a local input gave {type(out)}"
    close(out, _block(fw.numpy(ref_out), seq, me, n), "forward " + what)
    grads = grad_of(lambda a, b, c: (dist(a, b, c) * w_block).sum(), *blocks)
    for name, g, ref in zip("qkv", grads, ref_grads):
        close(g, _block(fw.numpy(ref), seq, me, n), f"d{name} " + what)
    return what


def check_projected(rank, world_size, mesh, style_kwargs, layout, kind, causal, H=4, S=16, E=8):
    """q, k, v = Linear(x) of this rank's block of hidden states x, then ContextParallel attention:
    output, dx and the weight and bias gradients of the three projections (each rank's are the
    gradient of its own loss term: summed over ranks they equal the reference)."""
    from hyper_parallel import ContextParallel
    from hyper_parallel.platform import get_platform
    fw = current()
    seq, head = LAYOUTS[layout]
    x = inp("projx", 0, (B, S, E))
    w = inp("projw", 0, _shape(layout, S, H))

    def build():
        proj = fw.projections(E, H * D)
        fw.set_parameters(proj, {name: inp(f"proj{name}", 0, shape) * 0.3
                                 for name, shape in fw.parameter_shapes(proj).items()})
        return proj

    def attend(proj, attention, xs):
        qkv = [p.reshape(B, xs.shape[1], H, D) for p in proj(xs)]
        if layout == "bnsd":
            qkv = [p.swapaxes(1, 2) for p in qkv]
        return attention(*qkv, causal=causal)

    ref_proj, ref_attention = build(), fw.attention(kind, layout)
    ref_out = fw.numpy(attend(ref_proj, ref_attention, t(x)))
    ref_dx, ref_grads = fw.grads_then_sgd(ref_proj, lambda xs: (attend(ref_proj, ref_attention, xs) * t(w)).sum(),
                                          t(x), lr=0.0)
    proj, attention = build(), fw.attention(kind, layout)
    ContextParallel(seq_dim=seq, head_dim=head, **style_kwargs).apply(attention, mesh)
    me, n = mesh.get_local_rank(0), mesh.size()
    x_block, w_block = t(_block(x, 1, me, n)), t(_block(w, seq, me, n))
    what = f"projected {style_kwargs} {layout} {kind} causal={causal}"
    close(attend(proj, attention, x_block), _block(ref_out, seq, me, n), "forward " + what)
    dx, grads = fw.grads_then_sgd(proj, lambda xs: (attend(proj, attention, xs) * w_block).sum(), x_block, lr=0.0)
    close(dx, _block(ref_dx, 1, me, n), "dx " + what)
    platform = get_platform()
    for name, g in grads.items():
        close(platform.all_reduce(t(g), None), ref_grads[name], f"d{name} (summed over ranks) " + what)
    return what


def modes_for(world_size):
    """Every non-ring mode this world runs (hybrid needs 1 < ulysses_degree < world)."""
    return [UL, AG, LB] + ([{"ulysses_degree": 2}] if world_size == 4 else [])


def cp_projected(rank, world_size, modes=None):
    """Each mode (default: all), both layouts and kernels, with q, k, v projected by Linear layers."""
    mesh = _cp_mesh(world_size)
    modes = modes or modes_for(world_size)
    return [check_projected(rank, world_size, mesh, mode, layout, kind, True, S=4 * world_size)
            for mode in modes for layout, kind in (("bshd", "sdpa"), ("bnsd", "matmul"))]


def cp_grid(rank, world_size, plan, S=16, H=8):
    """``plan``: [(style kwargs, [(layout, kind, causal[, Hkv]), ...]), ...]. Returns the checks
    done."""
    mesh = _cp_mesh(world_size)
    return [check(rank, world_size, mesh, style, *point[:3], H=H, S=S, Hkv=point[3] if len(point) > 3 else None)
            for style, points in plan for point in points]


def random_mask(S, seed=7):
    """A global (S, S) bool mask in which every row sees at least its diagonal."""
    return (np.random.RandomState(seed).rand(S, S) < 0.6) | np.eye(S, dtype=bool)


def cp_extras(rank, world_size, modes=None):
    """Explicit global masks (sliced to the local rows), GQA, DTensor in -> DTensor out with the
    same placements, and validation errors raised before any collective."""
    from hyper_parallel import ContextParallel, DTensor, Shard
    fw = current()
    mesh = _cp_mesh(world_size)
    S = 4 * world_size
    modes = modes or modes_for(world_size)
    done = [check(rank, world_size, mesh, mode, "bshd", kind, False, S=S, mask=random_mask(S))
            for mode in modes for kind in ("sdpa", "matmul")]
    # GQA: 8 query heads on 4 k/v heads (Ulysses splits both)
    done += [check(rank, world_size, mesh, mode, layout, kind, True, S=S, Hkv=4)
             for mode in modes for layout, kind in (("bshd", "sdpa"), ("bnsd", "matmul"))]
    # a DTensor q/k/v (Shard(seq) on the CP mesh) gives a DTensor output with the same placements
    cell = fw.attention("sdpa", "bshd")
    ContextParallel(seq_dim=1, head_dim=2).apply(cell, mesh)
    x = inp("dtin", 0, _shape("bshd", S, 8))
    dts = [DTensor.from_local(t(_block(x, 1, rank, world_size)), mesh, [Shard(1)]) for _ in range(3)]
    out = cell(*dts, causal=True)
    assert isinstance(out, DTensor) and list(out.placements) == [Shard(1)], (type(out), out)
    ref = fw.attention("sdpa", "bshd")(t(x), t(x), t(x), causal=True)
    close(out.full_tensor(), fw.numpy(ref), "DTensor in -> DTensor out")
    # heads not divisible by the Ulysses degree: a ValueError naming the heads, on every rank
    bad_heads = fw.attention("sdpa", "bshd")
    ContextParallel(seq_dim=1, head_dim=2, ulysses_degree=world_size).apply(bad_heads, mesh)
    odd = t(np.zeros((B, 2, world_size + 1, D), np.float32))
    expect_error(ValueError, lambda: bad_heads(odd, odd, odd), "heads")
    expect_error(ValueError, lambda: ContextParallel(ulysses_degree=2, load_balance=True), "load_balance")
    return done


def tp_cp(rank, world_size):
    """Root mesh ("cp", "tp") = (2, 2). q/k/v arrive as DTensors on mesh["tp"] with Shard(head)
    whose global sequence is this CP rank's block; ContextParallel runs on mesh["cp"] and the
    output comes back on mesh["tp"] with the same placements: its local value and the local q/k/v
    gradients equal the matching blocks of single-process attention."""
    from hyper_parallel import ContextParallel, DTensor, Shard, init_device_mesh
    fw = current()
    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    cp_mesh, tp_mesh = root["cp"], root["tp"]
    c, h = cp_mesh.get_local_rank(), tp_mesh.get_local_rank()
    S, H = 16, 8
    done = []
    for layout, (seq, head) in LAYOUTS.items():
        for mode in (UL, AG, LB):
            for kind, causal in (("sdpa", True), ("matmul", False)):
                q, k, v, w = (inp(f"tpcp{layout}{i}", 0, _shape(layout, S, H)) for i in range(4))
                ref_attention = fw.attention(kind, layout)

                def reference(a, b, d):
                    return ref_attention(a, b, d, causal=causal)
                ref_out = fw.numpy(reference(t(q), t(k), t(v)))
                ref_grads = grad_of(lambda a, b, d: (reference(a, b, d) * t(w)).sum(), t(q), t(k), t(v))

                def mine(x):
                    return _block(_block(x, seq, c, 2), head, h, 2)
                attention = fw.attention(kind, layout)
                ContextParallel(seq_dim=seq, head_dim=head, **mode).apply(attention, cp_mesh)

                def dist(a, b, d):
                    dts = [DTensor.from_local(x, tp_mesh, [Shard(head)]) for x in (a, b, d)]
                    return attention(*dts, causal=causal)
                what = f"TPxCP {layout} {mode} {kind} causal={causal}"
                out = dist(t(mine(q)), t(mine(k)), t(mine(v)))
                assert isinstance(out, DTensor), what
                assert out.device_mesh == tp_mesh and tuple(out.placements) == (Shard(head),), \
                    (what, out.device_mesh, out.placements)
                close(out.to_local(), mine(ref_out), "forward " + what)
                grads = grad_of(lambda a, b, d: (dist(a, b, d).to_local() * t(mine(w))).sum(),
                                t(mine(q)), t(mine(k)), t(mine(v)))
                for name, g, ref in zip("qkv", grads, ref_grads):
                    close(g, mine(fw.numpy(ref)), f"d{name} " + what)
                done.append(what)
    return done
