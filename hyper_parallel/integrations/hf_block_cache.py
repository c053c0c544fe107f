"""The tokens before a rank's block, told through the one channel some modules read them from: a KV cache.

A module that counts positions itself from ``arange(block length)`` plus the cache's past length (Llama 4's
attention temperature on its NoPE layers; transformers' idiom for continuing a sequence) restarts at 0 on
every CP rank: the audit (hf_positions.block_differences) finds it as a module whose output on a later
block differs from the whole sequence's. To such a module a rank's block IS a continuation of the
``start`` tokens before it, so it is handed a ``BlockCache`` reporting ``start`` past tokens whose
``update`` passes the block's keys and values through unchanged (attention still reaches the earlier
tokens through context parallelism, not through the cache). The audit re-runs with the caches in place
and keeps them only if every difference is gone; otherwise the model is refused as before.
"""
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

_CACHE_ARGS = ("cache", "past_key_values")


class BlockCache:
    """A KV cache that holds the ``start`` tokens before this rank's block and stores nothing."""

    def __init__(self, start: int, on_read: Optional[Callable[[], None]] = None) -> None:
        self.start, self.on_read = int(start), on_read

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.on_read is not None:
            self.on_read()
        return self.start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        return key_states, value_states


def cache_argument(module: torch.nn.Module) -> Optional[str]:
    """The name of ``module.forward``'s KV-cache parameter, or None."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in _CACHE_ARGS if name in parameters), None)


class BlockCacheHook:
    """Hands ``module`` a BlockCache of this call's block start when its caller passes no cache.

    ``start_of(block_length)`` is the block's global start: the current forward's (its PositionContext),
    or, for a call outside a forward (activation checkpointing recomputing a layer in backward), this
    rank's index times the block length, which is the same number."""

    def __init__(self, module: torch.nn.Module, argument: str, start_of: Callable[[int], int]) -> None:
        self.argument, self.start_of, self.read = argument, start_of, False
        self.handle = module.register_forward_pre_hook(self.pre, with_kwargs=True)

    def pre(self, module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        if kwargs.get(self.argument) is not None:
            return None
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not torch.is_tensor(hidden) or hidden.ndim < 2:
            return None
        cache = BlockCache(self.start_of(int(hidden.shape[1])), lambda: setattr(self, "read", True))
        return args, dict(kwargs, **{self.argument: cache})

    def remove(self) -> None:
        self.handle.remove()


def readers(model: torch.nn.Module, run: Callable[[], None], start_of: Callable[[int], int]) -> List[str]:
    """The innermost modules taking a KV cache that read its length during ``run()`` (each handed a
    BlockCache): they count positions from it, at any offset, whether or not the probe's short sequence
    shows it (Llama 4's temperature changes only every ``floor_scale`` = 8192 tokens)."""
    named = [(n, m, a) for n, m in model.named_modules() if n and (a := cache_argument(m)) is not None]
    inner = [(n, m, a) for n, m, a in named if not any(o.startswith(n + ".") for o, _, _ in named)]
    hooks = [(n, BlockCacheHook(m, a, start_of)) for n, m, a in inner]
    try:
        run()
    except Exception:   # a module that reads more of a cache than its length: none is offered one
        return []
    finally:
        for _, hook in hooks:
            hook.remove()
    return [n for n, hook in hooks if hook.read]


def offer(model: torch.nn.Module, names: List[str], start_of: Callable[[int], int]) -> List[BlockCacheHook]:
    """Hooks on the named modules (or their nearest ancestor) that take a KV cache; [] when one has none."""
    modules = dict(model.named_modules())
    targets: Dict[str, str] = {}
    for name in names:
        target, argument = name, cache_argument(modules[name])
        while target and argument is None:
            target = target.rpartition(".")[0]
            argument = cache_argument(modules[target]) if target else None
        if argument is None:
            return []
        targets[target] = argument
    return [BlockCacheHook(modules[t], argument, start_of) for t, argument in targets.items()]


def remedy(model: torch.nn.Module, found: List[str], probe: Callable[[], List[str]], run: Callable[[], None],
           start_of: Callable[[int], int]) -> Tuple[List[BlockCacheHook], List[str]]:
    """(hooks to keep, differences left): BlockCaches for the modules whose later block differs
    (``found``, "name (Class)") and for every reader of a cache's length, kept when ``probe()`` (the
    block comparison) then finds no difference; none kept otherwise."""
    targets = [f.split(" (")[0] for f in found] + readers(model, run, start_of)
    hooks = offer(model, targets, start_of) if targets else []
    if not hooks:
        return [], found
    try:
        remaining = probe()
    except Exception:   # the model reads more of a cache than its length: not this remedy
        remaining = None
    if remaining == []:
        return hooks, []
    for hook in hooks:
        hook.remove()
    return [], found or remaining or []
