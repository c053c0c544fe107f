"""ContextParallel(mode="auto"): the mode chosen per shape signature from the calibrated cost model.

- every rank makes the same choice, the chosen mode is exact (forward and gradients vs one device)
  and is the candidate with the lowest predicted time; ``last_choice`` reports every candidate;
- modes that cannot run (q heads the Ulysses degree does not divide, load balancing with an odd
  block, the ring with q and k/v of different lengths) are never offered;
- ``memory_budget`` removes the candidates holding more k/v; none left is a ValueError on every rank;
- a calibration file (``--calibrate``) steers the choice: slow links favour the mode that sends
  least, a slow kernel the balanced ones;
- arguments that conflict with ``mode="auto"`` are refused.
"""
import pytest

from tests.harness import run_dist


def _core(causal=True):
    import torch
    import torch.nn.functional as F

    class Core(torch.nn.Module):
        def forward(self, q, k, v):
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa).transpose(1, 2)
    return Core()


def _exact(mesh, heads, kv_heads, seq, **kwargs):
    import torch
    from hyper_parallel import ContextParallel, parallelize_module
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, seq, h, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    ref = _core()(q, k, v)
    grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    style = ContextParallel(mode="auto", **kwargs)
    core = parallelize_module(_core(), mesh, style)
    n, r = mesh.size(), mesh.get_local_rank()
    block = slice(r * seq // n, (r + 1) * seq // n)
    local = [t.detach()[:, block].clone().requires_grad_() for t in (q, k, v)]
    out = core(*local)
    torch.testing.assert_close(out, ref[:, block].detach())
    grads = torch.autograd.grad(out, local, grad[:, block])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want[:, block])
    choice = style.last_choice
    # the fastest predicted, or where close ones were timed on the call's shapes, the fastest timed
    ranked = choice.measured_seconds or choice.predicted_seconds
    assert choice.mode == min(ranked, key=lambda m: (ranked[m], m))
    return choice.mode, sorted(choice.predicted_seconds)


def _auto_cases(rank, world_size):
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    out = {"mha": _exact(mesh, 4, 4, 16), "odd_heads": _exact(mesh, 3, 3, 16), "gqa": _exact(mesh, 4, 1, 8)}
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_auto_is_exact_and_the_same_on_every_rank(world_size):
    results = run_dist(world_size, _auto_cases)
    assert all(r == results[0] for r in results), results
    chosen, offered = results[0]["odd_heads"]
    assert "ulysses" not in offered and chosen != "ulysses"   # 3 heads do not split over the ranks
    if world_size == 4:
        assert any(name.startswith("hybrid") for name in results[0]["mha"][1]), results[0]["mha"]


def _budget_and_calibration(rank, world_size, tmp):
    import torch
    from hyper_parallel import ContextParallel, init_device_mesh, parallelize_module
    from hyper_parallel.core.context_parallel.auto.calibration import Machine

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    q = torch.randn(1, 64, 4, 8)
    free = ContextParallel(mode="auto")
    parallelize_module(_core(), mesh, free)(q, q, q)
    held = free.last_choice.held_bytes
    budget = min(held.values()) + 1
    tight = ContextParallel(mode="auto", memory_budget=budget)
    parallelize_module(_core(), mesh, tight)(q, q, q)
    assert all(held[m] <= budget for m in tight.last_choice.predicted_seconds)
    assert tight.last_choice.over_budget, tight.last_choice
    with pytest.raises(ValueError, match="no mode fits memory_budget"):
        parallelize_module(_core(), mesh, ContextParallel(mode="auto", memory_budget=1))(q, q, q)
    chosen = {}
    for name, machine in {"slow_links": Machine(1e15, 1e3, 1e-3, 1e3, 1e-3),
                          "slow_kernel": Machine(1e3, 1e15, 0.0, 1e15, 0.0)}.items():
        path = f"{tmp}/{name}-{rank}.json"
        machine.save(path)
        style = ContextParallel(mode="auto", calibration=path, tune=False)   # the cost model's own choice
        parallelize_module(_core(), mesh, style)(q, q, q)
        chosen[name] = style.last_choice.mode
    return chosen


