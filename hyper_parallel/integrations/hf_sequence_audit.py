"""Find the modules of a Hugging Face model that mix information along the sequence outside attention.

Under context parallelism every module but attention runs on each rank's sequence block alone. That
is exact only for modules whose output at a token depends on that token alone: linear layers, norms,
MLPs, MoE routing, rotary embeddings of the global positions. A convolution over the sequence, a
recurrence, a scan or a linear-attention layer (Gated DeltaNet, KDA, Mamba) would need what the
earlier ranks hold, and run on a block alone they train a different model without an error.

A list of known classes cannot cover models nobody listed, so the audit measures instead: the model
runs twice on a short random sequence, with attention replaced by a token-local stand-in, the second
time with its first and last tokens changed. A module call whose inputs differ only at those tokens
but whose output differs at another one mixes the sequence; the innermost such modules are named in
a ValueError. The run is local to each rank (no collective), and every rank reaches the same verdict.

A module hyper_parallel has made sequence-exact on the CP blocks (``mark_sequence_exact``: the
linear-attention layers of hf_linear_attention.py) asks ``is_probing(module)`` and, during the
probe only, runs a token-local stand-in of its own mixing, as attention does; the audit still
measures it and everything else, so nothing unmarked is accepted and a marked module whose
stand-in mixed would still be refused.
"""
from typing import Any, Iterator
import contextlib
import weakref

import torch

# an odd, prime length: no hidden size, head count or head dim of a real model equals it, so the dim
# of this size in a module's input or output is the sequence
PROBE_LEN = 13
_EDGES = (0, PROBE_LEN - 1)

# why a refused class cannot be split, by a part of its name (the message only; detection measures)
_WHY = (
    (("deltanet", "delta", "kda", "linearattention", "linear_attn", "lightning"),
     "linear attention needs the recurrent state of the earlier ranks"),
    (("mamba", "ssm", "mixer", "rwkv", "recurrent", "rnn", "lstm", "gru"),
     "a recurrence / state-space scan needs the state of the earlier ranks"),
    (("conv",), "a convolution over the sequence needs the last (kernel - 1) tokens of the previous rank"),
)


_EXACT: Any = weakref.WeakSet()   # modules whose CP forward is exact on sequence blocks
_PROBING = [False]


def mark_sequence_exact(module: Any) -> None:
    """Record that ``module``'s forward runs exactly on CP sequence blocks (it exchanges what it needs)."""
    _EXACT.add(module)


@contextlib.contextmanager
def marked_probing() -> Iterator[None]:
    """While it lasts, modules marked sequence-exact run their token-local stand-in (the position probes
    of hf_positions.py run the model like the audit does)."""
    before = _PROBING[0]
    _PROBING[0] = True
    try:
        yield
    finally:
        _PROBING[0] = before


def is_probing(module: Any) -> Any:
    """Whether the audit is probing and ``module`` is marked: then it runs its token-local stand-in."""
    return _PROBING[0] and module in _EXACT


def _seq_dim(tensor):
    dims = [d for d, size in enumerate(tensor.shape) if size == PROBE_LEN]
    return dims[0] if len(dims) == 1 else None


def _tolerance(tensor):
    if not tensor.is_floating_point():
        return 0.5
    return 1e-5 if tensor.dtype in (torch.float32, torch.float64) else 1e-2


def _changed_positions(a, b):
    """The sequence positions where two tensors differ; None when they differ but have no sequence
    dim (nothing can be said about the call)."""
    if a.shape != b.shape:
        return None
    if a.numel() == 0:
        return set()
    a, diff = a.detach().double(), (a.detach().double() - b.detach().double()).abs()
    tol = _tolerance(b) * (1 + float(a.abs().max()))
    dim = _seq_dim(a)
    if dim is None:
        return None if bool((diff > tol).any()) else set()
    per_position = diff.movedim(dim, 0).reshape(PROBE_LEN, -1).amax(dim=1)
    return {int(p) for p in torch.nonzero(per_position > tol).flatten()}


def _tensors(value):
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):   # transformers' ModelOutput is one too
        return [t for item in value.values() for t in _tensors(item)]
    return []


