"""``parallelize_model(..., verify=True)``: one probe at setup that the model under context parallelism
computes what it computes without it.

After every parallelism is applied, a short random batch (2 rows; longer than every window and chunk
the model's masks restrict, at least 16 tokens per rank) runs twice, in eval mode without gradients:

1. with CP: each rank its block (``shard_sequence``); the output of every decoder layer is gathered over
   the CP ranks;
2. without CP: every rank the whole sequence, the model switched to transformers' own "eager"
   attention (masks built by transformers, no position hooks), tensor parallelism and fully_shard
   left as they are.

The first decoder layer (in the order they ran) whose outputs differ beyond fp32 1e-4 (relative to
their size) is named in a ValueError, raised on every rank alike (every rank compares the same
gathered tensors). Decoder layers are the modules of the classes in the model's ``_no_split_modules``.

Cost: one CP forward of the probe batch plus one forward of the whole probe sequence on every rank
(no backward), and one all-gather of each layer's output (2 × S_probe × hidden floats per layer).
At a probe of P·max(16, 2·window + 2) tokens that is well under one training step for models whose
windows are short; a 4096-token window makes the probe about 8192 tokens long.
"""
from typing import Any, List

import torch

from hyper_parallel.platform import get_platform


def _layers(model) -> List[torch.nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if not found:
        lists: List[Any] = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        sizes = [len(m) for m in lists]
        found = list(lists[sizes.index(max(sizes))]) if lists else []
    return found


def _first_tensor(value):
    if torch.is_tensor(value):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return getattr(value, "last_hidden_state", None)


def _record(model, names):
    outputs, handles = [], []
    for layer in _layers(model):
        def hook(module, args, output, name=names.get(layer, type(layer).__name__)):
            tensor = _first_tensor(output)
            if tensor is not None and tensor.is_floating_point():
                outputs.append((name, tensor.detach()))
        handles.append(layer.register_forward_hook(hook))
    return outputs, handles


def probe_length(state: Any, world: int) -> int:
    longest = max([r.window or r.chunk or 0 for r in state.restrictions.values()] + [0])
    per_rank = max(16, -(-(2 * longest + 2) // world))
    per_rank += per_rank % 2   # load balance halves each rank's block
    return per_rank * world


def _run(model, ids, outputs, handles):
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)   # a cache is refused under CP and not wanted here
    finally:
        for handle in handles:
            handle.remove()
    return list(outputs)


def verify_context_parallel(model: Any, state: Any) -> None:
    """Raise ValueError naming the first decoder layer whose output differs with and without CP."""
    from hyper_parallel import shard_sequence
    mesh, platform = state.mesh, get_platform()
    world = mesh.size()
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = int(config.vocab_size)
    device = next(model.parameters()).device
    length = probe_length(state, world)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(min(16, vocab // 2), vocab, (2, length), generator=g).to(device)
    names = {m: n for n, m in model.named_modules()}
    training = model.training
    model.eval()
    try:
        outputs, handles = _record(model, names)
        with_cp = _run(model, shard_sequence(ids, mesh), outputs, handles)
        with_cp = [(n, platform.all_gather(t.contiguous(), mesh.get_group(), dim=1)) for n, t in with_cp]
        model.set_attn_implementation("eager")   # every model takes it (Gemma 2, gpt-oss refuse sdpa)
        state.disabled = True
        try:
            outputs, handles = _record(model, names)
            without = _run(model, ids, outputs, handles)
        finally:
            state.disabled = False
            model.set_attn_implementation(state.name)
    finally:
        model.train(training)
    _compare(type(model).__name__, with_cp, without)


def _compare(model_name, with_cp, without) -> None:
    if len(with_cp) != len(without):
        raise ValueError(f"parallelize_model(verify=True): {model_name} ran {len(with_cp)} decoder layers "
                         f"with context parallelism and {len(without)} without")
    for (name, a), (_, b) in zip(with_cp, without):
        a, b = a.double(), b.double()
        if a.shape != b.shape:
            raise ValueError(f"parallelize_model(verify=True): {name} returned shape {tuple(a.shape)} with "
                             f"context parallelism (gathered) and {tuple(b.shape)} without")
        diff = float((a - b).abs().max()) if a.numel() else 0.0
        if diff > 1e-4 * (1.0 + float(b.abs().max())):
            raise ValueError(f"parallelize_model(verify=True): {model_name}'s layer {name} computes a "
                             f"different output under context parallelism (largest difference {diff:.3g}); "
                             f"the layers before it agree. Train this model without a 'cp' mesh dim")
