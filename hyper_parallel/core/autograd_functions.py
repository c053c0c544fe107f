"""``lazy_autograd_function``: the one way core defines an autograd function.

Core writes forward and backward once, framework-neutral; the platform turns them into its own
autograd function (``make_autograd_function``). A core module is imported before the platform may
be chosen, and tests switch platforms, so the function is built on its first call for the current
platform and rebuilt when the platform changes (after ``reset_platform()``).
"""
from typing import Any
from hyper_parallel.platform import get_platform


class LazyAutogradFunction:
    __slots__ = ("name", "forward", "backward", "_built")

    def __init__(self, name: str, forward: Any, backward: Any) -> None:
        self.name, self.forward, self.backward = name, forward, backward
        self._built = None   # (platform, its function)

    def __call__(self, *args):
        platform = get_platform()
        built = self._built
        if built is None or built[0] is not platform:
            built = self._built = (platform, platform.make_autograd_function(self.name, self.forward,
                                                                             self.backward))
        return built[1](*args)


def lazy_autograd_function(name: str, forward: Any, backward: Any) -> Any:
    """``forward(ctx, *args)`` / ``backward(ctx, *grads)`` as a callable autograd function of the
    current platform (built on first call)."""
    return LazyAutogradFunction(name, forward, backward)
