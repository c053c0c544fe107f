"""parallelize_model(..., loss="chunked") on a tiny HF Llama (tests/hf_zoo.py): the loss and every
parameter gradient against the plain model's own loss (labels=), under TP 2 (vocab-parallel head) and
under CP 2 (shift_labels= + num_items_in_batch=; labels= alone refused)."""
import pytest

from tests.harness import run_dist

pytest.importorskip("transformers")

B, S = 2, 16
TOL = dict(atol=1e-5, rtol=1e-5)


def _batch():
    import torch
    from tests.hf_zoo import VOCAB
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100                       # an unlabelled prompt
    return ids, labels


def _reference():
    """The plain model's own loss (in-model shift, mean over counted tokens) and its gradients."""
    from tests.hf_zoo import tiny
    model = tiny("llama")
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_grads(model, ref, what):
    import torch
    from hyper_parallel import DTensor
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, ref[1][name], **TOL, msg=lambda m: f"{what} {name}: {m}")


def _tp_case(rank, world_size):
    import torch
    from hyper_parallel import init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_zoo import tiny
    ref = _reference()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = parallelize_model(tiny("llama"), mesh, loss="chunked")
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref[0], **TOL)
    out.loss.backward()
    _assert_grads(model, ref, "tp")
    assert model(input_ids=ids).logits.shape == (B, S, 64)        # no labels: the model's own forward
    return True


def _cp_case(rank, world_size):
    import torch
    import torch.nn.functional as F
    from hyper_parallel import get_platform, init_device_mesh, shard_sequence
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_zoo import tiny
    ref = _reference()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    model = parallelize_model(tiny("llama"), mesh, loss="chunked")
    ids, labels = _batch()
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)       # on the whole sequence, then sharded
    count = (shifted != -100).sum()
    my_ids, my_shifted = shard_sequence([ids, shifted], mesh)
    with pytest.raises(ValueError, match="shift_labels="):
        model(input_ids=my_ids, labels=my_shifted)
    loss = model(input_ids=my_ids, shift_labels=my_shifted, num_items_in_batch=count).loss
    loss.backward()
    group = mesh.get_group()
    torch.testing.assert_close(get_platform().all_reduce(loss.detach(), group), ref[0], **TOL)
    for p in model.parameters():           # the sum of the ranks' gradients is the global one
        p.grad = get_platform().all_reduce(p.grad, group)
    _assert_grads(model, ref, "cp")
    return True


def test_chunked_loss_under_tensor_parallel():
    assert run_dist(2, _tp_case) == [True, True]


def test_chunked_loss_under_context_parallel():
    assert run_dist(2, _cp_case) == [True, True]


def test_loss_option_is_checked():
    from hyper_parallel.integrations.hf_chunked_loss import check_loss_option
    with pytest.raises(ValueError, match="loss='fused'"):
        check_loss_option("fused")


def test_chunked_loss_reads_the_head_at_each_call():
    """An LM head replaced after wrapping (resize_token_embeddings, a new lm_head) is the one the
    chunked loss uses: its loss equals the model's own and the new head gets the gradient."""
    import torch
    from hyper_parallel.integrations.hf_chunked_loss import apply_chunked_loss
    from tests.hf_zoo import tiny
    ids, labels = _batch()
    model, reference = tiny("llama"), tiny("llama")
    apply_chunked_loss(model, context_parallel=False)
    for m in (model, reference):
        torch.manual_seed(5)
        m.lm_head = torch.nn.Linear(m.lm_head.in_features, m.lm_head.out_features, bias=False)
    ref = reference(input_ids=ids, labels=labels).loss
    ref.backward()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    torch.testing.assert_close(loss, ref, **TOL)
    torch.testing.assert_close(model.lm_head.weight.grad, reference.lm_head.weight.grad, **TOL)


def test_chunked_loss_refuses_a_soft_cap_its_probe_cannot_see():
    """Gemma 2's default final soft-cap (30) hardly changes a fresh model's small logits; it is refused by
    name, not only when it shows."""
    import transformers
    from hyper_parallel.integrations.hf_chunked_loss import probe_logits
    config = transformers.Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64)
    assert config.final_logit_softcapping == 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        probe_logits(transformers.Gemma2ForCausalLM(config))
