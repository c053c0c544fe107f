"""Projections overlapped with their collectives (SPEC §6 "Overlap"): the pipelined Llama-family
attention blocks of ``parallelize_model(..., overlap=True)`` (integrations/hf_overlap.py), built on
``start_attention`` (tested on its own in tests/test_cp_async.py).

Every check is against one process: the pipelined models against the unparallelized model (loss
and every parameter gradient, fp32 1e-5). The pipeline's order is read from ``observe_pipeline``
events (no timing): group c+1's projections run between group c's collective start and its wait,
in forward, and group c+1's projection backward between group c's gradient collective start and
its wait."""
import pytest

from tests.harness import run_dist
from tests.test_cp_gqa_and_meshes import TOL

B, S, VOCAB = 2, 16, 64


pytest.importorskip("transformers")


def _model(family, seed=0):
    import torch
    import transformers
    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                             "mistral": ("MistralConfig", "MistralForCausalLM")}[family]
    config = getattr(transformers, config_cls)(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, attention_bias=family == "llama")
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config).float()


def _batch(padded):
    import torch
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], 1)
    mask = None
    if padded:
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, -5:] = 0
        labels = labels.masked_fill(torch.cat([mask[:, 1:], mask[:, :1] * 0], 1) == 0, -100)
    return ids, labels, mask


def _loss(logits, labels, count):
    import torch.nn.functional as F
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                           reduction="sum") / count


def _hf_case(rank, world, family, cp_kwargs, checkpointing=False):
    """Loss and every parameter gradient of the pipelined model equal one process; returns the
    projection groups that ran per variant (plain: pipelined; padded: the block's own forward)."""
    import torch
    from hyper_parallel import data_parallel, get_platform, init_device_mesh, shard_sequence
    from hyper_parallel.core.context_parallel.overlap.pipeline import observe_pipeline
    from hyper_parallel.integrations.transformers import parallelize_model
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = _model(family)
    if checkpointing:   # the blocks' forward runs again in backward: its collectives too
        model.activation_checkpointing_enable()
    model = parallelize_model(model, mesh, overlap=True, **cp_kwargs)
    data_parallel(model, mesh, average=False)
    groups = {}
    for padded in (False, True):
        ids, labels, mask = _batch(padded)
        ref_model = _model(family)
        count = (labels != -100).sum()
        _loss(ref_model(input_ids=ids, attention_mask=mask).logits, labels, count).backward()
        model.zero_grad(set_to_none=True)
        seen = set()
        with observe_pipeline(lambda stage, chunk, event: seen.add((stage, chunk, event))):
            parts = shard_sequence([ids, labels, mask], mesh)
            loss = _loss(model(input_ids=parts[0], attention_mask=parts[2]).logits, parts[1], count)
            loss.backward()
        total = get_platform().all_reduce(loss.detach(), mesh.get_group())
        ref_loss = _loss(ref_model(input_ids=ids, attention_mask=mask).logits, labels, count)
        torch.testing.assert_close(total, ref_loss.detach(), **TOL)
        for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, n=name: f"{family} {n}: {m}")
        groups["padded" if padded else "plain"] = sorted(c for stage, c, event in seen
                                                         if (stage, event) == ("proj", "forward"))
    return groups


@pytest.mark.parametrize("family,cp_kwargs,world,checkpointing", [
    ("llama", {}, 2, False), ("llama", {"ulysses_degree": 1}, 2, False), ("qwen3", {}, 2, False),
    ("llama", {"ulysses_degree": 2}, 4, False), ("llama", {}, 2, True), ("qwen2", {}, 2, False),
    ("mistral", {"ulysses_degree": 1}, 2, False),
], ids=["llama-ulysses", "llama-allgather", "qwen3-ulysses", "llama-hybrid", "llama-checkpointed",
        "qwen2-ulysses", "mistral-allgather"])
def test_pipelined_blocks_equal_one_process(family, cp_kwargs, world, checkpointing):
    for groups in run_dist(world, _hf_case, family, cp_kwargs, checkpointing, timeout=600):
        assert groups == {"plain": [0, 1], "padded": []}, groups


def _order_case(rank, world):
    """The event log of one pipelined block (Llama, 2 groups, Ulysses) in forward and backward."""
    import torch
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.context_parallel.overlap.pipeline import observe_pipeline
    from hyper_parallel.integrations.transformers import parallelize_model
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = _model("llama")
    model.model.layers = model.model.layers[:1]
    parallelize_model(model, mesh, overlap=True)
    log = []
    with observe_pipeline(lambda stage, chunk, event: log.append((stage, chunk, event))):
        ids = torch.randint(0, VOCAB, (B, S // world))
        out = model(input_ids=ids).logits
        forward = len(log)
        out.sum().backward()
    return log[:forward], log[forward:]


def test_projections_overlap_the_collectives():
    """("in", 0, ...) events are the groups' q/k/v collectives, group 0's first (each split call
    is one chunk): group 1's projections run while group 0's collective travels, and in backward
    group 1's projection backward while group 0's gradient collective travels."""
    for forward, backward in run_dist(2, _order_case):
        forward, backward = [tuple(e) for e in forward], [tuple(e) for e in backward]
        starts = [i for i, e in enumerate(forward) if e == ("in", 0, "start")]
        waits = [i for i, e in enumerate(forward) if e == ("in", 0, "wait")]
        assert len(starts) == len(waits) == 2, forward
        assert forward.index(("proj", 0, "forward")) < starts[0], forward
        assert starts[0] < forward.index(("proj", 1, "forward")) < starts[1] < waits[0], forward
        grad_starts = [i for i, e in enumerate(backward) if e == ("in", 0, "grad_start")]
        grad_waits = [i for i, e in enumerate(backward) if e == ("in", 0, "grad_wait")]
        assert len(grad_starts) == len(grad_waits) == 2, backward
        # group 0's gradient collective starts second and is waited for last
        assert grad_starts[1] < backward.index(("proj", 1, "backward")) < grad_waits[1], backward
        assert grad_waits[1] < backward.index(("proj", 0, "backward")), backward


def _noncausal_case(rank, world):
    """``is_causal=False`` handed to a block reaches the attention in the pipelined forward as in
    the block's own (the CP attention function reads it): the two equal, and differ from causal."""
    import torch
    from hyper_parallel import init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    outs = {}
    for overlap in (False, True):
        model = parallelize_model(_model("llama"), mesh, overlap=overlap)
        block = model.model.layers[0].self_attn
        torch.manual_seed(1)
        hidden = torch.randn(B, S // world, 32)
        positions = torch.arange(S // world).unsqueeze(0) + rank * (S // world)
        cos_sin = model.model.rotary_emb(hidden, positions)
        outs[overlap] = [block(hidden_states=hidden, position_embeddings=cos_sin, attention_mask=None,
                               position_ids=positions, is_causal=causal)[0] for causal in (False, True)]
    torch.testing.assert_close(outs[True][0], outs[False][0], **TOL)
    torch.testing.assert_close(outs[True][1], outs[False][1], **TOL)
    assert not torch.allclose(outs[True][0], outs[True][1])
    return True


def test_pipelined_block_passes_is_causal_on():
    assert run_dist(2, _noncausal_case) == [True, True]
