"""The dispatch fast path (core/dtensor/fast_path.py): a repeated call with inputs already placed
runs as local op -> wrap. Each case runs a call once through the full dispatcher (caches cleared),
then again through the fast path (asserted by the ``fast_hits`` counter), and checks that both give
the same forward values, metadata and input gradients, equal to one device's."""
from tests.harness import run_dist

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _cases(torch):
    import torch.nn.functional as F
    from hyper_parallel import Replicate, Shard
    s0, r = (Shard(0),), (Replicate(),)
    return [  # label, fn, (placements of each input)
        ("add x + x", lambda x, w: x + x, (s0, r)),
        ("matmul x @ w", lambda x, w: x @ w, (s0, r)),
        ("relu", lambda x, w: torch.relu(x), (s0, r)),
        ("mul by scalar", lambda x, w: x * 2.0, (s0, r)),
        ("chain (x + x) @ w, relu, * 2", lambda x, w: torch.relu((x + x) @ w) * 2.0, (s0, r)),
        ("softmax with a kwarg", lambda x, w: F.softmax(x @ w, dim=-1), (s0, r)),
        ("replicated inputs (pass-through)", lambda x, w: torch.tanh(x @ w) - x, (r, r)),
        ("column split weight", lambda x, w: F.gelu(x @ w) + 1, (r, (Shard(1),))),
        # the matmul hands tanh's output a Partial(sum) gradient, which passes through tanh and
        # the mul to x's leaf hook (GradPassThrough)
        ("pass-through into a column split", lambda x, w: torch.tanh(x * 2.0) @ w, (r, (Shard(1),))),
        ("cast to float64", lambda x, w: (x * w[0]).to(torch.float64), (s0, r)),
        # the general path (three arguments, a keyword); x twice, then x thrice in one call (the
        # latter leaves autograd to the slow path's nodes: see fast_path._run_differentiable)
        ("addcmul x, x, x @ w", lambda x, w: torch.addcmul(x, x, x @ w, value=0.5), (s0, r)),
        ("addcmul x, x, x", lambda x, w: torch.addcmul(x, x, x, value=0.5), (s0, r)),
        ("x in four ops", lambda x, w: (x * 2.0 + torch.relu(x)) - torch.maximum(torch.tanh(x),
                                                                                 torch.sigmoid(x)), (s0, r)),
    ]


GRAD_MODES = (None, "x and w", "x only")   # which inputs require grad


def _run(fn, x, w, mesh, placements, grad):
    from hyper_parallel import distribute_tensor
    dx = distribute_tensor(x, mesh, list(placements[0])).requires_grad_(grad is not None)
    dw = distribute_tensor(w, mesh, list(placements[1])).requires_grad_(grad == "x and w")
    out = fn(dx, dw)
    meta = (type(out).__name__, tuple(out.shape), tuple(out.stride()), out.dtype, out.requires_grad,
            out.placements, tuple(out.to_local().shape), type(out.grad_fn).__name__, out.is_leaf)
    grads = None
    if grad:
        (out * out).sum().backward()
        grads = tuple(None if t.grad is None else t.grad.full_tensor() for t in (dx, dw)) + tuple(
            None if t.grad is None else t.grad.placements for t in (dx, dw))
    return out.full_tensor().detach(), meta, grads


def fast_equals_slow(rank, world_size):
    import torch
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.dtensor.dispatch import decision_cache
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4 * world_size, 8, generator=g), torch.randn(8, 8, generator=g)
    checked = []
    for label, fn, placements in _cases(torch):
        for grad in GRAD_MODES:
            decision_cache.clear()   # the first run takes the full dispatcher and records
            slow = _run(fn, x, w, mesh, placements, grad)
            assert decision_cache.STATS["fast_hits"] == 0, (label, decision_cache.STATS)
            evaluations = decision_cache.STATS["rule_evaluations"]
            fast = _run(fn, x, w, mesh, placements, grad)
            assert decision_cache.STATS["fast_hits"] > 0, (label, grad, decision_cache.STATS)
            assert decision_cache.STATS["rule_evaluations"] == evaluations, (label, decision_cache.STATS)
            assert fast[1] == slow[1], (label, grad, fast[1], slow[1])
            torch.testing.assert_close(fast[0], slow[0], atol=0, rtol=0)
            rx, rw = x.clone().requires_grad_(grad is not None), w.clone().requires_grad_(grad == "x and w")
            ref = fn(rx, rw)
            torch.testing.assert_close(fast[0], ref.detach(), **TOL)
            if grad:
                (ref * ref).sum().backward()
                assert fast[2][2:] == slow[2][2:], (label, fast[2][2:], slow[2][2:])
                for got, want, ref_grad in zip(fast[2][:2], slow[2][:2], (rx.grad, rw.grad)):
                    assert (got is None) == (want is None) == (ref_grad is None), label
                    if got is not None:
                        torch.testing.assert_close(got, want, atol=0, rtol=0)
                        torch.testing.assert_close(got, ref_grad, **TOL)
            checked.append((label, grad))
    return checked


