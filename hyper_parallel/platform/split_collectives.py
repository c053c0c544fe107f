"""Differentiable collectives split into a start and a wait, so that compute runs while they travel.

``start(platform, kind, tensor, group, dims)`` launches the raw collective with ``async_op=True``
and returns a ``PendingCollective``; its ``wait()`` returns the result as a differentiable tensor.
The autograd graph gets two nodes per collective, Start (input -> an empty token) and Wait (token
-> result). Backward reaches Wait first: it launches the adjoint collective of the gradient and
returns at once; Start, reached later, waits for it. The engine runs ready nodes newest first, so
the nodes created in forward between the start and the wait (the compute the collective
overlapped) have their backward run while the gradient collective travels.

torch and MindSpore both use it. MindSpore's PyNative engine does not run ready nodes newest first:
it reaches a Start node (the wait) before the compute created after that Start, so there a
gradient collective overlaps the other collectives of backward rather than compute
(tests/test_cp_async.py records both orders).

Kinds (``dims``): ``"all_to_all"`` (split_dim, concat_dim; adjoint: the inverse all-to-all),
``"all_gather"`` (dim,; adjoint: a reduce-scatter sum). ``observer(event)``, if given, hears
"start", "wait", "grad_start" and "grad_wait" when they happen (tests check the overlap order).
"""
from typing import Any
import weakref

KINDS = ("all_to_all", "all_gather")


def _check(kind, dims):
    wanted = {"all_to_all": 2, "all_gather": 1}
    if kind not in wanted or len(dims) != wanted[kind]:
        raise ValueError(f"split collective {kind!r} with dims {dims}: expected one of {KINDS} with "
                         f"(split_dim, concat_dim) for all_to_all or (dim,) for all_gather")


def _launch(platform, kind, tensor, group, dims, adjoint):
    tensor = tensor.contiguous()
    if kind == "all_to_all":
        split, concat = (dims[1], dims[0]) if adjoint else dims
        return platform.all_to_all_single(tensor, group, split, concat, async_op=True)
    if adjoint:
        return platform.reduce_scatter(tensor, group, dims[0], "sum", async_op=True)
    return platform.all_gather(tensor, group, dims[0], async_op=True)


class PendingCollective:
    """One collective in flight (forward) and, later, its gradient's (backward)."""

    def __init__(self, platform: Any, kind: Any, group: Any, dims: Any, observer: Any = None) -> None:
        self.platform, self.kind, self.group, self.dims = platform, kind, group, tuple(dims)
        self.observer = observer
        self.handle = self.grad_handle = self.token = self.result = None   # no tensor kept after use

    def notify(self, event: Any) -> None:
        if self.observer is not None:
            self.observer(event)

    def wait(self) -> Any:
        """The collective's result (differentiable); call once."""
        token, self.token = self.token, None
        return _functions(self.platform)[1](token, self)


def _start_forward(ctx, tensor, pending):
    ctx.pending = pending
    pending.handle = _launch(pending.platform, pending.kind, tensor, pending.group, pending.dims, False)
    pending.notify("start")
    return tensor.new_zeros((0,))       # the token: links Wait to Start in the graph, carries nothing


def _start_backward(ctx, _token_grad):
    pending = ctx.pending
    grad = pending.grad_handle.wait()
    pending.grad_handle = None
    pending.notify("grad_wait")
    return grad, None


def _wait_forward(ctx, token, pending):
    ctx.pending = pending
    result = pending.handle.wait()
    pending.handle = None
    pending.notify("wait")
    return result


def _wait_backward(ctx, grad):
    pending = ctx.pending
    pending.grad_handle = _launch(pending.platform, pending.kind, grad, pending.group, pending.dims, True)
    pending.notify("grad_start")
    return grad.new_zeros((0,)), None


# keyed by the platform object itself, weakly: an entry lives exactly as long as its platform
# (an id() key could be inherited by a later platform at the same address)
_CACHE: "weakref.WeakKeyDictionary[object, tuple]" = weakref.WeakKeyDictionary()


def _functions(platform):
    """(Start, Wait) autograd functions of ``platform``, built once."""
    functions = _CACHE.get(platform)
    if functions is None:
        make = platform.make_autograd_function
        functions = _CACHE[platform] = (make("SplitCollectiveStart", _start_forward, _start_backward),
                                        make("SplitCollectiveWait", _wait_forward, _wait_backward))
    return functions


def start(platform: Any, kind: Any, tensor: Any, group: Any, dims: Any, observer: Any = None) -> Any:
    """Launch ``kind`` on ``tensor`` asynchronously; the returned pending's ``wait()`` finishes it."""
    _check(kind, dims)
    pending = PendingCollective(platform, kind, group, dims, observer)
    pending.token = _functions(platform)[0](tensor, pending)
    return pending


class SplitCollectivesContract:
    """The platform member of split collectives (a base of ``Platform``, see base.py)."""

    def start_differentiable_collective(self, kind: Any, tensor: Any, group: Any, dims: Any,
                                        observer: Any = None) -> Any:
        """Launch the differentiable collective ``kind`` ("all_to_all" with dims (split_dim,
        concat_dim), "all_gather" with (dim,)) asynchronously; the returned pending's ``wait()``
        gives the result, and backward overlaps the same way."""
        return start(self, kind, tensor, group, dims, observer)
