"""The platform surface besides collectives, on any framework: process groups (creation order,
caching, sub-groups, mesh groups), make_autograd_function, SDPA and the ring block kernels."""
import numpy as np

from tests.frameworks import close, current, grad_of, inp, t


def process_groups(rank, world_size):
    from hyper_parallel import init_device_mesh
    from hyper_parallel.platform import get_platform
    platform = get_platform()
    assert platform.is_initialized() and platform.get_rank() == rank
    assert platform.get_world_size() == world_size
    # groups: cached by rank tuple, created on every rank in the same order, creation order kept
    world = platform.new_group(range(world_size))
    assert platform.new_group(tuple(range(world_size))) is world
    backwards = platform.new_group(tuple(reversed(range(world_size))))
    assert platform.group_ranks(backwards) == tuple(reversed(range(world_size)))
    assert platform.get_rank(backwards) == world_size - 1 - rank
    pairs = [tuple(range(i, i + 2)) for i in range(0, world_size, 2)]
    mine = [platform.new_group(p) for p in pairs]
    assert [platform.new_group(p) for p in pairs] == mine
    my_pair = mine[rank // 2]
    assert platform.get_world_size(my_pair) == 2 and platform.get_rank(my_pair) == rank % 2
    got = platform.all_gather(t(np.array([rank], np.float32)), backwards)
    close(got, np.array(list(reversed(range(world_size))), np.float32), "all_gather in creation order")
    platform.barrier()
    platform.barrier(my_pair)
    # a DeviceMesh builds its groups through the platform
    if world_size == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        assert platform.group_ranks(mesh.get_group("b")) == (rank - rank % 2, rank - rank % 2 + 1)
        assert platform.group_ranks(mesh.get_group("a")) == (rank % 2, rank % 2 + 2)
    return True


def autograd_function(rank, world_size):
    """make_autograd_function: a custom backward on plain tensors, several outputs, non-tensor
    arguments, and no graph under no_grad."""
    from hyper_parallel.platform import get_platform
    platform = get_platform()

    def forward(ctx, x, y, factor):
        ctx.factor = factor
        ctx.save_for_backward(x, y)
        return x * y, x + factor

    def backward(ctx, g_prod, g_sum):
        x, y = ctx.saved_tensors
        return g_prod * y * 100 + g_sum, g_prod * x, None
    fn = platform.make_autograd_function("Custom", forward, backward)
    x, y = inp("af", 0, (3,)), inp("af", 1, (3,))
    prod, plus = fn(t(x), t(y), 2.0)
    close(prod, x * y, "custom forward")
    close(plus, x + 2.0, "custom forward 2")
    gx, gy = grad_of(lambda a, b: fn(a, b, 2.0)[0].sum() + fn(a, b, 2.0)[1].sum(), t(x), t(y))
    close(gx, y * 100 + 1, "custom backward x")
    close(gy, x, "custom backward y")
    return True



def attention_kernels(rank, world_size):
    """The framework's SDPA and the platform's vs numpy, masks with PyTorch's meaning, GQA, and the ring block kernels."""
    from hyper_parallel.platform import get_platform
    platform = get_platform()
    X = current().ops
    q, k, v = (inp(f"att{i}", 0, (1, 2, 5, 4)) for i in range(3))

    def ref(q, k, v, mask=None, causal=False):
        s = q @ np.swapaxes(k, -1, -2) / 2.0
        if causal:
            s = np.where(np.tril(np.ones((5, 5), bool)), s, -np.inf)
        if mask is not None:
            s = np.where(mask, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ v
    close(X.sdpa(t(q), t(k), t(v)), ref(q, k, v), "sdpa", atol=1e-5, rtol=1e-5)
    close(X.sdpa(t(q), t(k), t(v), causal=True), ref(q, k, v, causal=True), "sdpa causal",
          atol=1e-5, rtol=1e-5)
    mask = np.random.RandomState(0).rand(5, 5) < 0.5
    mask |= np.eye(5, dtype=bool)
    close(X.sdpa(t(q), t(k), t(v), mask=t(mask)), ref(q, k, v, mask), "sdpa bool mask",
          atol=1e-5, rtol=1e-5)
    close(platform.sdpa(t(q), t(k[:, :1]), t(v[:, :1]), enable_gqa=True),
          ref(q, np.repeat(k[:, :1], 2, 1), np.repeat(v[:, :1], 2, 1)), "sdpa gqa", atol=1e-5, rtol=1e-5)
    out, lse = platform.attention_block_forward(t(q), t(k), t(v), causal=True)
    close(out, ref(q, k, v, causal=True), "block forward", atol=1e-5, rtol=1e-5)
    g = inp("attg", 0, (1, 2, 5, 4))
    dq, dk, dv = platform.attention_block_backward(t(g), t(q), t(k), t(v), out, lse, causal=True)
    rq, rk, rv = grad_of(lambda a, b, c: (X.sdpa(a, b, c, causal=True) * t(g)).sum(), t(q), t(k), t(v))
    for name, got, want in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        close(got, want, f"block backward {name}", atol=1e-4, rtol=1e-4)
    return True
