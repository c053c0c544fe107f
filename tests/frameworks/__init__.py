"""What a platform-neutral test case needs from the framework it runs on.

The cases in ``tests/cases/`` are written once and run on every platform: their inputs and expected
values are numpy arrays, and the few things that differ between frameworks -- making a tensor,
autograd, a Module/Cell, an optimizer step, the names of functional ops -- come from the adapter of
the framework the worker runs (:func:`current`). Adapters live in ``torch_adapter.py`` and
``mindspore_adapter.py`` and share one interface (documented on :class:`torch_adapter.TorchAdapter`).

Nothing here imports a framework at import time: MindSpore workers have no torch, torch workers no
MindSpore.
"""
import zlib

import numpy as np

TOL = {"atol": 1e-5, "rtol": 1e-5}

_adapter = None


def current():
    """The adapter of the framework this worker's platform runs on (``torch`` also covers ``npu``)."""
    global _adapter
    if _adapter is None:
        from hyper_parallel.platform import get_platform
        if get_platform().name == "mindspore":
            from tests.frameworks.mindspore_adapter import MindSporeAdapter
            _adapter = MindSporeAdapter()
        else:
            from tests.frameworks.torch_adapter import TorchAdapter
            _adapter = TorchAdapter()
    return _adapter


def inp(tag, rank, shape, dtype=np.float32):
    """The deterministic input of ``rank`` for check ``tag`` (any rank can build any rank's)."""
    gen = np.random.RandomState(zlib.crc32(f"{tag}/{rank}".encode()))
    return gen.standard_normal(tuple(shape)).astype(dtype)


def t(array):
    """A tensor of the current framework with ``array``'s values (a contiguous copy)."""
    return current().tensor(array)


def np_of(x):
    """A numpy array of a tensor, a DTensor (its full value) or anything numpy understands."""
    if hasattr(x, "full_tensor") and hasattr(x, "placements"):
        x = x.full_tensor()
    if isinstance(x, (np.ndarray, np.generic, int, float, bool, list, tuple)):
        return np.asarray(x)
    return current().numpy(x)


def close(actual, expected, what, **tol):
    """``actual`` (tensor, DTensor or array) equals ``expected`` (array) in shape and values."""
    actual, expected = np_of(actual), np.asarray(np_of(expected))
    assert tuple(actual.shape) == tuple(expected.shape), \
        f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    if actual.dtype == np.bool_ or expected.dtype == np.bool_:
        assert (actual == expected).all(), f"{what}: {actual} != {expected}"
        return
    np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64),
                               err_msg=what, **(tol or TOL))


def grad_of(fn, *inputs):
    """d/d inputs of the scalar ``fn(*inputs)`` through the current framework's autograd."""
    return current().grad(fn, *inputs)


def expect_error(error, fn, *fragments):
    """``fn()`` raises ``error`` whose message contains every fragment."""
    try:
        fn()
    except error as exc:
        for fragment in fragments:
            assert fragment in str(exc), f"{error.__name__} without {fragment!r}: {exc}"
        return
    raise AssertionError(f"expected {error.__name__} ({', '.join(fragments)}), nothing was raised")


def call(fn, *args, async_op, **kwargs):
    """A collective, waited for when it was started with ``async_op=True``."""
    from hyper_parallel.platform import AsyncHandle
    result = fn(*args, async_op=async_op, **kwargs)
    if async_op:
        assert isinstance(result, AsyncHandle), f"async_op=True returned {type(result)}"
        result = result.wait()
    return result
