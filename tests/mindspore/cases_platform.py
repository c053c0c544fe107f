"""The MindSpore-specific platform surface: selection and types, Cell hooks, module checks,
device/dtype/tensor helpers, meta shapes. (Process groups, make_autograd_function and the attention
kernels run on every platform: tests/cases/platform_surface.py.)"""
import numpy as np

from tests.frameworks import close, t


def selection(rank, world_size):
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