def test_memory_budget_and_calibration_steer_the_choice(tmp_path):
    results = run_dist(2, _budget_and_calibration, str(tmp_path))
    assert all(r == results[0] for r in results)
    # links cost everything: the fewest bytes and collectives. At P = 2 with as many k/v heads as q
    # heads, Ulysses and all-gather KV send the same bytes (closed forms); the ring sends dK/dV
    # back too and load balancing adds an exchange, so neither may win
    assert results[0]["slow_links"] in ("allgather", "ulysses"), results[0]
    # the kernel costs everything: a balanced mode, never all-gather without load balancing
    assert results[0]["slow_kernel"] in ("ulysses", "allgather-lb", "ring-zigzag"), results[0]


def test_candidates_are_only_modes_that_run():
    from hyper_parallel.core.context_parallel.auto.cost_model import CallShape, candidates
    shape = CallShape(batch=1, q_len=20, kv_len=20, q_heads=6, kv_heads=2, head_dim=8, v_head_dim=8,
                      itemsize=4, causal=True)
    names = {c.name for c in candidates(shape, 4)}
    assert "ulysses" not in names and "hybrid(ds=2)" in names and "ring-zigzag" not in names  # 6 % 4, 5 odd
    cross = CallShape(1, 16, 32, 4, 4, 8, 8, 4, False)
    assert not any(c.kv_exchange == "ring" for c in candidates(cross, 2))


def test_conflicting_arguments_are_refused():
    from hyper_parallel import ContextParallel
    for kwargs in ({"ulysses_degree": 1}, {"load_balance": True}, {"kv_exchange": "ring"}):
        with pytest.raises(ValueError, match="mode='auto' chooses"):
            ContextParallel(mode="auto", **kwargs)
    for kwargs in ({"memory_budget": 10}, {"tune": False}):
        with pytest.raises(ValueError, match="only apply to mode='auto'"):
            ContextParallel(**kwargs)
    with pytest.raises(ValueError, match="mode='fast' is not supported"):
        ContextParallel(mode="fast")


def _hf_auto(rank, world_size):
    import torch
    import torch.nn.functional as F
    from hyper_parallel import data_parallel, get_platform, init_device_mesh, shard_sequence
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_zoo import VOCAB, tiny

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    count = (labels != -100).sum()
    reference = tiny("llama")
    logits = reference(input_ids=ids).logits.flatten(0, 1)
    ref = F.cross_entropy(logits, labels.flatten(), reduction="sum") / count
    ref.backward()
    model = parallelize_model(tiny("llama"), mesh, cp_mode="auto")
    data_parallel(model, mesh, average=False)
    local_ids, local_labels = shard_sequence([ids, labels], mesh)
    logits = model(input_ids=local_ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), local_labels.flatten(), reduction="sum") / count
    loss.backward()
    torch.testing.assert_close(get_platform().all_reduce(loss.detach(), mesh.get_group()), ref.detach())
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    choice = model._hp_cp_attention.style.last_choice
    assert choice is not None and choice.mode in choice.predicted_seconds
    return choice.mode


def test_parallelize_model_cp_mode_auto():
    pytest.importorskip("transformers")
    results = run_dist(2, _hf_auto)
    assert all(r == results[0] for r in results)


def test_contention_and_overlap_calibrate_imbalance_and_the_rings_hops(tmp_path):
    """Where ranks share cores (contention 2: a rank computing alone runs twice as fast), all-gather's
    causal imbalance of 1.75 at P = 4 costs nothing, so load balancing is not predicted faster; with
    their own devices it is. Where a transfer cannot hide under compute (overlap 0), the ring pays
    compute + hops; where it hides fully (overlap 1), the larger of the two. An older calibration
    file without these numbers still loads (both default to dedicated devices)."""
    import json
    from hyper_parallel.core.context_parallel.auto.calibration import Machine
    from hyper_parallel.core.context_parallel.auto.cost_model import CallShape, Candidate, predict
    shape = CallShape(1, 4096, 4096, 8, 8, 64, 64, 4, True)
    plain = Candidate("allgather", 1, "allgather", False)
    balanced = Candidate("allgather-lb", 1, "allgather", True)
    ring = Candidate("ring", 1, "ring", False)

    def machine(**kw):
        return Machine(flops=1e9, ds_bandwidth=1e9, ds_latency=0.0, co_bandwidth=1e9, co_latency=0.0, **kw)
    for contention, lb_faster in ((1.0, True), (2.0, False)):
        m = machine(contention=contention)
        assert (predict(shape, 4, balanced, m)[0] < predict(shape, 4, plain, m)[0]) == lb_faster, contention
    shared = predict(shape, 4, ring, machine(overlap=0.0))[0]
    hidden = predict(shape, 4, ring, machine(overlap=1.0))[0]
    gathered = predict(shape, 4, plain, machine())[0]   # the same compute, the hops' bytes / 1.5
    assert shared > gathered > hidden
    old = tmp_path / "old.json"
    values = {"flops": 1e9, "ds_bandwidth": 1e9, "ds_latency": 0.0, "co_bandwidth": 1e9, "co_latency": 0.0}
    old.write_text(json.dumps(values))
    loaded = Machine.load(str(old))
    assert loaded.contention == 1.0 and loaded.overlap == 1.0


