"""fully_shard where ranks' data decide which parameters get a gradient (MoE routing): an expert one
rank routed nothing to still gets the other ranks' gradient in its shard on every rank (a presence
flag travels with the reduce-scatter), a parameter no rank reached keeps None as in one process, a
frozen parameter stays frozen, and units are reduced at the same point of backward on every rank
(after their inputs' gradients), not when "every parameter has its gradient" (which data decides):
two same-shaped units complete in different orders on the two ranks otherwise, and their
reduce-scatters would meet the wrong partner. A unit called twice in one forward reduces after both
calls' backward; under activation checkpointing (reentrant: the recomputation's own backward pass
ends inside the step's) the step's end is the outer backward's. Two AdamW steps against one
process."""
from tests.harness import run_dist


def _routed_net(unused_expert=False):
    import torch
    from torch import nn

    class Routed(nn.Module):
        """Rows with a positive first feature go to expert 1, the rest to expert 0; feature 0 passes
        through unchanged, so every unit downstream routes the same rows."""

        def __init__(self, h=6):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(h, h) for _ in range(3 if unused_expert else 2))

        def forward(self, x):
            keep = torch.ones(x.shape[-1])
            keep[0] = 0
            out = x
            for e, rows in enumerate(((x[:, 0] <= 0).nonzero().flatten(), (x[:, 0] > 0).nonzero().flatten())):
                if len(rows):
                    out = out.index_add(0, rows, self.experts[e](x[rows]) * keep)
            return out

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Routed(), Routed()])
            self.head = nn.Linear(6, 3)
            self.head.bias.requires_grad_(False)   # frozen

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    return Net()


def _routed_batch(step, index, rows=5):
    """Rank 0: both signs (every expert used); rank 1: only negative (expert 1 unused there)."""
    import torch
    g = torch.Generator().manual_seed(1000 * step + index)
    x = torch.randn(rows, 6, generator=g)
    x[:, 0] = x[:, 0].abs() * (torch.tensor([-1, -1, -1, 1, 1]) if index == 0 else -1)
    return x


def _twice_net():
    import torch
    from tests import fully_shard_models as fm

    class Twice(fm.Net):
        """Each block applied twice: one unit, two calls, two backwards before it may reduce."""

        def forward(self, x):
            h = self.inp(x)
            for block in self.blocks:
                h = block(block(h))
            return self.head(h)
    torch.manual_seed(0)
    return Twice()


def _checkpointed_net(reentrant):
    import torch
    from torch.utils.checkpoint import checkpoint
    from tests import fully_shard_models as fm

    class Checkpointed(fm.Net):
        """Each block under activation checkpointing: recomputed in backward, which (reentrant)
        runs a backward pass of its own inside the step's."""

        def forward(self, x):
            h = self.inp(x)
            for block in self.blocks:
                h = checkpoint(block, h, use_reentrant=reentrant)
            return self.head(h)
    torch.manual_seed(0)
    return Checkpointed()


def _in_place_net():
    import torch
    from tests import fully_shard_models as fm

    class InPlace(fm.Block):
        def forward(self, x):
            x.mul_(1.5)   # a unit that modifies its input in place (the hook must not make it a view)
            return super().forward(x)

    class Net(fm.Net):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(InPlace() for _ in range(2))
    torch.manual_seed(0)
    return Net()


def _routing_cases(rank, world_size):
    from hyper_parallel import init_device_mesh
    from tests.test_fully_shard import _train, _zero3
    mesh = init_device_mesh("cpu", (world_size,))
    for unused in (False, True):
        model = _train(_zero3(mesh), rank, world_size, model_fn=lambda: _routed_net(unused),
                       batch_fn=_routed_batch, what=f"routed (unused expert: {unused})")
        assert model.head.bias.grad is None
        if unused:
            assert model.blocks[0].experts[2].weight.grad is None   # no rank reached it: None, as in one process
    for reshard in (True, False):
        _train(_zero3(mesh, reshard_after_forward=reshard), rank, world_size, model_fn=_twice_net,
               what=f"unit called twice (reshard_after_forward={reshard})")
    for reentrant in (True, False):
        _train(_zero3(mesh), rank, world_size, model_fn=lambda: _checkpointed_net(reentrant),
               what=f"activation checkpointing (reentrant={reentrant})")
    _train(_zero3(mesh), rank, world_size, model_fn=_in_place_net, what="input modified in place")
    return True


def test_routed_experts_frozen_parameters_repeated_and_checkpointed_units_train_like_one_process():
    assert run_dist(2, _routing_cases, timeout=120) == [True, True]