def test_fast_path_equals_slow_path_and_one_device():
    results = run_dist(2, fast_equals_slow)
    assert results[0] == results[1] and len(results[0]) == 13 * len(GRAD_MODES)


def fast_path_boundaries(rank, world_size):
    """Calls the fast path must leave to the full dispatcher, and a leaf used without autograd."""
    import torch
    from hyper_parallel import Replicate, Shard, distribute_tensor, init_device_mesh
    from hyper_parallel.core.dtensor.dispatch import decision_cache
    mesh = init_device_mesh("cpu", (world_size,))
    x = torch.arange(4.0 * world_size * 6).reshape(4 * world_size, 6)
    dx = distribute_tensor(x, mesh, [Shard(0)])
    decision_cache.clear()
    seen = []
    # a plain tensor argument, a view op and an input that must move: never fast
    for label, fn, ref in (("plain tensor argument", lambda t: t + torch.ones(6), x + 1),
                           ("view op", lambda t: t.view(-1), x.view(-1)),
                           ("input that moves", lambda t: t.redistribute(placements=[Replicate()]) + t,
                            x * 2)):
        for _ in range(3):
            torch.testing.assert_close(fn(dx).full_tensor(), ref)
        seen.append((label, decision_cache.STATS["fast_hits"]))
        assert decision_cache.STATS["fast_hits"] == 0, (label, decision_cache.STATS)
    # a new DTensor with an equal layout hits at once (its spec is interned on the first miss)
    (dx * 3.0).full_tensor()
    hits = decision_cache.STATS["fast_hits"]
    dy = distribute_tensor(x + 1, mesh, [Shard(0)])
    torch.testing.assert_close((dy * 3.0).full_tensor(), (x + 1) * 3.0)
    assert decision_cache.STATS["fast_hits"] == hits + 1, decision_cache.STATS
    # a leaf used under no_grad, then with autograd: its gradient keeps the leaf's layout
    leaf = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    with torch.no_grad():
        for _ in range(2):
            out = leaf * 3.0
            assert not out.requires_grad
    (leaf * 3.0).sum().backward()
    assert leaf.grad.placements == (Shard(0),), leaf.grad.placements
    torch.testing.assert_close(leaf.grad.full_tensor(), torch.full_like(x, 3.0))
    return seen


def test_fast_path_boundaries():
    results = run_dist(2, fast_path_boundaries)
    assert results[0] == results[1]


def _slow_then_fast(torch, build):
    """``build()`` once through the full dispatcher (caches cleared), then again through the fast
    path; both results (flat lists of tensors / values) must be identical."""
    from hyper_parallel.core.dtensor.dispatch import decision_cache
    decision_cache.clear()
    slow = build()
    assert decision_cache.STATS["fast_hits"] == 0, (build.__name__, decision_cache.STATS)
    fast = build()
    assert decision_cache.STATS["fast_hits"] > 0, (build.__name__, decision_cache.STATS)
    assert len(fast) == len(slow)
    for got, want in zip(fast, slow):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
        else:
            assert got == want, (got, want)
    return slow


