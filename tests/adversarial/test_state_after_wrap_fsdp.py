"""fully_shard when state changes after wrapping, or ranks disagree about it (SPEC §19), against one
process: a parameter frozen / unfrozen / cast after fully_shard trains as one process does (values
after AdamW steps, gradients, clip_grad_norm_); what cannot be adopted raises the same ValueError
on every rank (checked by text): a weight tied across two units, top-down wrapping, an optimizer
built before fully_shard, a parameter replaced after wrapping, a sub-module of a unit called
without the unit, parameter shapes that differ across ranks at wrap time, a unit called a
different number of times per rank. One worker call runs the whole table (2 and 4 ranks)."""
import pytest

from tests.harness import run_dist

ADOPTED = ("frozen", "unfrozen", "retyped", "unit_alone", "kept_gathered")
REFUSED = {
    "tied": "is the same Parameter as 'up.weight' of the Block unit (another unit, which an earlier "
            "fully_shard call took)",
    "top_down": "is already sharded by an earlier fully_shard call on an enclosing module "
                "('blocks.0.up.weight' of the Net unit): fully_shard is applied bottom-up",
    "optimizer_first": "AdamW.step(): this optimizer holds parameter 'inp.weight' of the Net unit as it was "
                       "before fully_shard replaced it",
    "replaced": "fully_shard: parameter 'head.weight' now holds a Parameter of shape (3, 10), not the "
                "sharded parameter fully_shard installed",
    "added": "fully_shard: parameter 'blocks.1.extra' of Net was added after fully_shard: it is not sharded",
    "submodule_alone": "fully_shard: Linear computes with parameters of the Net unit, which are not "
                       "gathered: it was called outside that unit's forward",
    "shapes_differ": "fully_shard: the ranks of DeviceMesh",
    "calls_differ": "fully_shard unit call: the ranks of DeviceMesh",
    # one rank alone freezes a parameter after the ranks agreed: HP_CHECK_RANKS=every catches it
    "frozen_on_one_rank": "fully_shard: the ranks of DeviceMesh",
}

NAMED = {   # the setting the agreement errors name
    "shapes_differ": "parameters of unit 'blocks.0' (rank",
    "calls_differ": "call of the unit in this forward",
    "frozen_on_one_rank": "parameters of unit 'the root Net' (rank",
}


def _repeat_net():
    from tests import fully_shard_models as fm

    class RepeatNet(fm.Net):
        repeat_first = False

        def forward(self, x):
            h = self.blocks[0](self.inp(x))
            if self.repeat_first:
                h = self.blocks[0](h)
            return self.head(self.blocks[1](h))
    return RepeatNet()


def _mesh(world_size):
    from hyper_parallel import init_device_mesh
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",), timeout=30)


def _train(model, ref, rank, world_size, steps=2, dtype=None, clip=None, run=None):
    """AdamW steps side by side; every gradient, clip norm and weight compared."""
    import torch
    from tests import fully_shard_models as fm
    run = run or (lambda m, x: m(x))
    opt = torch.optim.AdamW([p for p in model.parameters()], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters()], lr=1e-2)
    for step in range(steps):
        x = (lambda r: fm.batch(step, r) if dtype is None else fm.batch(step, r).to(dtype))
        fm.loss_fn(run(model, x(rank))).backward()
        (sum(fm.loss_fn(run(ref, x(r))) for r in range(world_size)) / world_size).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            torch.testing.assert_close(fm.full(norm), torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), (name, step)
            if q.grad is not None:
                assert p.grad.dtype == q.grad.dtype, name
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, atol=1e-5, rtol=1e-5, msg=name)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, atol=1e-5, rtol=1e-5, msg=name)


def _adopted(case, rank, world_size):
    import torch
    from tests import fully_shard_models as fm
    ref, model = fm.net(), fm.net()
    if case == "unfrozen":
        model.blocks[0].up.weight.requires_grad_(False)
    model = fm.shard_net(model, _mesh(world_size))
    if case == "frozen":   # after wrapping: no gradient, not moved, not in the clip norm (one process)
        for m in (model, ref):
            m.blocks[0].up.weight.requires_grad_(False)
            m.head.bias.requires_grad_(False)
        return _train(model, ref, rank, world_size, clip=0.05)
    if case == "unfrozen":
        model.blocks[0].up.weight.requires_grad_(True)
        return _train(model, ref, rank, world_size)
    if case == "kept_gathered":   # the root's forward finds its unit gathered (unshard() before it)
        model.head.weight.requires_grad_(False)
        ref.head.weight.requires_grad_(False)

        def gathered_first(m, x):
            if hasattr(m, "unshard"):
                m.unshard()
            return m(x)
        return _train(model, ref, rank, world_size, run=gathered_first)
    if case == "retyped":
        model.double()
        ref.double()
        return _train(model, ref, rank, world_size, dtype=torch.float64)
    # a unit called on its own (no root forward): its gradients are those of one process

    def first_block(m, x):
        return m.blocks[0](x.repeat(1, 2)[:, :10])
    return _train(model, ref, rank, world_size, run=first_block)


def _refused(case, rank, world_size):
    import os
    import torch
    from hyper_parallel import fully_shard
    from tests import fully_shard_models as fm
    mesh = _mesh(world_size)
    model = fm.net()
    if case == "tied":
        model.blocks[1].up.weight = model.blocks[0].up.weight
    if case == "top_down":
        fully_shard(model, mesh)
        fully_shard(model.blocks[0], mesh)
    if case == "shapes_differ":   # rank 1's inner layer is wider: sizes would mismatch in gloo
        model = fm.net(inner=13 + (rank == 1))
    if case == "calls_differ":
        torch.manual_seed(0)
        model = _repeat_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if case == "optimizer_first" else None
    model = fm.shard_net(model, mesh)
    if case == "replaced":
        model.head.weight = torch.nn.Parameter(torch.zeros(3, 10))
    if case == "added":   # each rank would keep its own gradient of it
        model.blocks[1].extra = torch.nn.Parameter(torch.ones(3))
    x = fm.batch(0, rank)
    if case == "submodule_alone":
        return model.head(model.blocks[0](model.inp(x)))
    if case == "calls_differ":   # rank 0 runs block 0 twice, in the root's forward
        model.repeat_first = rank == 0
    if case == "frozen_on_one_rank":
        fm.loss_fn(model(x)).backward()
        if rank == 1:
            model.head.weight.requires_grad_(False)
        os.environ["HP_CHECK_RANKS"] = "every"
        try:
            return model(x)
        finally:
            del os.environ["HP_CHECK_RANKS"]
    fm.loss_fn(model(x)).backward()
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()


def _table(rank, world_size, cases):
    results = {}
    for case in cases:
        if case in ADOPTED:
            _adopted(case, rank, world_size)
            results[case] = "ok"
            continue
        try:
            _refused(case, rank, world_size)
            results[case] = "no error"
        except ValueError as exc:
            results[case] = str(exc)
    return results


@pytest.mark.parametrize("world_size, cases", [
    (2, ADOPTED + tuple(REFUSED)),
    (4, ("frozen", "shapes_differ")),   # uneven shards (rank 3 holds none of the head)
])
def test_state_changed_after_fully_shard(world_size, cases):
    for rank, results in enumerate(run_dist(world_size, _table, list(cases))):
        for case in cases:
            if case in ADOPTED:
                assert results[case] == "ok", (rank, case, results[case])
            else:
                assert REFUSED[case] in results[case], (rank, case, results[case])
                assert NAMED.get(case, "") in results[case], (rank, case, results[case])
