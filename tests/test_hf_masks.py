"""Hugging Face padding masks and packed position_ids under context parallelism in every CP mode
(Ulysses, all-gather KV ± load balance, ring ± zigzag on 2 ranks; hybrid and hybrid ring on 4):
parallelize_model turns them into ``attention_masks`` (no S×S mask). A tiny random Llama's logits on
the real (non-padded) positions, its loss and every parameter gradient must equal the model on one
process with the same inputs, masked by transformers itself."""
import pytest

from tests.harness import run_dist

pytest.importorskip("transformers")

B, S, VOCAB = 2, 16, 64
MODES_2 = {"ulysses": {}, "allgather": {"ulysses_degree": 1},
           "allgather-lb": {"ulysses_degree": 1, "load_balance": True},
           "ring": {"ulysses_degree": 1, "kv_exchange": "ring"},
           "ring-zigzag": {"ulysses_degree": 1, "kv_exchange": "ring", "load_balance": True}}
MODES_4 = {"hybrid": {"ulysses_degree": 2}, "hybrid-ring": {"ulysses_degree": 2, "kv_exchange": "ring"}}


def _model(**overrides):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    kwargs = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    kwargs.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**kwargs)).float()


def _docs(*lengths):
    import torch
    return torch.cat([torch.arange(n) for n in lengths])


def _batch(variant):
    """input_ids, labels (-100 where no loss), padding mask or None, position_ids or None."""
    import torch
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], 1)
    mask = positions = None
    if variant == "left-right-padding":
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, :5] = 0    # left padding, past the first zigzag chunk
        mask[1, -11:] = 0  # right padding over a whole rank's block
        nxt = torch.cat([mask[:, 1:], torch.zeros(B, 1, dtype=mask.dtype)], 1)
        labels = labels.masked_fill((mask == 0) | (nxt == 0), -100)
    elif variant == "packed":
        # documents crossing rank / zigzag-chunk edges, and one ending exactly on them
        positions = torch.stack([_docs(5, 7, 4), _docs(8, 3, 1, 4)])
    return ids, labels, mask, positions


def _loss(logits, labels, count):
    import torch.nn.functional as F
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                           reduction="sum") / count


def _reference(batch):
    ids, labels, mask, positions = batch
    model = _model()
    # use_cache=False: transformers separates packed documents only without a cache (CP never has one)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    loss = _loss(logits, labels, (labels != -100).sum())
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _check(torch, what, cp_mesh, model, batch, ref):
    from hyper_parallel import get_platform, shard_sequence
    ids, labels, mask, positions = batch
    count = (labels != -100).sum()
    local = shard_sequence([ids, labels, mask, positions], cp_mesh)
    logits = model(input_ids=local[0], attention_mask=local[2], position_ids=local[3], use_cache=False).logits
    loss = _loss(logits, local[1], count)
    loss.backward()
    group = cp_mesh.get_group()
    full = get_platform().all_gather(logits.detach().contiguous(), group, dim=1)
    real = mask.bool() if mask is not None else torch.ones(B, S, dtype=torch.bool)
    torch.testing.assert_close(full[real], ref[0][real], atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"{what} logits: {m}")
    total = get_platform().all_reduce(loss.detach(), group)
    torch.testing.assert_close(total, ref[1], atol=1e-5, rtol=1e-5, msg=lambda m: f"{what} loss: {m}")
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[2][name], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{what} {name}: {m}")


def _every_mode(rank, world_size, modes):
    import torch
    from hyper_parallel import data_parallel, init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    batches = {v: _batch(v) for v in ("left-right-padding", "packed")}
    refs = {v: _reference(b) for v, b in batches.items()}
    for mode, kwargs in modes.items():
        model = parallelize_model(_model(), mesh, **kwargs)
        data_parallel(model, mesh, average=False)  # each CP rank's gradient is its block's part
        for variant, batch in batches.items():
            model.zero_grad(set_to_none=True)
            _check(torch, f"{mode}/{variant}", mesh, model, batch, refs[variant])
    return True


def test_hf_masks_every_mode_2_ranks():
    assert run_dist(2, _every_mode, MODES_2) == [True] * 2


def test_hf_masks_hybrid_4_ranks():
    assert run_dist(4, _every_mode, MODES_4) == [True] * 4


def _dropout_refused(rank, world_size):
    from hyper_parallel import init_device_mesh, shard_sequence
    from hyper_parallel.integrations.transformers import parallelize_model

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    ids, _, mask, _ = shard_sequence(list(_batch("left-right-padding")), mesh)
    model = parallelize_model(_model(attention_dropout=0.1), mesh, ulysses_degree=1, kv_exchange="ring")
    with pytest.raises(ValueError, match="attention dropout 0.1"):
        model(input_ids=ids, attention_mask=mask)
    model.eval()
    model(input_ids=ids, attention_mask=mask)   # eval: no dropout, the mask applies
    return True


def test_hf_masks_dropout_refused():
    assert run_dist(2, _dropout_refused) == [True] * 2


def _checkpointed(rank, world_size, overlap):
    """Activation checkpointing recomputes each layer in backward, after the forwards ended: three
    forwards (padded, packed, plain) then one backward of their summed losses — every recomputed
    attention must apply its own forward's masks. Loss and every gradient vs one process."""
    import torch
    from hyper_parallel import data_parallel, init_device_mesh, shard_sequence
    from hyper_parallel.integrations.transformers import parallelize_model

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    batches = [_batch(v) for v in ("left-right-padding", "packed", "plain")]
    ref_model = _model()
    sum(_loss(ref_model(input_ids=b[0], attention_mask=b[2], position_ids=b[3], use_cache=False).logits,
              b[1], (b[1] != -100).sum()) for b in batches).backward()
    model = _model()
    model.activation_checkpointing_enable()
    parallelize_model(model, mesh, overlap=overlap)
    data_parallel(model, mesh, average=False)
    losses = []
    for ids, labels, mask, positions in batches:
        local = shard_sequence([ids, labels, mask, positions], mesh)
        logits = model(input_ids=local[0], attention_mask=local[2], position_ids=local[3], use_cache=False).logits
        losses.append(_loss(logits, local[1], (labels != -100).sum()))
    sum(losses).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    return True


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_hf_masks_under_activation_checkpointing(overlap):
    assert run_dist(2, _checkpointed, overlap) == [True] * 2
