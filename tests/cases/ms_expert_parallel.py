"""MindSpore: ExpertParallel on a Cell holding stacked experts (the Hugging Face layout:
``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I), ``act_fn``), split over the ranks through the
platform's emulated list all-to-all (MindSpore CPU has no AlltoAll: docs/mindspore.md), against the
dense experts of every rank's tokens in one process: outputs, token / score gradients and this
rank's expert gradients (averaged over the ranks, ``average=True``), fp32 1e-5. Imported by
MindSpore workers only."""
import numpy as np

from tests.cases.expert_parallel import E, H, INTER, K, T, _dense, _routing
from tests.frameworks import close, grad_of, inp, np_of, t


def _cell():
    import mindspore as ms

    class StackedExperts(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = ms.Parameter(ms.Tensor(inp("ep_gu", 0, (E, 2 * INTER, H))),
                                             name="gate_up_proj")
            self.down_proj = ms.Parameter(ms.Tensor(inp("ep_d", 0, (E, H, INTER))), name="down_proj")

        @staticmethod
        def act_fn(a):
            return a * a

        def construct(self, hidden, index, weights):
            raise RuntimeError("replaced by ExpertParallel")
    return StackedExperts()


def cell_matches_dense(rank, world_size):
    import mindspore as ms
    from hyper_parallel import DTensor, ExpertParallel, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    cell = ExpertParallel().apply(_cell(), mesh)
    params = cell.trainable_params()
    local = E // world_size
    assert all(isinstance(p, DTensor) or tuple(p.shape)[0] == local for p in params), \
        [(p.name, p.shape) for p in params]
    index, g = t(_routing(rank)), t(inp("ep_g", rank, (T, H)))

    def loss(x, w):
        return (cell(x, index, w) * g).sum()
    x, w = t(inp("ep_x", rank, (T, H))), t(np.abs(inp("ep_w", rank, (T, K))))
    out = cell(x, index, w)
    _, (inputs, weights) = ms.value_and_grad(loss, grad_position=(0, 1), weights=params)(x, w)

    def dense_loss(gu, d, *xs_ws):
        total = 0
        for r in range(world_size):
            total = total + (_dense(xs_ws[2 * r], _routing(r), xs_ws[2 * r + 1], gu, d)
                             * t(inp("ep_g", r, (T, H)))).sum()
        return total
    dense = [t(inp("ep_gu", 0, (E, 2 * INTER, H))), t(inp("ep_d", 0, (E, H, INTER)))]
    for r in range(world_size):
        dense += [t(inp("ep_x", r, (T, H))), t(np.abs(inp("ep_w", r, (T, K))))]
    ref = grad_of(dense_loss, *dense)
    mine = slice(rank * local, (rank + 1) * local)
    close(out, np_of(_dense(dense[2 + 2 * rank], _routing(rank), dense[3 + 2 * rank], dense[0], dense[1])),
          "output")
    close(inputs[0], ref[2 + 2 * rank], "token gradient")
    close(inputs[1], ref[3 + 2 * rank], "score gradient")
    by_name = {p.name.split(".")[-1]: grad for p, grad in zip(params, weights)}
    close(by_name["gate_up_proj"], np_of(ref[0])[mine] / world_size, "gate_up gradient (averaged)")
    close(by_name["down_proj"], np_of(ref[1])[mine] / world_size, "down gradient (averaged)")
    return True
