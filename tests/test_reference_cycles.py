"""A training step must not leave tensors in reference cycles: those are freed only when Python's
cyclic collector happens to run, so activations and gradients outlive the step (peak memory then
depends on the collector's timing). A recursive closure in the dispatcher's argument flattening
did that for every call with nested arguments (tensor lists: cat, the ring's exchanges)."""
import pytest

from tests.harness import run_dist

_MODES = {"ulysses": {}, "allgather": {"ulysses_degree": 1},
          "allgather-lb": {"ulysses_degree": 1, "load_balance": True},
          "ring": {"ulysses_degree": 1, "kv_exchange": "ring"},
          "zigzag": {"ulysses_degree": 1, "kv_exchange": "ring", "load_balance": True},
          "hybrid": {"ulysses_degree": 2}, "hybrid-ring": {"ulysses_degree": 2, "kv_exchange": "ring"}}


def _garbage_tensors(step):
    """Tensors the cyclic collector finds after ``step()`` (run once before, to warm caches)."""
    import gc
    import torch
    step()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        step()
        gc.collect()
        return sorted({type(o).__name__ for o in gc.garbage if isinstance(o, torch.Tensor)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def _cp_case(rank, world, masked):
    import torch
    import torch.nn.functional as F
    from hyper_parallel import ContextParallel, attention_masks, init_device_mesh

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    leaves = [torch.randn(1, 16, 4, 8).requires_grad_() for _ in range(3)]
    ids = (torch.arange(16 * world) * 2 // (16 * world)).unsqueeze(0)
    found = {}
    for name, style in _MODES.items():
        module = ContextParallel(seq_dim=1, head_dim=2, **style).apply(Attention(), mesh)

        def step():
            if masked:
                with attention_masks(document_ids=ids, block_size=8):
                    module(*leaves).sum().backward()
            else:
                module(*leaves).sum().backward()
        found[name] = _garbage_tensors(step)
    return found


def _tp_case(rank, world):
    import torch
    from hyper_parallel import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 8)
    return _garbage_tensors(lambda: model(x).sum().backward())


def _training_case(rank, world):
    """fully_shard (every block and the root) and data_parallel steps."""
    import torch
    from hyper_parallel import data_parallel, fully_shard, init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    found = {}
    for name in ("fully_shard", "data_parallel"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
                                      for _ in range(2)))
        if name == "fully_shard":
            for block in model:
                fully_shard(block, mesh)
            fully_shard(model, mesh)
        else:
            data_parallel(model, mesh)
        x = torch.randn(4, 8)
        found[name] = _garbage_tensors(lambda: model(x).sum().backward())
    return found


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "document_ids"])
def test_context_parallel_steps_leave_no_tensor_cycles(masked):
    for found in run_dist(4, _cp_case, masked, timeout=300):
        assert all(not v for v in found.values()), found


def test_tensor_parallel_step_leaves_no_tensor_cycles():
    for found in run_dist(2, _tp_case, timeout=120):
        assert not found, found


def test_fully_shard_and_data_parallel_steps_leave_no_tensor_cycles():
    for found in run_dist(2, _training_case, timeout=120):
        assert all(not v for v in found.values()), found
