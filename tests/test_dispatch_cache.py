"""The sharding-decision cache (core/dtensor/decision_cache.py): a repeated call evaluates no rule
and runs no meta tensors, and gives the same answers as the first call and as one device."""
from tests.harness import run_dist


def repeated_steps(rank, world_size):
    import torch
    import torch.nn.functional as F
    from hyper_parallel import Shard, Replicate, distribute_tensor, init_device_mesh, loss_parallel
    from hyper_parallel.core.dtensor.dispatch import decision_cache
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 6, generator=g), torch.randn(6, 10, generator=g)
    labels = torch.randint(0, 10, (8,), generator=g)

    def step():
        dx = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
        dw = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
        logits = (F.relu(dx + dx) @ dw * 2.0).redistribute(placements=[Shard(1)])
        with loss_parallel():
            loss = F.cross_entropy(logits, labels)
        loss.backward()
        return loss.full_tensor(), dx.grad.full_tensor(), dw.grad.full_tensor()

    rx, rw = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref_loss = F.cross_entropy(F.relu(rx + rx) @ rw * 2.0, labels)
    ref_loss.backward()
    evaluations = []
    for _ in range(3):
        loss, gx, gw = step()
        torch.testing.assert_close(loss, ref_loss.detach())
        torch.testing.assert_close(gx, rx.grad)
        torch.testing.assert_close(gw, rw.grad)
        evaluations.append(decision_cache.STATS["rule_evaluations"])
    # the first step decides; later steps only re-decide the loss (it reads loss_parallel())
    assert evaluations[2] - evaluations[1] == evaluations[1] - evaluations[0] <= 1, evaluations
    # a new signature is decided again (the pool's workers outlive tests: start from an empty cache)
    decision_cache.clear()
    dy = distribute_tensor(torch.randn(4, 6, generator=g), mesh, [Shard(0)])
    torch.testing.assert_close((dy + dy).full_tensor(), dy.full_tensor() * 2)
    assert decision_cache.STATS["rule_evaluations"] == 1, decision_cache.STATS
    torch.testing.assert_close((dy + dy).full_tensor(), dy.full_tensor() * 2)
    # the repeat is served by the fast path (fast_path.py) or, failing that, by the decision cache
    assert decision_cache.STATS["rule_evaluations"] == 1, decision_cache.STATS
    assert decision_cache.STATS["hits"] + decision_cache.STATS["fast_hits"] == 1, decision_cache.STATS
    # counts before this test depend on what each worker ran earlier: compare the increments
    return [b - a for a, b in zip(evaluations, evaluations[1:])]


def test_repeated_calls_evaluate_no_rule():
    results = run_dist(2, repeated_steps)
    assert results[0] == results[1]
