"""How a Hugging Face model under context parallelism may be called (SPEC §19): every call either equals the
model in one process or raises a ValueError on every rank naming the fix. Calls that skip the wrapped
model's hooks, an attention implementation switched after wrapping, ``logits_to_keep``, a pooling head,
ranks in different forwards or grad modes, packed documents where the model's own mask ignores them or a
KV cache would keep them together, autocast, ``verify=True`` on models that refuse sdpa."""
import pytest

from tests.harness import run_dist

pytest.importorskip("transformers")


def _parallel(model_type, mesh, **kwargs):
    import torch
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_sweep import tiny
    config, model_class = tiny(model_type)
    torch.manual_seed(0)
    return parallelize_model(model_class(config).float(), mesh, **kwargs)


def _raises(call, text):
    try:
        call()
    except ValueError as error:
        return text in str(error) or f"wrong text: {error}"
    return "no error"


def _refusals(rank, world_size):
    import torch
    from hyper_parallel import init_device_mesh, shard_sequence
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",), timeout=60)
    ids = shard_sequence(torch.randint(16, 128, (2, 16), generator=torch.Generator().manual_seed(1)), mesh)
    model = _parallel("llama", mesh)
    out = {"forward": _raises(lambda: model.forward(input_ids=ids), "called directly"),
           "model.model": _raises(lambda: model.model(input_ids=ids), "called directly"),
           "logits_to_keep": _raises(lambda: model(input_ids=ids, logits_to_keep=1), "logits_to_keep=1"),
           "labels": _raises(lambda: model(input_ids=ids, labels=ids), "pass it as shift_labels="),
           "no count": _raises(lambda: model(input_ids=ids, shift_labels=ids), "num_items_in_batch=")}
    packed = shard_sequence(torch.cat([torch.arange(7), torch.arange(9)])[None].expand(2, 16), mesh)
    out["packed with a cache"] = _raises(lambda: model(input_ids=ids, position_ids=packed, use_cache=True),
                                         "pass use_cache=False")
    with torch.no_grad() if rank == 1 else torch.enable_grad():
        out["grad mode"] = _raises(lambda: model(input_ids=ids), "grad mode")
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(model.config)   # a new rotary module: no global positions
    out["rotary replaced"] = _raises(lambda: model(input_ids=ids), "was replaced after parallelize_model")
    model.model.rotary_emb = rotary
    model(input_ids=ids)   # back: runs
    model.set_attn_implementation("sdpa")
    out["sdpa after wrapping"] = _raises(lambda: model(input_ids=ids), "set after parallelize_model")
    return out


def test_calls_that_would_be_silent_are_refused_on_every_rank():
    for answers in run_dist(2, _refusals, timeout=300):
        assert all(v is True for v in answers.values()), answers


def _same_as_one_process(rank, world_size, model_type, packed, autocast):
    """Logits (gathered) and every gradient equal one process: packed documents on a model whose own mask
    ignores them (OPT), or under bfloat16 autocast (compared with autocast in one process too)."""
    import copy

    import torch
    from hyper_parallel import get_platform, init_device_mesh, shard_sequence
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_sweep import tiny
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",), timeout=60)
    config, model_class = tiny(model_type)
    torch.manual_seed(0)
    reference = model_class(config).float()
    model = parallelize_model(copy.deepcopy(reference), mesh)
    ids = torch.randint(16, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    kwargs = {"use_cache": False}
    if packed:
        kwargs["position_ids"] = torch.cat([torch.arange(7), torch.arange(9)])[None].expand(2, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref = reference(input_ids=ids, **kwargs).logits.float()
        local = {k: shard_sequence(v, mesh) if torch.is_tensor(v) else v for k, v in kwargs.items()}
        logits = model(input_ids=shard_sequence(ids, mesh), **local).logits.float()
    ref.square().mean().backward()
    every = get_platform().all_gather(logits.detach().contiguous(), mesh.get_group(), dim=1)
    (logits.square().sum() / ref.numel()).backward()
    tol = 2e-2 if autocast else 1e-5
    torch.testing.assert_close(every, ref.detach(), atol=tol, rtol=tol)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        grad = get_platform().all_reduce(torch.zeros_like(p) if p.grad is None else p.grad, mesh.get_group())
        torch.testing.assert_close(grad, torch.zeros_like(q) if q.grad is None else q.grad, atol=tol, rtol=tol,
                                   msg=lambda m: f"{name}: {m}")
    return True


@pytest.mark.parametrize("model_type,packed,autocast", [("opt", True, False), ("biogpt", True, False),
                                                        ("llama", True, False), ("llama", False, True)])
def test_packing_and_autocast_as_in_one_process(model_type, packed, autocast):
    assert run_dist(2, _same_as_one_process, model_type, packed, autocast, timeout=300) == [True, True]


def _verify(rank, world_size, model_type):
    import torch
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",), timeout=60)
    return isinstance(_parallel(model_type, mesh, verify=True), torch.nn.Module)


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_verify_runs_on_models_that_refuse_sdpa(model_type):
    assert run_dist(2, _verify, model_type, timeout=300) == [True, True]


def _chunked_packed(rank, world_size, mode):
    """Llama 4's chunked attention over packed documents: transformers chunks each document's positions
    (its mask is evaluated on them), so a chunk restarts with every document."""
    import copy

    import torch
    from hyper_parallel import get_platform, init_device_mesh, shard_sequence
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_sweep import MODES, tiny
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",), timeout=60)
    config, model_class = tiny("llama4_text")
    torch.manual_seed(0)
    reference = model_class(config).float()
    model = parallelize_model(copy.deepcopy(reference), mesh, **MODES[mode])
    ids = torch.randint(16, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(3), torch.arange(9), torch.arange(4)])[None].expand(2, 16)
    ref = reference(input_ids=ids, position_ids=positions, use_cache=False).logits
    local = model(input_ids=shard_sequence(ids, mesh), position_ids=shard_sequence(positions, mesh),
                  use_cache=False).logits
    every = get_platform().all_gather(local.detach().contiguous(), mesh.get_group(), dim=1)
    torch.testing.assert_close(every, ref.detach(), atol=1e-5, rtol=1e-5)
    late = positions + 2   # documents starting at position 2: refused, chunks of positions differ
    return _raises(lambda: model(input_ids=shard_sequence(ids, mesh), position_ids=shard_sequence(late, mesh),
                                 use_cache=False), "start every packed document's position_ids at 0")


@pytest.mark.parametrize("mode", ["ulysses", "zigzag"])
def test_chunked_attention_restarts_with_each_packed_document(mode):
    assert run_dist(2, _chunked_packed, mode, timeout=300) == [True, True]
