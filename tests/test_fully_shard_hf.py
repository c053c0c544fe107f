"""parallelize_model(..., dp_shard="dp_shard"): a tiny Hugging Face Llama with fully_shard on each
decoder layer and the root, on 2 ranks (ZeRO-3) and on a (dp_shard, tp) 2×2 mesh (TP × FSDP), one
AdamW step against the same batches in one process (loss, gradients, weights to 1e-5)."""
import pytest

from tests.harness import run_dist

pytest.importorskip("transformers")


def _llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    return LlamaForCausalLM(config)


def _ids(index):
    import torch
    return torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(50 + index))


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _case(rank, world_size, shape, names):
    import torch
    from hyper_parallel import DTensor, init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_index, n_data = mesh.get_local_rank(0), shape[0]
    model = parallelize_model(_llama(), mesh)
    assert all(isinstance(p, DTensor) and p.placements[0].is_shard(0) for p in model.parameters())
    assert sum(getattr(m, "_hp_fsdp_state", None) is not None for m in model.modules()) == 3
    ref = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    loss = _loss(model, _ids(dp_index))
    loss.backward()
    ref_losses = [_loss(ref, _ids(i)) for i in range(n_data)]
    (sum(ref_losses) / n_data).backward()
    torch.testing.assert_close(loss, ref_losses[dp_index], atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, atol=1e-5, rtol=1e-5, msg=name)
    opt.step()
    ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), atol=1e-5, rtol=1e-5, msg=name)
    return True


def test_parallelize_model_dp_shard_and_tp():
    assert run_dist(2, _case, (2,), ("dp_shard",)) == [True] * 2
    assert run_dist(4, _case, (2, 2), ("dp_shard", "tp")) == [True] * 4


def _zoo_case(rank, world_size, family):
    """One family under dp_shard: its decoder layers found by transformers' _no_split_modules (GPT-2's
    blocks live in transformer.h, not a 'layers' list), gradients and an SGD step equal to one process."""
    import torch
    from hyper_parallel import init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_zoo import tiny
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    model, ref = parallelize_model(tiny(family), mesh), tiny(family)
    units = [type(m).__name__ for m in model.modules() if getattr(m, "_hp_fsdp_state", None) is not None]
    assert units[1:] == sorted(model._no_split_modules) * (len(units) - 1), units
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    model(input_ids=_ids(rank), labels=_ids(rank)).loss.backward()
    (sum(ref(input_ids=_ids(i), labels=_ids(i)).loss for i in range(world_size)) / world_size).backward()
    opt.step()
    ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), atol=1e-5, rtol=1e-5, msg=name)
    return True


def test_parallelize_model_dp_shard_finds_each_familys_layers():
    for family in ("gpt2", "gpt_neox"):
        assert run_dist(2, _zoo_case, family) == [True] * 2
