"""Tensor parallelism on MindSpore Cells: a Colwise -> Rowwise MLP (mint.nn.Linear and nn.Dense)
vs the same MLP in one process, forward and the gradients of the input and every parameter.

Parameters of a parallelized Cell stay ``mindspore.Parameter`` objects (this rank's shard), so
``ms.value_and_grad(..., weights=cell.trainable_params())`` and optimizers work on them as usual.
"""
import numpy as np

from tests.mindspore.common import close, inp, t

E, F, TOKENS = 8, 12, (2, 3)
TOL = {"atol": 2e-5, "rtol": 2e-5}


def mlp(kind):
    import mindspore as ms
    from mindspore import mint, ops

    def linear(i, o):
        return mint.nn.Linear(i, o) if kind == "mint" else ms.nn.Dense(i, o)

    class MLP(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.w1 = linear(E, F)
            self.w2 = linear(F, E)

        def construct(self, x):
            return self.w2(ops.relu(self.w1(x)))
    return MLP()


def _set_params(cell, arrays):
    """The same deterministic weights in every copy (name -> array)."""
    for name, param in cell.parameters_and_names():
        param.set_data(t(arrays[name]))


def _arrays(cell):
    return {name: inp(f"tp{name}", 0, tuple(p.shape)) for name, p in cell.parameters_and_names()}


def colwise_rowwise(rank, world_size, kind):
    import mindspore as ms
    from hyper_parallel import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module
    from hyper_parallel.core.comm_mode import CommDebugMode
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    ref = mlp(kind)
    arrays = _arrays(ref)
    _set_params(ref, arrays)
    x = inp("tpx", 0, TOKENS + (E,))
    w_out = inp("tpw", 0, TOKENS + (E,))

    def loss_of(cell):
        return lambda xx: (cell(xx) * t(w_out)).sum()
    ref_out = ref(t(x))
    ref_fn = ms.value_and_grad(loss_of(ref), grad_position=0, weights=ref.trainable_params())
    _, (ref_dx, ref_dw) = ref_fn(t(x))
    ref_grads = {p.name: g.asnumpy() for p, g in zip(ref.trainable_params(), ref_dw)}

    cell = mlp(kind)
    _set_params(cell, arrays)
    parallelize_module(cell, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    names = sorted(n for n, _ in cell.parameters_and_names())
    with CommDebugMode() as comm:
        out = cell(t(x))
    assert type(out) is ms.Tensor, type(out)
    close(out, ref_out.asnumpy(), f"{kind} MLP forward", **TOL)
    assert comm.get_comm_counts() == {"all_reduce": 1}, comm.get_comm_counts()   # Megatron's g
    fn = ms.value_and_grad(loss_of(cell), grad_position=0, weights=cell.trainable_params())
    _, (dx, dw) = fn(t(x))
    close(dx, ref_dx.asnumpy(), f"{kind} MLP d input", **TOL)
    n, r = world_size, rank
    expected = {  # Colwise: weight rows (out features) and bias split; Rowwise: weight columns split
        "w1.weight": np.split(ref_grads["w1.weight"], n, 0)[r],
        "w1.bias": np.split(ref_grads["w1.bias"], n, 0)[r],
        "w2.weight": np.split(ref_grads["w2.weight"], n, 1)[r], "w2.bias": ref_grads["w2.bias"]}
    for p, g in zip(cell.trainable_params(), dw):
        close(g, expected[p.name], f"{kind} MLP d {p.name}", **TOL)
    # an optimizer step on the local Parameters, then the next forward sees the new weights
    opt = ms.nn.SGD(cell.trainable_params(), learning_rate=0.1)
    opt(dw)
    ref_opt = ms.nn.SGD(ref.trainable_params(), learning_rate=0.1)
    ref_opt(ref_dw)
    close(cell(t(x)), ref(t(x)).asnumpy(), f"{kind} MLP forward after an SGD step", **TOL)
    return names
