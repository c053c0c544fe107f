"""Tensor parallelism with feature sizes the TP size does not divide: uneven shards (torch.chunk
sizes, earlier ranks larger) that give the single-process forward and gradients exactly.

nn.Linear(10, 7) column-wise then nn.Linear(7, 5) row-wise on 4 ranks (the 7 hidden features
split 2, 2, 2, 1; 3 hidden features split 1, 1, 1, 0), with biases; an nn.Embedding with vocabulary 10 row-wise (rows 3, 3, 3, 1) and
one with embedding dim 10 column-wise; each on 2 and 4 ranks against the unsharded module.
"""
import pytest

from tests.harness import run_dist

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _grads_match(model, ref, what):
    import torch
    ref_grads = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{what}: {name} has no gradient"
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        torch.testing.assert_close(grad, ref_grads[name].grad, **TOL, msg=lambda m: f"{what} grad {name}: {m}")


def _mlp_case(rank, world_size):
    import copy

    import torch
    import torch.nn as nn
    from hyper_parallel import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module
    from hyper_parallel.core.dtensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    for hidden, out_layout in ((7, Replicate()), (7, Shard(1)), (3, Replicate())):
        # hidden 3 on 4 ranks: the last rank's shard is empty
        torch.manual_seed(hidden)
        ref = nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, 5))
        x = torch.randn(3, 4, 10)
        grad_out = torch.randn(3, 4, 5)
        out_ref = ref(x)
        (out_ref * grad_out).sum().backward()
        model = parallelize_module(copy.deepcopy(ref), mesh, {"0": ColwiseParallel(),
                                                              "2": RowwiseParallel(output_layouts=out_layout)})
        pieces = torch.arange(hidden).chunk(world_size)
        assert model[0].weight.to_local().shape[0] == (len(pieces[rank]) if rank < len(pieces) else 0)
        xin = x.clone().requires_grad_()
        out = model(xin)
        if out_layout == Replicate():
            want, g = out_ref, grad_out
        else:  # sequence 4 over the ranks: torch.chunk pieces
            pieces = torch.arange(4).chunk(world_size)
            rows = pieces[rank] if rank < len(pieces) else torch.arange(0)
            want, g = out_ref[:, rows], grad_out[:, rows]
        torch.testing.assert_close(out, want.detach(), **TOL)
        (out * g).sum().backward()
        _grads_match(model, ref, f"mlp -> {out_layout}")
        xin_ref = x.clone().requires_grad_()
        (ref(xin_ref) * grad_out).sum().backward()
        torch.testing.assert_close(xin.grad, xin_ref.grad, **TOL)
    return True


def _embedding_case(rank, world_size):
    import copy

    import torch
    import torch.nn as nn
    from hyper_parallel import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module
    from hyper_parallel.core.dtensor import Replicate

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(1)
    ids = torch.randint(0, 10, (2, 6))
    for vocab, dim, style in ((10, 8, RowwiseParallel()),
                              (12, 10, ColwiseParallel(output_layouts=Replicate())),
                              (12, 10, ColwiseParallel())):
        torch.manual_seed(2)
        ref = nn.Embedding(vocab, dim, padding_idx=3)
        grad_out = torch.randn(2, 6, dim)
        emb = parallelize_module(copy.deepcopy(ref), mesh, style)
        out = emb(ids)
        out_ref = ref(ids)
        g = grad_out
        if isinstance(style, ColwiseParallel) and style.output_layouts != Replicate():
            pieces = torch.arange(dim).chunk(world_size)
            cols = pieces[rank] if rank < len(pieces) else torch.arange(0)
            out_ref, g = out_ref[..., cols], grad_out[..., cols]
        torch.testing.assert_close(out, out_ref.detach(), **TOL)
        (out * g).sum().backward()
        # the reference gradient is that of the sum of every rank's loss
        (ref(ids) * grad_out).sum().backward()
        _grads_match(emb, ref, f"embedding {vocab}x{dim} {style}")

    # a style that cannot take a module names the module's path in the plan (before any collective)
    import pytest
    model = nn.Sequential(nn.ModuleDict({"attn": nn.Linear(4, 4), "norm": nn.LayerNorm(4)}))
    for plan in ({"0.norm": ColwiseParallel()}, {"0": {"n*": RowwiseParallel()}}):
        with pytest.raises(ValueError, match=r"module '0\.norm' \(LayerNorm\): RowwiseParallel|"
                                             r"module '0\.norm' \(LayerNorm\): ColwiseParallel"):
            parallelize_module(model, mesh, plan)
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_uneven_linear_colwise_rowwise(world_size):
    assert run_dist(world_size, _mlp_case) == [True] * world_size


@pytest.mark.parametrize("world_size", [4])
def test_uneven_embedding(world_size):
    assert run_dist(world_size, _embedding_case) == [True] * world_size
