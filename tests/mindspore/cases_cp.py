"""ContextParallel on MindSpore Cells (Ulysses, all-gather KV, hybrid, head-tail load balance) vs
single-process MindSpore attention on the full sequence, forward and dq/dk/dv.

Every rank builds the full q, k, v and the output weight w from one seed, computes the reference
(out, and the gradients of sum(out * w)) with the plain Cell, then runs its own contiguous block
through the ContextParallel Cell; its local loss is sum(out_block * w_block), so the gradients of
the local q, k, v blocks are the blocks of the reference gradients.
"""
import numpy as np

from tests.mindspore.common import close, grad_of, inp, t

B, D = 2, 4
TOL = {"atol": 2e-5, "rtol": 2e-5}
LAYOUTS = {"bshd": (1, 2), "bnsd": (2, 1)}


def attention_cell(kind="sdpa", layout="bshd"):
    """A core-attention Cell ``construct(q, k, v, mask=None, causal=False)``: ``sdpa`` calls
    hyper_parallel's MindSpore SDPA; ``matmul`` is q @ kᵀ / softmax / @ v written with MindSpore
    ops, the causal mask built from the global lengths (what users write)."""
    import mindspore as ms
    from mindspore import mint, ops
    from hyper_parallel.platform.mindspore import scaled_dot_product_attention

    class Attention(ms.nn.Cell):
        def construct(self, q, k, v, mask=None, causal=False):
            if layout == "bshd":
                q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
            if kind == "sdpa":
                o = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
            else:
                scores = ops.matmul(q, k.swapaxes(-2, -1)) * (q.shape[-1] ** -0.5)
                if causal:
                    sq, sk = q.shape[-2], k.shape[-2]
                    allowed = ops.tril(mint.ones((sq, sk), dtype=ms.int32), sk - sq).astype(ms.bool_)
                    scores = scores.masked_fill(~allowed, float("-inf"))
                if mask is not None:
                    scores = scores.masked_fill(~mask, float("-inf"))
                o = ops.matmul(ops.softmax(scores, -1), v)
            return o.swapaxes(1, 2) if layout == "bshd" else o

    return Attention()


def _shape(layout, S, H):
    return (B, S, H, D) if layout == "bshd" else (B, H, S, D)


def _block(array, dim, index, parts):
    return np.split(array, parts, axis=dim)[index]


def check(rank, world_size, mesh, style_kwargs, layout="bshd", kind="sdpa", causal=True, H=4, S=8,
          mask_kind=None):
    import mindspore as ms
    from hyper_parallel import ContextParallel
    seq, head = LAYOUTS[layout]
    tag = f"{layout}{kind}{causal}{H}{S}{mask_kind}"
    q, k, v, w = (inp(f"cp{tag}{i}", 0, _shape(layout, S, H)) for i in range(4))
    mask = None
    if mask_kind == "random":
        mask = (np.random.RandomState(7).rand(S, S) < 0.6) | np.eye(S, dtype=bool)
    ref_cell = attention_cell(kind, layout)

    def reference(q_, k_, v_):
        return ref_cell(q_, k_, v_, mask=None if mask is None else t(mask), causal=causal)
    ref_out = reference(t(q), t(k), t(v))
    ref_grads = grad_of(lambda a, b, c: (reference(a, b, c) * t(w)).sum(), t(q), t(k), t(v))

    cell = attention_cell(kind, layout)
    ContextParallel(seq_dim=seq, head_dim=head, **style_kwargs).apply(cell, mesh)
    n = mesh.size()
    me = mesh.get_coordinate()[0] if mesh.ndim == 1 else rank
    blocks = [t(_block(x, seq, me, n)) for x in (q, k, v)]
    w_block = t(_block(w, seq, me, n))

    def dist(a, b, c):
        return cell(a, b, c, mask=None if mask is None else t(mask), causal=causal)
    what = f"{style_kwargs} {layout} {kind} causal={causal} H={H} S={S} mask={mask_kind}"
    out = dist(*blocks)
    assert type(out) is ms.Tensor, f"{what}: a local input gave {type(out)}"
    close(out, _block(ref_out.asnumpy(), seq, me, n), "forward " + what, **TOL)
    grads = grad_of(lambda a, b, c: (dist(a, b, c) * w_block).sum(), *blocks)
    for name, g, ref in zip("qkv", grads, ref_grads):
        close(g, _block(ref.asnumpy(), seq, me, n), f"d{name} " + what, **TOL)
    return what


def _cp_mesh(world_size):
    from hyper_parallel import init_device_mesh
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))


def modes(world_size):
    out = {"ulysses": {"ulysses_degree": None}, "allgather": {"ulysses_degree": 1},
           "load_balance": {"ulysses_degree": 1, "load_balance": True}}
    if world_size == 4:
        out["hybrid"] = {"ulysses_degree": 2}
    return out


def cp_grid(rank, world_size, mode, kinds=("sdpa", "matmul")):
    """One mode, both layouts, both attention kinds, causal and not (load balance: causal)."""
    mesh = _cp_mesh(world_size)
    style = modes(world_size)[mode]
    done = []
    for layout in LAYOUTS:
        for kind in kinds:
            for causal in ((True,) if mode == "load_balance" else (True, False)):
                done.append(check(rank, world_size, mesh, style, layout, kind, causal,
                                  S=4 * world_size))
    return done


def cp_extras(rank, world_size):
    """Explicit global masks (all-gather KV slices them to the local rows), DTensor inputs keep
    their placements in the output, and construction/validation errors."""
    import mindspore as ms
    from hyper_parallel import ContextParallel, DTensor, Shard
    mesh = _cp_mesh(world_size)
    done = [check(rank, world_size, mesh, {"ulysses_degree": 1}, "bshd", kind, False, S=4 * world_size,
                  mask_kind="random") for kind in ("sdpa", "matmul")]
    # a DTensor q (Shard(seq) on the CP mesh) gives a DTensor output with the same placements
    cell = attention_cell("sdpa", "bshd")
    ContextParallel(seq_dim=1, head_dim=2).apply(cell, mesh)
    x = inp("dtin", 0, _shape("bshd", 4 * world_size, 4))
    local = t(_block(x, 1, rank, world_size))
    dts = [DTensor.from_local(local, mesh, [Shard(1)]) for _ in range(3)]
    out = cell(*dts, causal=True)
    assert isinstance(out, DTensor) and list(out.placements) == [Shard(1)], (type(out), out)
    ref = attention_cell("sdpa", "bshd")(t(x), t(x), t(x), causal=True)
    close(out.full_tensor(), ref.asnumpy(), "DTensor in -> DTensor out", **TOL)
    # errors before any collective
    bad_heads = attention_cell("sdpa", "bshd")
    ContextParallel(seq_dim=1, head_dim=2, ulysses_degree=world_size).apply(bad_heads, mesh)
    odd = t(np.zeros((B, 2, world_size + 1, D), np.float32))
    try:
        bad_heads(odd, odd, odd)
    except ValueError as exc:
        assert "heads" in str(exc)
    else:
        raise AssertionError("heads not divisible by ulysses_degree did not raise")
    try:
        ContextParallel(ulysses_degree=2, load_balance=True)
    except ValueError:
        pass
    else:
        raise AssertionError("load_balance without ulysses_degree=1 did not raise")
    del ms
    return done
