"""Ranks that disagree about a ContextParallel call (SPEC §19): generated table of setting x way to
disagree. In each case the last rank differs; every rank must raise a ValueError naming the setting,
and a collective afterwards must work (the ranks are in step). Meshes have timeout=20, so a case
that regresses to a hang fails within seconds instead of hanging the suite. Each case uses its own
sequence length, so it is the first call of its signature on every rank (the check's schedule)."""
import pytest

from tests.harness import run_dist

B, H, D = 1, 4, 4


class _Attention:
    """A BSHD core-attention module calling sdpa or hyper_parallel.attention with per-case options."""

    def __new__(cls, sdpa_kwargs=None, variant=None):
        import torch
        import torch.nn.functional as F
        import hyper_parallel as hp

        class Attention(torch.nn.Module):
            def forward(self, q, k, v):
                q, k, v = (x.transpose(1, 2) for x in (q, k, v))
                if variant is not None:
                    out = hp.attention(q, k, v, **variant)
                else:
                    out = F.scaled_dot_product_attention(q, k, v, **(sdpa_kwargs or {}))
                return out.transpose(1, 2)
        return Attention()


def _style_cases(world):
    """(name, style kwargs of most ranks, of the odd rank, fragment)."""
    ds = 2 if world == 4 else 1           # 4 ranks: the hybrid, whose groups hung before the check
    return [
        ("ulysses_degree", {}, {"ulysses_degree": ds}, "ulysses_degree (rank"),
        ("kv_exchange", {"ulysses_degree": 1}, {"ulysses_degree": 1, "kv_exchange": "ring"}, "kv_exchange"),
        ("load_balance", {"ulysses_degree": 1}, {"ulysses_degree": 1, "load_balance": True}, "load_balance"),
        ("dims", {}, {"seq_dim": 2, "head_dim": 1}, "head_dim"),
        ("mode", {}, {"mode": "auto"}, "mode"),
        ("overlap", {}, {"overlap": True}, "overlap"),
    ]


def _call_cases():
    """(name, what the odd rank does differently, fragment): applied per call."""
    return [
        ("grad", "no_grad", "grad mode"),
        ("masks_one_rank", "masks_only_here", "attention_masks"),
        ("masks_documents", "other_documents", "attention_masks documents"),
        ("masks_padding", "other_padding", "attention_masks padding"),
        ("requires_grad", "frozen_q", "requires_grad"),
        ("dtensor_q", "dtensor_q", "q/k/v kind"),
    ]


def _attention_cases():
    """(name, kwargs of most ranks, of the odd rank, fragment), sdpa unless 'variant'."""
    return [
        ("is_causal", {"is_causal": True}, {"is_causal": False}, "is_causal"),
        ("scale", {}, {"scale": 0.3}, "scale"),
        ("dropout", {}, {"dropout_p": 0.25}, "dropout_p"),
        ("attn_mask_one_rank", {}, {"attn_mask": "causal"}, "attn_mask"),
        ("attn_mask_contents", {"attn_mask": "causal"}, {"attn_mask": "band"}, "attn_mask contents"),
        ("softcap", {"variant": {"softcap": 20.0}}, {"variant": {"softcap": 30.0}}, "softcap"),
        ("softcap_nan", {"variant": {"softcap": 20.0}}, {"variant": {"softcap": float("nan")}}, "softcap"),
        ("window", {"variant": {"is_causal": True, "window": 3}}, {"variant": {"is_causal": True}}, "window"),
        ("sinks", {"variant": {"sinks": "heads"}}, {"variant": {}}, "sinks"),
        ("sinks_shape", {"variant": {"sinks": "heads"}}, {"variant": {"sinks": "wrong"}}, "sinks"),
        ("sinks_values", {"variant": {"sinks": "heads"}}, {"variant": {"sinks": "other"}}, "sinks values"),
        # the same NaN on every rank agrees, then is refused as a bad number on every rank
        ("softcap_nan_everywhere", {"variant": {"softcap": float("nan")}},
         {"variant": {"softcap": float("nan")}},
         "must be finite"),
    ]


def _blocks(torch, world, rank, S, grad=True):
    g = torch.Generator().manual_seed(S)
    full = [torch.randn(B, S, H, D, generator=g) for _ in range(3)]
    n = S // world
    return [x[:, rank * n:(rank + 1) * n].clone().requires_grad_(grad) for x in full]


def _in_step(torch, mesh, what):
    from hyper_parallel import DTensor, Shard
    x = torch.arange(2.0 * mesh.size()).reshape(mesh.size(), 2)
    me = mesh.get_local_rank(0)
    got = DTensor.from_local(x[me:me + 1], mesh, [Shard(0)]).full_tensor()
    assert torch.equal(got, x), f"out of step after {what}"


