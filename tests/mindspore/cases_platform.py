"""The MindSpore platform surface besides collectives: selection, process groups, Cell hooks,
module checks, device/dtype/tensor helpers, make_autograd_function, meta shapes, attention."""
import numpy as np

from tests.mindspore.common import close, grad_of, inp, t


def selection_and_groups(rank, world_size):
    import mindspore as ms
    from hyper_parallel.platform import get_platform
    from hyper_parallel.platform.mindspore.platform import MindSporePlatform
    platform = get_platform()
    assert isinstance(platform, MindSporePlatform) and platform.name == "mindspore"
    assert platform.Tensor is ms.Tensor and platform.Module is ms.nn.Cell
    assert platform.Parameter is ms.Parameter
    assert platform.device_type == "cpu" and platform.default_backend == "mccl"
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
    from hyper_parallel import init_device_mesh
    if world_size == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        assert platform.group_ranks(mesh.get_group("b")) == (rank - rank % 2, rank - rank % 2 + 1)
    return True


def cell_hooks_and_modules(rank, world_size):
    import mindspore as ms
    from mindspore import mint
    from hyper_parallel.platform import get_platform
    platform = get_platform()
    assert platform.is_linear(ms.nn.Dense(2, 3)) and platform.is_linear(mint.nn.Linear(2, 3))
    assert not platform.is_linear(ms.nn.ReLU())
    assert platform.is_embedding(ms.nn.Embedding(5, 2)) and not platform.is_embedding(ms.nn.Dense(2, 3))

    class Scale(ms.nn.Cell):
        def construct(self, x, factor=1.0):
            return x * factor
    cell = Scale()
    calls = []

    def pre(mod, args, kwargs):
        calls.append(("pre", kwargs.get("factor")))
        return (args[0] + 1,), {"factor": 2.0}

    def post(mod, args, kwargs, output):
        calls.append(("post", kwargs.get("factor")))
        return output * 10
    h1 = platform.register_forward_pre_hook(cell, pre, with_kwargs=True)
    h2 = platform.register_forward_hook(cell, post, with_kwargs=True)
    out = cell(t(np.ones(2, np.float32)), factor=3.0)
    close(out, np.full(2, 40.0, np.float32), "hooks with kwargs")
    assert calls == [("pre", 3.0), ("post", 2.0)], calls
    h1.remove()
    h2.remove()
    close(cell(t(np.ones(2, np.float32))), np.ones(2, np.float32), "hooks removed")
    plain_pre = platform.register_forward_pre_hook(cell, lambda mod, args: (args[0] * 3,))
    close(cell(t(np.ones(2, np.float32))), np.full(2, 3.0, np.float32), "pre hook without kwargs")
    plain_pre.remove()
    # replace_forward routes calls through a wrapper and can be undone
    restore = platform.replace_forward(cell, lambda original: (lambda x, **kw: original(x, **kw) - 1))
    close(cell(t(np.ones(2, np.float32))), np.zeros(2, np.float32), "replace_forward")
    restore()
    close(cell(t(np.ones(2, np.float32))), np.ones(2, np.float32), "replace_forward restored")
    # named parameters / children / modules
    seq = ms.nn.SequentialCell([ms.nn.Dense(2, 3), ms.nn.ReLU()])
    assert [n for n, _ in platform.named_children(seq)] == ["0", "1"]
    assert [n for n, _ in platform.named_modules(seq)] == ["", "0", "1"]
    assert [n for n, _ in platform.named_parameters(seq.cell_list[0])] == ["weight", "bias"]
    return True


