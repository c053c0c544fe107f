"""torch.compile of Hugging Face decoder layers under context parallelism (SPEC §18, docs/compile.md).

``parallelize_model(model, cp_mesh, compile=...)``: each decoder layer receives its mask as a
``MaskSpec`` carrying the forward's global masks, which the compiled layer takes as graph inputs
(``MaskSpec.hp_graph_parts``); so the layer compiles to one graph with no break, CP's all-to-alls
or all-gathers traced inside. Loss and every gradient equal the same model run eagerly under CP
(fp32, 1e-5) over two AdamW steps. ``aot_eager`` (AOTAutograd's graphs, as inductor would get
them) keeps the default run short; ``-m compile_full`` adds Qwen3.
"""
import pytest

from tests.harness import run_dist

pytest.importorskip("transformers")

B, S, VOCAB = 2, 16, 64
MODES = {"ulysses": {}, "allgather": {"ulysses_degree": 1}}


def _batch(step, padded=False):
    import torch
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], 1)
    mask = None
    if padded:
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, -5:] = 0   # right padding
        labels = labels.masked_fill(mask == 0, -100)
    return ids, labels, mask


def _loss(model, batch, mesh):
    import torch.nn.functional as F
    from hyper_parallel import shard_sequence
    ids, labels, mask = batch
    count = (labels != -100).sum()
    ids, labels, mask = shard_sequence([ids, labels, mask], mesh)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / count


def _layer_states(model):
    """Per decoder layer: how its call signatures ran ('compiled' / 'eager: why' / 'not run')."""
    from hyper_parallel.integrations.hf_fully_shard import decoder_layers
    from hyper_parallel.platform.torch.compile_support import compiled_of
    states = []
    for layer in decoder_layers(model):
        compiled = compiled_of(layer)
        entries = list(compiled.compiled.values()) if compiled is not None else []
        states.append(sorted("eager" if e[3]["eager"] else "compiled" if e[3]["traced"] else "not run"
                             for e in entries))
    return states


def _hf_case(rank, world, families, modes, padded=False, layers=2):
    import torch
    from hyper_parallel import init_device_mesh
    from hyper_parallel.integrations.hf_fully_shard import decoder_layers
    from hyper_parallel.integrations.transformers import parallelize_model
    from hyper_parallel.platform.torch.compile_support import compiled_of
    from tests.hf_zoo import tiny
    from tests.test_compile import _Recorder

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    results = {}
    for family in families:
        for mode in modes:
            eager = parallelize_model(tiny(family, num_hidden_layers=layers), mesh, **MODES[mode])
            recorder = _Recorder()   # aot_eager, keeping the forward / backward graphs' code
            compiled = parallelize_model(tiny(family, num_hidden_layers=layers), mesh,
                                         compile={"backend": recorder.backend}, **MODES[mode])
            opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (compiled, eager)]
            for step in range(2):
                losses = []
                for model, opt in zip((compiled, eager), opts):
                    opt.zero_grad()
                    loss = _loss(model, _batch(step, padded), mesh)
                    loss.backward()
                    losses.append(loss.detach())
                what = f"{family}/{mode} step {step}"
                torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{what} loss: {m}")
                for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5,
                                               msg=lambda m: f"{what} grad of {name}: {m}")
                for opt in opts:
                    opt.step()
            explain = compiled_of(decoder_layers(compiled)[0]).explain()
            results[f"{family}/{mode}"] = {"explain": (explain.graph_count, explain.graph_break_count),
                                           "layers": _layer_states(compiled),
                                           "collectives": sorted({op for ops in recorder.collectives()
                                                                  for op in ops}),
                                           "eager_c10d": len(recorder.eager_c10d())}
    return results


# the CP exchange traced into the layer's graphs as functional collectives: Ulysses' all-to-alls;
# all-gather KV's all-gathers forward and their reduce-scatters (an all-to-all on gloo) backward
TRACED = {"ulysses": ["all_to_all_single"], "allgather": ["all_gather_into_tensor", "all_to_all_single"]}


def _check(results, layers, explain=(1, 0)):
    assert results[0] == results[1]
    for case, res in results[0].items():
        assert res["explain"] == explain, (case, res)
        assert res["layers"] == [["compiled"]] * layers, (case, res)
        assert res["eager_c10d"] == 0, (case, res)
        if explain == (1, 0):
            assert res["collectives"] == TRACED[case.split("/")[1]], (case, res)


def test_hf_llama_layers_compile_under_context_parallel():
    """A tiny Llama (one decoder layer) under CP, Ulysses and all-gather: the layer's one call
    signature is compiled (not eager), one graph, no break; loss and grads equal eager."""
    results = run_dist(2, _hf_case, ["llama"], list(MODES), layers=1, timeout=900)
    _check(results, 1)


@pytest.mark.compile_full
def test_hf_qwen3_layers_compile_under_context_parallel():
    """Qwen3 (q/k norms) under CP in both modes, both layers compiled."""
    results = run_dist(2, _hf_case, ["qwen3"], list(MODES), timeout=900)
    _check(results, 2)


@pytest.mark.compile_full
def test_hf_padded_batch_under_compile():
    """A padded batch: the masked kernels choose tiles from the mask's values on the host, so
    dynamo breaks around the layer's traced call (4 graphs, 3 breaks, as docs/compile.md states)
    and runs it eagerly; loss and grads still equal eager."""
    results = run_dist(2, _hf_case, ["llama"], list(MODES), padded=True, layers=1, timeout=900)
    _check(results, 1, explain=(4, 3))
