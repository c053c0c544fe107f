"""ContextParallel's backward is the derivative of its forward: ``torch.autograd.gradcheck`` (fp64, tiny
shapes) across modes, layouts (BSHD / BNSD), masks (causal, packed documents, padding), load
balance, overlap and GQA / MQA.

gradcheck perturbs its inputs on every rank in lockstep, so the function checked is a global one:
full q, k, v (the same on every rank) -> this rank's block (Replicate -> Shard, whose backward
all-gathers the gradient) -> the CP module -> the full output (all-gather, whose backward takes this
rank's block). Its Jacobian is that of single-device attention; a CP backward that disagrees with
its own forward (as dK/dV once did for swapped dims) fails here, whatever the forward gives.
Dims that do not name q's sequence and heads must be refused, not differentiated.
"""
import pytest

from tests.harness import run_dist

B, S, D = 1, 8, 2
MODES = {
    "ulysses": {}, "allgather": {"ulysses_degree": 1},
    "allgather_lb": {"ulysses_degree": 1, "load_balance": True},
    "ring": {"ulysses_degree": 1, "kv_exchange": "ring"},
    "zigzag": {"ulysses_degree": 1, "kv_exchange": "ring", "load_balance": True},
    "ulysses_overlap": {"overlap": True}, "allgather_overlap": {"ulysses_degree": 1, "overlap": True},
    "hybrid": {"ulysses_degree": 2}, "hybrid_ring": {"ulysses_degree": 2, "kv_exchange": "ring"},
}


def _core(layout, causal):
    import torch
    import torch.nn.functional as F

    class Core(torch.nn.Module):
        def forward(self, q, k, v):
            if layout == "bshd":
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)
            return out.transpose(1, 2) if layout == "bshd" else out
    return Core()


def _masks(kind):
    import torch
    from hyper_parallel import attention_masks
    if kind == "documents":
        return attention_masks(document_ids=torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]]), block_size=3)
    if kind == "padding":
        return attention_masks(padding_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0]]), block_size=3)
    import contextlib
    return contextlib.nullcontext()


def _check(mesh, mode, layout, heads, mask, causal):
    import torch
    from hyper_parallel import ContextParallel, DTensor, Replicate, Shard, parallelize_module

    seq, head = (1, 2) if layout == "bshd" else (2, 1)
    style = ContextParallel(seq_dim=seq, head_dim=head, **MODES[mode])
    core = parallelize_module(_core(layout, causal), mesh, style)

    def shape(h):
        return (B, S, h, D) if layout == "bshd" else (B, h, S, D)

    def attention(q, k, v):
        blocks = [DTensor.from_local(t, mesh, [Replicate()]).redistribute(mesh, [Shard(seq)]).to_local()
                  for t in (q, k, v)]
        with _masks(mask):
            out = core(*blocks)
        return DTensor.from_local(out, mesh, [Shard(seq)]).full_tensor()

    g = torch.Generator().manual_seed(11)
    inputs = [torch.randn(shape(h), generator=g, dtype=torch.float64, requires_grad=True)
              for h in (heads[0], heads[1], heads[1])]
    assert torch.autograd.gradcheck(attention, inputs, eps=1e-6, atol=1e-6, rtol=1e-5,
                                    fast_mode=mesh.size() > 2), (mode, layout, heads, mask, causal)


# (mode, layout, (q heads, kv heads), masks, causal)
CASES_2 = [
    ("ulysses", "bshd", (4, 2), None, True), ("ulysses", "bnsd", (2, 1), "documents", True),
    ("allgather", "bshd", (4, 4), None, True), ("allgather", "bnsd", (4, 1), "padding", False),
    ("allgather_lb", "bshd", (4, 2), None, True), ("allgather_lb", "bnsd", (2, 2), "documents", True),
    ("ring", "bshd", (4, 2), None, True), ("ring", "bnsd", (2, 1), "padding", True),
    ("ring", "bshd", (2, 2), None, False), ("zigzag", "bnsd", (4, 2), None, True),
    ("zigzag", "bshd", (2, 1), "documents", True), ("ulysses_overlap", "bshd", (4, 2), None, True),
    ("allgather_overlap", "bnsd", (4, 2), None, True),
]
CASES_4 = [
    ("ulysses", "bnsd", (4, 1), None, True), ("hybrid", "bshd", (4, 2), None, True),
    ("hybrid_ring", "bnsd", (4, 2), "documents", True), ("zigzag", "bshd", (2, 1), None, True),
]


def _sweep(rank, world_size, cases):
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    for case in cases:
        _check(mesh, *case)
    return len(cases)


@pytest.mark.parametrize("world_size,cases", [(2, CASES_2), (4, CASES_4)], ids=["cp2", "cp4"])
def test_cp_gradcheck_sweep(world_size, cases):
    assert run_dist(world_size, _sweep, cases, timeout=600) == [len(cases)] * world_size


def _swapped(rank, world_size):
    """BNSD dims on BSHD blocks, and the batch dim named as the sequence: refused on every rank in
    every mode that runs the kernel on DTensors (the ring reads the kernel's own dims and is right)."""
    import torch
    from hyper_parallel import ContextParallel, init_device_mesh, parallelize_module
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    q, k, v = (torch.randn(2, 6, 4, 2) for _ in range(3))   # this rank's BSHD block
    for dims in ((2, 1), (0, 2)):
        for mode in ("ulysses", "allgather", "allgather_lb", "ulysses_overlap"):
            core = parallelize_module(_core("bshd", True), mesh,
                                      ContextParallel(seq_dim=dims[0], head_dim=dims[1], **MODES[mode]))
            # the kernel's check, or (earlier) the seq_dim tracked to the kernel (core/attention/roles.py)
            with pytest.raises(ValueError, match="do not name q/k/v's sequence and head dims|"
                                                 r"seq_dim names a dim of query .* Use seq_dim=1"):
                core(q, k, v)
    return True


def test_swapped_dims_are_refused():
    assert run_dist(2, _swapped) == [True] * 2