def fast_autograd_semantics(rank, world_size):
    """What autograd offers on an intermediate result (retain_grad, hooks, torch.autograd.grad,
    in-place updates, no_grad, detach) works the same through the fast path's nodes."""
    import torch
    from hyper_parallel import Replicate, Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4 * world_size, 8, generator=g), torch.randn(8, 8, generator=g)

    def leaves():
        return (distribute_tensor(x, mesh, [Shard(0)]).requires_grad_(),
                distribute_tensor(w, mesh, [Replicate()]).requires_grad_())

    def retain_and_hook():
        dx, dw = leaves()
        y = dx @ dw
        y.retain_grad()
        z = torch.relu(y) * 2.0
        z.register_hook(lambda grad: grad * 3.0)
        (z * z).sum().backward()
        return [y.grad.full_tensor(), dx.grad.full_tensor(), dw.grad.full_tensor(), y.grad.placements]

    def grad_of_intermediate():
        dx, dw = leaves()
        y = dx + dx
        z = (y @ dw) * 2.0
        gy, gw = torch.autograd.grad((z * z).sum(), [y, dw])
        return [gy.full_tensor(), gw.full_tensor(), gy.placements, gw.placements]

    def in_place_on_output():
        dx, dw = leaves()
        y = dx * 2.0
        y.add_(1.0)     # the aten level, on the fast path's output
        z = y @ dw
        (z * z).sum().backward()
        return [y.full_tensor().detach(), dx.grad.full_tensor(), dw.grad.full_tensor(),
                type(y.grad_fn).__name__]

    def no_grad_and_detached():
        dx, dw = leaves()
        with torch.no_grad():
            a = torch.relu(dx)
        b = dx.detach() * 2.0
        c = dx.detach() @ dw     # only w requires grad
        return [a.requires_grad, a.grad_fn is None, b.requires_grad, c.requires_grad,
                type(c.grad_fn).__name__, a.full_tensor(), c.full_tensor().detach()]

    checked = []
    for build in (retain_and_hook, grad_of_intermediate, in_place_on_output, no_grad_and_detached):
        _slow_then_fast(torch, build)
        checked.append(build.__name__)
    for got, want in zip(retain_and_hook()[:3], _retain_and_hook_on_one_device(torch, x, w)):
        torch.testing.assert_close(got, want, **TOL)
    return checked


def _retain_and_hook_on_one_device(torch, x, w):
    rx, rw = x.clone().requires_grad_(), w.clone().requires_grad_()
    ry = rx @ rw
    ry.retain_grad()
    rz = torch.relu(ry) * 2.0
    rz.register_hook(lambda grad: grad * 3.0)
    (rz * rz).sum().backward()
    return ry.grad, rx.grad, rw.grad


def test_fast_path_autograd_semantics():
    results = run_dist(2, fast_autograd_semantics)
    assert results[0] == results[1] and len(results[0]) == 4


def operator_methods(rank, world_size):
    """``x + y``, ``x - y``, ``x * s``, ``x / s``, ``x @ w`` ask the fast path before torch parses
    the arguments (platform/torch/dtensor_base.py ``_operator``); anything but a plain hit takes
    torch's route, so results, errors and the aten level under DisableTorchFunctionSubclass are
    what they were."""
    import torch
    from hyper_parallel import Replicate, Shard, distribute_tensor, init_device_mesh
    from hyper_parallel.core.dtensor.dispatch import decision_cache
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(2)
    x, y, w = (torch.randn(4 * world_size, 8, generator=g), torch.randn(4 * world_size, 8, generator=g),
               torch.randn(8, 8, generator=g))
    dx, dy = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(y, mesh, [Shard(0)])
    dw = distribute_tensor(w, mesh, [Replicate()])
    cases = {"x + y": (lambda: dx + dy, x + y), "x - y": (lambda: dx - dy, x - y),
             "x * 3": (lambda: dx * 3.0, x * 3.0), "x / 4": (lambda: dx / 4.0, x / 4.0),
             "x @ w": (lambda: dx @ dw, x @ w), "x.__add__(y, alpha=2)": (lambda: dx.__add__(dy, alpha=2.0),
                                                                          x + 2.0 * y)}
    decision_cache.clear()
    for label, (fn, want) in cases.items():
        first = fn()
        hits = decision_cache.STATS["fast_hits"]
        second = fn()
        if "alpha" not in label:   # a keyword: torch's route (the general path then hits)
            assert decision_cache.STATS["fast_hits"] == hits + 1, (label, decision_cache.STATS)
        for got in (first, second):
            assert type(got).__name__ == "DTensor" and got.placements == first.placements, label
            torch.testing.assert_close(got.full_tensor(), want, atol=0, rtol=0)
    # not a plain value: torch's NotImplemented -> TypeError, as for a plain tensor
    for bad in ("text", [1.0]):
        try:
            dx + bad
        except TypeError:
            pass
        else:
            raise AssertionError(f"DTensor + {bad!r} did not raise TypeError")
    # torch functions off: the aten level, as before (no fast hit)
    hits = decision_cache.STATS["fast_hits"]
    with torch._C.DisableTorchFunctionSubclass():
        z = dx + dy
    assert decision_cache.STATS["fast_hits"] == hits, decision_cache.STATS
    torch.testing.assert_close(z.full_tensor(), x + y, atol=0, rtol=0)
    return sorted(cases)


def test_operator_methods():
    results = run_dist(2, operator_methods)
    assert results[0] == results[1] and len(results[0]) == 6
