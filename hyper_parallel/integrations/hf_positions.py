"""Global positions for every position-dependent module of a Hugging Face model under context parallelism.

Each CP rank runs the model on its block of the sequence, so whatever a model derives from "the
positions of the tokens it was given" sees 0 .. S/P - 1 on every rank unless told otherwise. Where the
positions enter differs per family: a rotary module fed ``position_ids`` by the decoder (every
``rope_type``; dynamic and longrope choose their scaling from the largest position), a learned
position embedding fed by an ``*ForCausalLM`` that calls the decoder directly (OPT, BART-style
decoders), positions counted from ``padding_idx + 1`` (RoBERTa-style), ...

So the places are measured, not listed. At setup (single process, attention replaced by the audit's
token-local stand-in) the model runs on two different token sequences: a module call that received
an integer tensor ``arange(L) + k`` and whose output is the same for both sequences computes from
positions alone: a *position source* (rotary embeddings, position embeddings). A third run passes
``position_ids = arange(L)`` explicitly, which tells the offset between the positions the model's
entry takes and the ones its sources receive (``padding_idx + 1`` for RoBERTa).

During a CP forward every source's positions are replaced by the *global* ones (all ranks' blocks,
from the entry's gathered ``position_ids`` or ``arange(S)``, plus the source's offset) and its output
is cut back to this rank's block: the rotary embedding of any ``rope_type`` (a dynamic / longrope
scaling chosen from the global length), position embeddings at their global rows. A source whose
positions are neither the model's local default nor the entry's global ones (positions derived from
padding or token contents inside the model) is a ValueError naming it: pass ``position_ids``.
"""
import contextlib
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from hyper_parallel.integrations import hf_block_cache
from hyper_parallel.integrations.hf_sequence_audit import PROBE_LEN, marked_probing

_Key = Tuple[str, Any]   # ("arg", index) or ("kw", name)


def _offset(tensor, length: int) -> Optional[int]:
    """k when ``tensor`` holds arange(length) + k in every row, else None."""
    if not torch.is_tensor(tensor) or tensor.is_floating_point() or tensor.dtype == torch.bool:
        return None
    if tensor.ndim == 0 or tensor.shape[-1] != length or tensor.numel() == 0:
        return None
    diff = tensor.detach().cpu().long() - torch.arange(length)
    first = int(diff.flatten()[0])
    return first if bool((diff == first).all()) else None


def _int_inputs(args, kwargs) -> Dict[_Key, torch.Tensor]:
    found = {("arg", i): a for i, a in enumerate(args) if torch.is_tensor(a)}
    found.update((("kw", n), v) for n, v in kwargs.items() if torch.is_tensor(v))
    return found


def _outputs(value) -> List[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _outputs(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _outputs(item)]
    return []


class _Calls:
    """(module name, call index) -> (module, {key: offset} of its arange inputs, detached outputs)."""

    def __init__(self, model, length: int):
        self.calls: Dict[Any, Any] = {}
        self.counts: Dict[Any, int] = {}
        self.length, self.handles = length, []
        for name, module in model.named_modules():
            if module is not model:
                self.handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))

    def _hook(self, name):
        def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            index = self.counts.get(name, 0)
            self.counts[name] = index + 1
            offsets = {key: k for key, t in _int_inputs(args, kwargs).items()
                       if (k := _offset(t, self.length)) is not None}
            if offsets:
                self.calls[(name, index)] = (module, offsets, [t.detach().clone() for t in _outputs(output)])
        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and bool(torch.equal(x, y)) for x, y in zip(a, b))


