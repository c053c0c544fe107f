"""MindSpore: a scalar DTensor loss returned to ms.grad / ms.value_and_grad, and loss_parallel().

A Cell whose construct returns a DTensor scalar (the sum or mean of a sharded or Partial output)
must get the gradients of single-process MindSpore for every parameter and input: MindSpore
differentiates the object the function returns, so the DTensor's own data has to be part of the
graph (see platform/mindspore/dtensor_base.py, _ScalarLink).

Imported by MindSpore workers only.
"""
import numpy as np

from tests.frameworks import close, current, expect_error, inp, t

E, F = 4, 8


def _net(kind):
    import mindspore as ms
    from mindspore import mint, ops

    class Net(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = mint.nn.Linear(E, F), mint.nn.Linear(F, E)

        def construct(self, x):
            h = self.w1(x)
            if kind == "sharded sum":          # Shard(-1) output, summed: a Partial scalar
                return (h * h).sum()
            if kind == "sharded mean":
                return (h * h).mean()
            y = self.w2(ops.relu(h))             # Partial output of the Rowwise layer
            if kind == "partial sum":
                return (y * y).sum()
            return (y * y).mean() * 3.0          # "replicated mean": the Rowwise output reduced
    return Net()


def _plan(kind):
    from hyper_parallel import ColwiseParallel, Partial, RowwiseParallel
    if kind.startswith("sharded"):
        return {"w1": ColwiseParallel(use_local_output=False)}
    if kind == "partial sum":
        return {"w1": ColwiseParallel(),
                "w2": RowwiseParallel(output_layouts=Partial(), use_local_output=False)}
    return {"w1": ColwiseParallel(), "w2": RowwiseParallel(use_local_output=False)}


def dtensor_loss_gradients(rank, world_size):
    import mindspore as ms
    from hyper_parallel import DTensor, init_device_mesh, loss_parallel, parallelize_module
    fw = current()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    x = inp("msloss_x", 0, (3, E))
    for kind in ("sharded sum", "sharded mean", "partial sum", "replicated mean"):
        splits = {"w1.weight": 0, "w1.bias": 0}
        if not kind.startswith("sharded"):
            splits["w2.weight"] = 1
        ref, net = _net(kind), _net(kind)
        arrays = {n: inp(f"msloss{n}", 0, s) for n, s in fw.parameter_shapes(ref).items()}
        fw.set_parameters(ref, arrays)
        fw.set_parameters(net, arrays)
        parallelize_module(net, mesh, _plan(kind))
        v_ref, (dx_ref, g_ref) = ms.value_and_grad(ref, 0, ref.trainable_params())(t(x))
        v, (dx, g) = ms.value_and_grad(net, 0, net.trainable_params())(t(x))
        assert isinstance(v, DTensor), f"{kind}: the loss is a {type(v).__name__}"
        close(v.full_tensor(), v_ref.asnumpy(), f"{kind}: loss")
        close(dx, dx_ref.asnumpy(), f"{kind}: input gradient")
        close(ms.grad(net, 0)(t(x)), dx_ref.asnumpy(), f"{kind}: ms.grad input gradient")
        for p, want, got in zip(net.trainable_params(), g_ref, g):
            name = p.name
            want = want.asnumpy()
            if name in splits:
                want = np.split(want, world_size, splits[name])[rank]
            close(got, want, f"{kind}: gradient of {name}")
    expect_error(NotImplementedError, lambda: loss_parallel().__enter__(), "loss_parallel", "MindSpore")
    return True