def _tuning(rank, world_size, tmp):
    """Every candidate predicted alike (a calibration with free compute and links): the shortlist is
    timed on the call's shapes and the fastest timed runs; tune=False keeps the prediction's pick."""
    import torch
    from hyper_parallel import ContextParallel, init_device_mesh, parallelize_module
    from hyper_parallel.core.context_parallel.auto import tuning
    from hyper_parallel.core.context_parallel.auto.calibration import Machine

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    path = f"{tmp}/free-{rank}.json"
    Machine(1e30, 1e30, 0.0, 1e30, 0.0).save(path)
    calls = []

    class Counted(torch.nn.Module):
        def forward(self, q, k, v):
            calls.append(1)
            return _core()(q, k, v)

    q = torch.randn(1, 16, 4, 8)
    styles = [ContextParallel(mode="auto", calibration=path) for _ in range(2)]
    for style in styles:
        parallelize_module(Counted(), mesh, style)(q, q, q)
    assert len(calls) == 2   # the timing ran a stand-in, never the user's module
    first, second = (s.last_choice for s in styles)
    assert list(first.measured_seconds) == tuning.shortlist(first.predicted_seconds)
    assert len(first.measured_seconds) == min(tuning.SHORTLIST, len(first.predicted_seconds))
    assert first.mode == min(first.measured_seconds, key=first.measured_seconds.get)
    assert second.measured_seconds == first.measured_seconds   # one timing per mesh and signature
    for context in (torch.no_grad, torch.inference_mode):   # no backward to time: the prediction's pick
        with context():
            q2 = torch.randn(1, 24, 4, 8)
            style = ContextParallel(mode="auto", calibration=path)
            out = parallelize_module(_core(), mesh, style)(q2, q2, q2)
        assert not style.last_choice.measured_seconds and out.shape == q2.shape
    untuned = ContextParallel(mode="auto", calibration=path, tune=False)
    parallelize_module(_core(), mesh, untuned)(q, q, q)
    assert not untuned.last_choice.measured_seconds
    assert untuned.last_choice.mode == min(untuned.last_choice.predicted_seconds,
                                           key=lambda m: (untuned.last_choice.predicted_seconds[m], m))
    return first.mode, first.measured_seconds


def test_close_candidates_are_timed_and_the_fastest_runs(tmp_path):
    results = run_dist(2, _tuning, str(tmp_path))
    assert all(r == results[0] for r in results), results   # timings are the slowest rank's: one pick


def test_calibrated_collective_rates_round_trip(tmp_path):
    """The per-group collective rates survive a calibration file, and a kind that was not measured
    falls back to the pair's all-reduce numbers."""
    from hyper_parallel.core.context_parallel.auto.calibration import Machine
    machine = Machine(1e9, 2e9, 1e-5, 1e9, 2e-5, collectives=(("all_gather/co/4", 3e-9, 4e-5),))
    path = str(tmp_path / "m.json")
    machine.save(path)
    loaded = Machine.load(path)
    assert loaded.rate("all_gather", "co", 4) == (3e-9, 4e-5)
    assert loaded.rate("all_to_all", "ds", 4) == (1 / 2e9, 1e-5)
    assert loaded == machine