def find_sources(model: Any, run: Any, ids: Any,
                 other_ids: Any) -> List[Tuple[str, torch.nn.Module, _Key, int, int, bool]]:
    """``[(name, module, key, offset without position_ids, offset with position_ids=arange, whether the
    positions change with left padding)]`` of the
    outermost position sources; ``run(input_ids, position_ids)`` calls the model (probing)."""
    length = int(ids.shape[-1])
    padded = torch.ones_like(ids)
    padded[:, :3] = 0   # left padding
    records = []
    for token_ids, positions, mask in ((ids, None, None), (other_ids, None, None),
                                       (ids, torch.arange(length)[None], None), (ids, None, padded)):
        calls = _Calls(model, length)
        try:
            run(token_ids, positions, mask)
        except Exception:   # e.g. no attention_mask argument: the run tells nothing
            if mask is None:
                raise
        finally:
            calls.close()
        records.append(calls.calls)
    first, second, explicit, with_padding = records
    sources = {}
    for key, (module, offsets, outputs) in first.items():
        other = second.get(key)
        if other is None or other[1] != offsets or not outputs or not _same(outputs, other[2]):
            continue
        arg, k = sorted(offsets.items(), key=lambda item: str(item[0]))[0]
        k_explicit = explicit.get(key, (None, {}))[1].get(arg, k)
        # positions counted from the padding (OPT): what a block alone cannot count
        padding_dependent = with_padding.get(key, (None, {}))[1].get(arg) != k
        sources[key[0]] = (module, arg, k, k_explicit, padding_dependent)
    names = [n for n in sources if not any(n != o and n.startswith(o + ".") for o in sources)]
    return [(n,) + sources[n] for n in sorted(names)]


