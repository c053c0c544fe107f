"""tiled_mlp and offload_activations on any framework (imported by torch AND MindSpore workers: no
torch, no pytest): an MLP's input and parameter gradients equal the plain MLP's, tiled and offloaded."""
from tests.frameworks import close, current, inp, t

DIM, HIDDEN, SEQ = 8, 24, 12


def _mlp():
    fw = current()
    cell = fw.mlp("mint" if fw.name == "mindspore" else "linear", DIM, HIDDEN)
    fw.set_parameters(cell, {name: inp(f"lt_{name}", 0, shape)
                             for name, shape in fw.parameter_shapes(cell).items()})
    return cell


def tiled_and_offloaded_match_plain(rank, world_size):
    from hyper_parallel import offload_activations, tiled_mlp
    fw = current()
    x, upstream = inp("lt_x", 0, (2, SEQ, DIM)), inp("lt_up", 0, (2, SEQ, DIM))
    plain, tiled = _mlp(), tiled_mlp(_mlp(), 5)
    stats = []

    def offloaded_loss(x):
        with offload_activations() as s:
            stats.append(s)
            return (plain(x) * t(upstream)).sum()
    want = fw.grads_then_sgd(plain, lambda x: (plain(x) * t(upstream)).sum(), t(x), lr=0.0)
    for what, cell, loss in (("tiled", tiled, lambda x: (tiled(x) * t(upstream)).sum()),
                             ("offloaded", plain, offloaded_loss)):
        dx, grads = fw.grads_then_sgd(cell, loss, t(x), lr=0.0)
        close(dx, want[0], f"{what} d input", rtol=1e-5, atol=1e-5)
        for name, g in want[1].items():
            close(grads[name], g, f"{what} d {name}", rtol=1e-5, atol=1e-5)
    assert stats[0].offloaded > 0 and stats[0].restored == stats[0].offloaded, stats[0]
    return stats[0].offloaded