class _Recorder:
    """Inputs and outputs of every module call, by (module name, call index)."""

    def __init__(self, model):
        self.calls, self.counts = {}, {}
        self.handles = [m.register_forward_hook(self._hook(name), with_kwargs=True)
                        for name, m in model.named_modules()]

    def _hook(self, name):
        def hook(module, args, kwargs, output):
            index = self.counts.get(name, 0)
            self.counts[name] = index + 1
            # cloned: a later in-place update must not change what this call saw
            seen = [t.detach().clone() for t in _tensors([args, kwargs])]
            self.calls[(name, index)] = (type(module).__name__, seen,
                                         [t.detach().clone() for t in _tensors(output)])
        return hook

    def close(self):
        for handle in self.handles:
            handle.remove()


def _mixes(base, moved):
    """True when the call's inputs changed at the edge tokens only and its output elsewhere."""
    for a, b in zip(base[1], moved[1]):
        changed = _changed_positions(a, b)
        if changed is None or not changed <= set(_EDGES):
            return False
    outputs = [_changed_positions(a, b) for a, b in zip(base[2], moved[2])]
    return any(changed is not None and not changed <= set(_EDGES) for changed in outputs)


def _inside(name, outer):
    return name != outer and (outer == "" or name.startswith(outer + "."))


def _innermost(names):
    return [n for n in names if not any(_inside(other, n) for other in names)]


def _reason(class_name):
    lowered = class_name.lower()
    for parts, why in _WHY:
        if any(part in lowered for part in parts):
            return why
    return "its output at one token depends on other tokens"


def _run(model, ids):
    recorder = _Recorder(model)
    _PROBING[0] = True
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        _PROBING[0] = False
        recorder.close()
    return recorder.calls


def _probe_ids(model, device):
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = int(config.vocab_size)
    ids = torch.randint(0, vocab, (1, PROBE_LEN), generator=torch.Generator().manual_seed(0)).to(device)
    moved = ids.clone()
    moved[:, list(_EDGES)] = (moved[:, list(_EDGES)] + 1) % vocab
    return ids, moved


def mixing_modules(model: Any) -> Any:
    """``[(dotted name, class name)]`` of the innermost modules that mix the sequence outside attention
    (the caller has replaced attention by a token-local stand-in)."""
    device = next(model.parameters()).device
    ids, moved = _probe_ids(model, device)
    modes = {m: m.training for m in model.modules()}
    model.eval()   # dropout would differ between the two runs
    try:
        with torch.no_grad():
            base, other = _run(model, ids), _run(model, moved)
    finally:
        for module, mode in modes.items():
            module.training = mode
    found = {key[0]: base[key][0] for key in base if key in other and _mixes(base[key], other[key])}
    return [(name, found[name]) for name in _innermost(sorted(found))]


def _where(error):
    """The innermost frame of the model's own code (transformers' modeling files) in the traceback."""
    import traceback
    frames = traceback.extract_tb(error.__traceback__)
    inside = [f for f in frames if "/models/" in f.filename] or frames[-1:]
    if not inside:
        return "?"
    frame = inside[-1]
    return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}: {frame.line}"


def refuse_sequence_mixing(model: Any) -> None:
    """ValueError naming every module that context parallelism would silently get wrong."""
    try:
        found = mixing_modules(model)
    except ValueError:
        raise
    except Exception as error:   # a model that cannot run its layers with the probe's stand-in attention
        raise ValueError(f"parallelize_model: {type(model).__name__} could not run context parallelism's "
                         f"setup probe (its attention replaced by a token-local stand-in, masks handed over "
                         f"unbuilt): "
                         f"{type(error).__name__}: {error} (raised at {_where(error)}); context parallelism "
                         f"cannot check this model, train it without a 'cp' mesh dim") from error
    if found:
        lines = "; ".join(f"{name or '<model>'} ({cls}: {_reason(cls)})" for name, cls in found)
        raise ValueError(f"parallelize_model: {type(model).__name__} mixes tokens along the sequence outside "
                         f"attention, which context parallelism would run on each rank's block alone and so "
                         f"train a different model: {lines}. Context parallelism does not split these "
                         f"modules yet; train this model without a 'cp' mesh dim")