@contextlib.contextmanager
def _probing(model):
    """Eval mode (no dropout) and no gradients for the probe runs; the modes restored after."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad(), marked_probing():
            yield
    finally:
        for module, mode in modes.items():
            module.training = mode


def _probe_inputs(model):
    """Two different token sequences of PROBE_LEN ids above the special ones (a padding id inside the
    sequence would change a RoBERTa-style position count), and the call that runs the model."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = int(config.vocab_size)
    device = next(model.parameters()).device
    low = min(16, vocab // 2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(low, vocab, (2, PROBE_LEN), generator=g).to(device)
    return ids[:1], ids[1:], device


def _runner(model, entry_parameters, device, offset=0):
    def run(token_ids: Any, positions: Any, mask: Any = None) -> None:
        kwargs = {"input_ids": token_ids, "use_cache": False}
        if positions is not None and "position_ids" in entry_parameters:
            kwargs["position_ids"] = positions.to(device) + offset
        if mask is not None:
            kwargs["attention_mask"] = mask.to(device)
        model(**kwargs)
    return run


def position_sources(model: Any, entry_parameters: Any) -> Any:
    """``find_sources`` on the probe inputs (eval mode, no grad)."""
    ids, other, device = _probe_inputs(model)
    with _probing(model):
        return find_sources(model, _runner(model, entry_parameters, device), ids, other)


def run_packed(model: Any, entry_parameters: Any, first: int) -> None:
    """One probe run of two packed documents: position_ids restart at token ``first``."""
    ids, _, device = _probe_inputs(model)
    positions = torch.cat([torch.arange(first), torch.arange(PROBE_LEN - first)])[None]
    with _probing(model):
        _runner(model, entry_parameters, device)(ids, positions)


def refuse_block_differences(model: Any, entry_parameters: Any, set_context: Any, offset: Any,
                             start_of: Any) -> List[Any]:
    """ValueError naming the modules whose output on a later block differs from the whole sequence's
    (after the source hooks are installed; the caller has attention replaced by the stand-in), unless
    handing them the block's past length as a KV cache removes every difference (hf_block_cache.py):
    then the hooks doing so, to keep."""
    ids, other, device = _probe_inputs(model)
    run = _runner(model, entry_parameters, device, offset)
    tokens = torch.cat([ids, other], 1)
    with _probing(model):
        def probe() -> List[str]:
            return block_differences(model, run, tokens, set_context)
        hooks, found = hf_block_cache.remedy(model, probe(), probe, lambda: run(tokens, None), start_of)
    if found:
        raise ValueError(f"parallelize_model: {type(model).__name__} computes something different on a later "
                         f"block of the sequence than on the whole sequence, with global positions handed to "
                         f"every position embedding: {'; '.join(found)} (e.g. an attention temperature or "
                         f"positions counted from the block's own token index, or from token contents). "
                         f"Context parallelism cannot split it; train this model without a 'cp' mesh dim")
    return hooks


class PositionContext:
    """This forward's global positions (B or 1, S) and this rank's block [start, start + local)."""

    def __init__(self, global_positions: torch.Tensor, start: int, local: int, given: bool) -> None:
        self.positions, self.start, self.local, self.given = global_positions, start, local, given

    @property
    def total(self) -> int:
        return int(self.positions.shape[-1])


def _replace(args, kwargs, key: _Key, value):
    if key[0] == "arg":
        args = args[:key[1]] + (value,) + args[key[1] + 1:]
    else:
        kwargs = dict(kwargs, **{key[1]: value})
    return args, kwargs


def _fetch(args, kwargs, key: _Key):
    if key[0] == "arg":
        return args[key[1]] if key[1] < len(args) else None
    return kwargs.get(key[1])


class SourceHook:
    """Pre / post hooks of one position source (see the module docstring)."""

    def __init__(self, name: str, module: Any, key: _Key, offset: int, offset_given: int,
                 context_of: Any) -> None:
        self.name, self.key, self.context_of = name, key, context_of
        self.offset, self.offset_given = offset, offset_given
        self.cls, self.module, self.calls = type(module).__name__, weakref.ref(module), 0
        self.pending: List[Optional[Tuple[int, int, int, int]]] = []
        self.handles = [module.register_forward_pre_hook(self.pre, with_kwargs=True),
                        module.register_forward_hook(self.post)]

    def _global(self, received: torch.Tensor, context: PositionContext) -> torch.Tensor:
        """The global positions this source reads, from what it received: the entry's positions passed
        down (this rank's block of them, plus the offset learned at setup), or the model's own count
        on the block (0-based, plus its offset), which is replaced by the same count over the whole
        sequence."""
        block = context.positions[..., context.start:context.start + context.local].to(received.device)
        k = self.offset_given if context.given else self.offset
        expected = [block + k]
        if not context.given:
            expected.append(torch.arange(context.local, device=received.device) + k)
        for base in expected:
            if _offset_from(received, base) == 0:
                return _shaped_like(context.positions.to(received.device) + k, received)
        raise ValueError(f"parallelize_model: {self.name} ({self.cls}) received positions that are neither "
                         f"this rank's block of the global positions nor the model's default "
                         f"0..{context.local - 1} "
                         f"(plus an offset): they depend on padding or token contents, which context "
                         f"parallelism cannot reproduce from one block; pass position_ids (this rank's block "
                         f"of the global ones, shard_sequence)")

    def pre(self, module: Any, args: Any, kwargs: Any) -> Any:
        self.calls += 1
        context = self.context_of()
        received = _fetch(args, kwargs, self.key)
        if context is None or not torch.is_tensor(received) or received.shape[-1] != context.local:
            self.pending.append(None)
            return None
        full = self._global(received, context).to(received.dtype)
        self.pending.append((received.ndim, context.start, context.local, context.total))
        return _replace(args, kwargs, self.key, full)

    def post(self, module: Any, args: Any, output: Any) -> Any:
        cut = self.pending.pop() if self.pending else None
        if cut is None:
            return None
        return _cut(output, *cut, where=f"{self.name} ({self.cls})")


def _offset_from(received: torch.Tensor, base: torch.Tensor) -> Optional[int]:
    try:
        diff = received.long() - base.long()
    except RuntimeError:   # shapes that do not broadcast
        return None
    first = diff.flatten()[:1]
    if first.numel() == 0 or not bool((diff == first).all()):
        return None
    return int(first)


def _shaped_like(full: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """The global positions (B, S) with ``received``'s leading dims (none, a batch of 1, a leading 3
    for multimodal rope)."""
    lead = tuple(received.shape[:-1])
    if full.shape[0] == 1 or bool((full == full[:1]).all()):
        return full[0].expand(*lead, full.shape[-1])
    if not lead or lead[-1] not in (1, full.shape[0]):
        raise ValueError(f"parallelize_model: positions of shape {tuple(received.shape)} do not match the "
                         f"batch of the global position_ids {tuple(full.shape)}")
    return full.expand(*lead[:-1], full.shape[0], full.shape[-1])


def _cut(value, ndim: int, start: int, local: int, total: int, where: str):
    if torch.is_tensor(value):
        dims = [d for d in range(value.ndim) if value.shape[d] == total]
        if not dims:
            return value   # no sequence dim (e.g. a scalar attention factor)
        dim = ndim - 1 if (ndim - 1) in dims else dims[0]
        return value.narrow(dim, start, local)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_cut(v, ndim, start, local, total, where) for v in value)
    if isinstance(value, list):
        return [_cut(v, ndim, start, local, total, where) for v in value]
    return value


def install(sources: Any, context_of: Any) -> List[SourceHook]:
    """Hooks on every source; ``context_of()`` gives the current forward's PositionContext (or None)."""
    return [SourceHook(name, module, key, k, k_given, context_of)
            for name, module, key, k, k_given, _ in sources]


def padding_dependent(sources: Any) -> List[str]:
    """Names of the sources whose positions the model counts from the padding mask."""
    return [f"{name} ({type(module).__name__})" for name, module, _, _, _, dependent in sources if dependent]


def entry_offset(sources: Any) -> int:
    """What to add to 0-based positions handed to the model's entry so that its sources see the same
    positions as when the model counts them itself (RoBERTa: padding_idx + 1); 0 when they agree."""
    shifts = {k - k_explicit for _, _, _, k, k_explicit, _ in sources}
    return shifts.pop() if len(shifts) == 1 else 0


class _Outputs:
    """Every module call's outputs, by (name, call index), in the order the calls ended."""

    def __init__(self, model):
        self.calls, self.counts = {}, {}
        self.handles = [m.register_forward_hook(self._hook(n), with_kwargs=True)
                        for n, m in model.named_modules() if m is not model]

    def _hook(self, name):
        def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            index = self.counts.get(name, 0)
            self.counts[name] = index + 1
            seen = [t.detach().clone() for t in _outputs([args, kwargs])]
            made = [t.detach().clone() for t in _outputs(output)]
            self.calls[(name, index)] = (type(module).__name__, seen, made)
        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _tail_differs(whole: torch.Tensor, tail: torch.Tensor, length: int, start: int) -> bool:
    """Whether ``tail`` (a block from ``start``) differs from ``whole``'s same positions; False when the
    tensors have no sequence dim to line up."""
    dims = [d for d in range(whole.ndim) if whole.shape[d] == length and tail.shape[d] == length - start]
    if len(dims) != 1 or not whole.is_floating_point():
        return False
    expected = whole.narrow(dims[0], start, length - start).double()
    scale = 1e-5 * (1.0 + float(expected.abs().max())) if expected.numel() else 0.0
    return expected.shape == tail.shape and bool(((expected - tail.double()).abs() > scale).any())


def block_differences(model: Any, run: Any, ids: Any, set_context: Any) -> List[str]:
    """Run ``ids`` whole and its second half alone as a later CP rank would (global positions through
    the source hooks, ``set_context``), attention token-local (the caller probes): the innermost module
    calls whose output on the half differs from the whole run's (positions counted on the block:
    an attention temperature from the local token index, positions from token contents ...)."""
    length = int(ids.shape[-1])
    start = length // 2
    recorded = []
    for block, first in ((ids, 0), (ids[:, start:], start)):
        set_context(PositionContext(torch.arange(length)[None], first, length - first, False))
        outputs = _Outputs(model)
        try:
            run(block, torch.arange(first, length)[None])
        finally:
            outputs.close()
            set_context(None)
        recorded.append(outputs.calls)
    whole, half = recorded
    differ = {}
    for key, (cls, inputs, tails) in half.items():
        full = whole.get(key)
        if full is None or len(full[2]) != len(tails) or len(full[1]) != len(inputs):
            continue
        if any(_tail_differs(a, b, length, start) for a, b in zip(full[1], inputs)):
            continue   # its inputs already differ: the cause is earlier
        if any(_tail_differs(a, b, length, start) for a, b in zip(full[2], tails)):
            differ[key[0]] = cls
    names = [n for n in differ if not any(o != n and o.startswith(n + ".") for o in differ)]
    return [f"{n} ({differ[n]})" for n in sorted(names)]