def tensor_helpers(rank, world_size):
    import mindspore as ms
    from hyper_parallel.platform import get_platform
    platform = get_platform()
    x = platform.tensor([1, 2, 3])
    assert platform.is_tensor(x) and tuple(x.shape) == (3,)
    assert platform.tensor([1.5]).dtype == ms.float32
    assert tuple(platform.zeros((2, 3), dtype=ms.float16).shape) == (2, 3)
    assert platform.arange(4).asnumpy().tolist() == [0, 1, 2, 3]
    close(platform.cat([t(np.ones((1, 2), np.float32)), t(np.zeros((2, 2), np.float32))], 0),
          np.array([[1, 1], [0, 0], [0, 0]], np.float32), "cat")
    assert platform.broadcast_shapes((2, 1), (3,)) == (2, 3)
    assert platform.bool_dtype() == ms.bool_ and platform.float32() == ms.float32
    assert platform.is_floating_point(t(np.ones(1, np.float32)))
    assert not platform.is_floating_point(t(np.ones(1, np.int32)))
    meta = platform.meta_tensor((2, 5), ms.float32)
    assert platform.is_tensor(meta) and meta.shape == (2, 5) and meta.ndim == 2
    assert platform.to_meta(t(np.ones((3, 1), np.float32))).shape == (3, 1)
    with platform.no_grad():
        assert not platform.is_grad_enabled()
    with platform.track_peak_memory() as m:
        _ = t(np.ones((256, 256), np.float32)) * 2
    assert m.peak_bytes >= 0 and platform.peak_memory_bytes() > 0
    platform.manual_seed(3)
    a = ms.ops.rand((2,)).asnumpy()
    platform.manual_seed(3)
    assert (ms.ops.rand((2,)).asnumpy() == a).all()
    caps = platform.capabilities()
    assert set(caps) >= {"backend", "all_gather", "all_reduce", "broadcast", "all_to_all_single",
                         "all_to_all (list)", "reduce_scatter", "p2p (batch_isend_irecv)"}
    return caps


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
    """The SDPA math vs numpy, masks with PyTorch's meaning, GQA, and the ring block kernels."""
    from hyper_parallel.platform import get_platform
    from hyper_parallel.platform.mindspore import scaled_dot_product_attention as sdpa
    platform = get_platform()
    q, k, v = (inp(f"att{i}", 0, (1, 2, 5, 4)) for i in range(3))

    def ref(q, k, v, mask=None, causal=False):
        s = q @ np.swapaxes(k, -1, -2) / 2.0
        if causal:
            s = np.where(np.tril(np.ones((5, 5), bool)), s, -np.inf)
        if mask is not None:
            s = np.where(mask, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ v
    close(sdpa(t(q), t(k), t(v)), ref(q, k, v), "sdpa", atol=1e-5, rtol=1e-5)
    close(sdpa(t(q), t(k), t(v), is_causal=True), ref(q, k, v, causal=True), "sdpa causal",
          atol=1e-5, rtol=1e-5)
    mask = np.random.RandomState(0).rand(5, 5) < 0.5
    mask |= np.eye(5, dtype=bool)
    close(sdpa(t(q), t(k), t(v), attn_mask=t(mask)), ref(q, k, v, mask), "sdpa bool mask",
          atol=1e-5, rtol=1e-5)
    close(platform.sdpa(t(q), t(k[:, :1]), t(v[:, :1]), enable_gqa=True),
          ref(q, np.repeat(k[:, :1], 2, 1), np.repeat(v[:, :1], 2, 1)), "sdpa gqa", atol=1e-5, rtol=1e-5)
    out, lse = platform.attention_block_forward(t(q), t(k), t(v), causal=True)
    close(out, ref(q, k, v, causal=True), "block forward", atol=1e-5, rtol=1e-5)
    g = inp("attg", 0, (1, 2, 5, 4))
    dq, dk, dv = platform.attention_block_backward(t(g), t(q), t(k), t(v), out, lse, causal=True)
    rq, rk, rv = grad_of(lambda a, b, c: (sdpa(a, b, c, is_causal=True) * t(g)).sum(), t(q), t(k), t(v))
    for name, got, want in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        close(got, want.asnumpy(), f"block backward {name}", atol=1e-4, rtol=1e-4)
    return True