def _expect(fn, fragment, what):
    try:
        fn()
    except ValueError as exc:
        assert fragment in str(exc), f"{what}: ValueError without {fragment!r}: {exc}"
        return str(exc)
    raise AssertionError(f"{what}: no ValueError (expected one naming {fragment!r})")


def _mask(torch, kind, S):
    if kind == "causal":
        return torch.ones(S, S, dtype=torch.bool).tril()
    return torch.ones(S, S, dtype=torch.bool).tril().triu(-2)


def _odd_call(torch, mesh, rank, world, S, how):
    """Run one call where the odd rank does ``how`` differently."""
    import contextlib

    from hyper_parallel import ContextParallel, DTensor, Shard, attention_masks
    odd = rank == world - 1
    cell = _Attention({"is_causal": True})
    ContextParallel().apply(cell, mesh)
    q, k, v = _blocks(torch, world, rank, S, grad=not (odd and how == "frozen_q"))
    ids = torch.zeros(B, S, dtype=torch.long)
    ids[:, S // 2:] = 1
    pad = torch.ones(B, S, dtype=torch.bool)
    ctx = contextlib.nullcontext()
    if how == "no_grad" and odd:
        ctx = torch.no_grad()
    elif how == "masks_only_here":
        ctx = attention_masks(document_ids=ids) if odd else contextlib.nullcontext()
    elif how == "other_documents":
        ctx = attention_masks(document_ids=ids if not odd else torch.zeros_like(ids))
    elif how == "other_padding":
        pad[:, -1] = not odd
        ctx = attention_masks(padding_mask=pad)
    if how == "dtensor_q":   # every rank makes the DTensor (a collective); the odd one passes its local block
        q = DTensor.from_local(q, mesh, [Shard(1)])
        q = q.to_local() if odd else q
    with ctx:
        cell(q, k, v)


def _auto_cases(torch, mesh, rank, world_size, tmp):
    """mode='auto': options at apply, the grad mode and the calibration file's contents per call."""
    import contextlib

    from hyper_parallel import ContextParallel
    from hyper_parallel.core.context_parallel.auto.calibration import Machine
    odd = rank == world_size - 1
    path = f"{tmp}/calibration-{rank}.json"
    Machine(1e12, 1e9, 1e-5, 1e9 if not odd else 1e8, 1e-5).save(path)   # the odd rank: slower links
    same = f"{tmp}/calibration-same-{rank}.json"
    Machine(1e12, 1e9, 1e-5, 1e9, 1e-5).save(same)
    cases = [  # (name, style kwargs of most ranks, of the odd rank, grad off on the odd rank, fragment)
        ("causal", {"causal": True}, {"causal": False}, False, "causal (rank"),
        ("memory_budget", {}, {"memory_budget": 1e12}, False, "memory_budget"),
        ("calibration source", {"calibration": same}, {}, False, "calibration (rank"),
        ("calibration contents", {"calibration": path}, {"calibration": path}, False,
         "calibration file contents"),
        ("grad mode", {"calibration": same}, {"calibration": same}, True, "grad mode"),
    ]
    messages = {}
    for i, (name, kw, odd_kw, no_grad, fragment) in enumerate(cases):
        cell = _Attention({"is_causal": True})
        q, k, v = _blocks(torch, world_size, rank, 4 * world_size * (i + 40))

        def run():
            ContextParallel(mode="auto", tune=False, **(odd_kw if odd else kw)).apply(cell, mesh)
            with torch.no_grad() if (odd and no_grad) else contextlib.nullcontext():
                cell(q, k, v)
        messages[name] = _expect(run, fragment, name)
        _in_step(torch, mesh, name)
    return messages


def _cases(rank, world_size, which, tmp=None):
    import torch
    import torch.nn.functional  # noqa: F401
    from hyper_parallel import ContextParallel, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",), timeout=20)
    odd = rank == world_size - 1
    messages = {}
    S = 4 * world_size
    if which == "style":
        for i, (name, kw, odd_kw, fragment) in enumerate(_style_cases(world_size)):
            cell = _Attention({"is_causal": True})
            messages[name] = _expect(lambda: ContextParallel(**(odd_kw if odd else kw)).apply(cell, mesh),
                                     fragment, name)
            _in_step(torch, mesh, name)
    elif which == "call":
        for i, (name, how, fragment) in enumerate(_call_cases()):
            messages[name] = _expect(lambda: _odd_call(torch, mesh, rank, world_size, S * (i + 2), how),
                                     fragment, name)
            _in_step(torch, mesh, name)
    elif which == "auto":
        messages = _auto_cases(torch, mesh, rank, world_size, tmp)
    else:
        for i, (name, kw, odd_kw, fragment) in enumerate(_attention_cases()):
            n = S * (i + 20)
            mine = dict(odd_kw if odd else kw)
            if isinstance(mine.get("attn_mask"), str):
                mine["attn_mask"] = _mask(torch, mine["attn_mask"], n)
            variant = mine.pop("variant", None)
            if variant is not None and isinstance(variant.get("sinks"), str):
                sinks = {"heads": torch.zeros(H), "wrong": torch.zeros(H + 1), "other": torch.ones(H)}
                variant = dict(variant, sinks=sinks[variant["sinks"]])
            cell = _Attention(mine, variant)
            ContextParallel(ulysses_degree=1).apply(cell, mesh)
            q, k, v = _blocks(torch, world_size, rank, n)
            messages[name] = _expect(lambda: cell(q, k, v), fragment, name)
            _in_step(torch, mesh, name)
        # the split-phase call (start_attention ... finish) reaches the same check
        from hyper_parallel import start_attention
        cell = _Attention({"is_causal": not odd})
        ContextParallel().apply(cell, mesh)
        q, k, v = _blocks(torch, world_size, rank, S * 60)
        messages["start_attention"] = _expect(lambda: start_attention(cell, q, k, v).finish(), "is_causal",
                                              "start_attention")
        _in_step(torch, mesh, "start_attention")
    return messages


# 4 ranks by default where the world size changes what happens (the hybrid's groups, a 2-D choice of
# ranks); the attention and auto tables exchange the same message at any size: 4 ranks opt-in
_OPT_IN = {("attention", 4), ("auto", 4)}
CASES = [pytest.param(which, world, id=f"{which}-{world}",
                      marks=[pytest.mark.agreement_full] if (which, world) in _OPT_IN else [])
         for which in ("style", "call", "attention", "auto") for world in (2, 4)]


@pytest.mark.parametrize("which,world_size", CASES)
def test_contextparallel_disagreements_raise_on_every_rank(world_size, which, tmp_path):
    results = run_dist(world_size, _cases, which, str(tmp_path), timeout=240)
    for rank, messages in enumerate(results):
        for name, text in messages.items():
            if name != "softcap_nan_everywhere":
                assert "ContextParallel" in text and f"rank {rank} has" in text, (rank, name, text)


def _steady(rank, world_size):
    """A repeated identical call adds no check message; HP_CHECK_RANKS=every adds one per check
    point (the call's and its attention kernel's), and a one-sided change of a setting a rank
    verified before is then a ValueError on every rank (not a hang)."""
    import os

    import torch
    saved = os.environ.pop("HP_CP_DEBUG", None)   # the default schedule (the suite runs in CP debug mode)
    try:
        return _steady_counts(torch, world_size, rank)
    finally:
        if saved is not None:
            os.environ["HP_CP_DEBUG"] = saved


def _steady_counts(torch, world_size, rank):
    import os

    from hyper_parallel import ContextParallel, init_device_mesh
    from hyper_parallel.core.comm_mode import CommDebugMode
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",), timeout=20)
    cell = _Attention({"is_causal": True})
    ContextParallel(ulysses_degree=1).apply(cell, mesh)
    S = 4 * world_size * 50
    q, k, v = _blocks(torch, world_size, rank, S)
    with CommDebugMode() as first:
        cell(q, k, v)
    with CommDebugMode() as later:
        cell(q, k, v)
        cell(q, k, v)
    assert first.get_comm_counts().get("shape_check", 0) >= 2, first.get_comm_counts()
    assert "shape_check" not in later.get_comm_counts(), later.get_comm_counts()
    os.environ["HP_CHECK_RANKS"] = "every"
    try:
        with CommDebugMode() as every:
            cell(q, k, v)
        assert every.get_comm_counts().get("shape_check", 0) >= 2, every.get_comm_counts()
        # hyper_parallel.attention's settings: agreed once, then one rank alone changes softcap
        cap = [_Attention(variant={"softcap": 20.0 if rank != world_size - 1 or i == 0 else 30.0})
               for i in range(2)]
        for c in cap:
            ContextParallel(ulysses_degree=1).apply(c, mesh)
        cap[0](q, k, v)
        _expect(lambda: cap[1](q, k, v), "disagree on softcap", "one-sided change under every")
        _in_step(torch, mesh, "one-sided change")
        # sdpa's: the same module called again, its decision cached; one rank alone changes scale
        kwargs = {"is_causal": True}
        same = _Attention(kwargs)
        ContextParallel(ulysses_degree=1).apply(same, mesh)
        same(q, k, v)
        same(q, k, v)
        if rank == world_size - 1:
            kwargs["scale"] = 0.3
        _expect(lambda: same(q, k, v), "disagree on scale", "one-sided sdpa change under every")
        _in_step(torch, mesh, "one-sided sdpa change")
    finally:
        os.environ.pop("HP_CHECK_RANKS", None)
    return True


def test_steady_state_adds_no_check_and_every_checks_each_call():
    assert run_dist(2, _steady, timeout=120) == [True, True]
