"""Helpers for MindSpore cases (run in the workers: numpy + mindspore only)."""
import zlib

import numpy as np

TOL = {"atol": 1e-5, "rtol": 1e-5}


def inp(tag, rank, shape, dtype=np.float32):
    """The deterministic input of ``rank`` for check ``tag`` (any rank can build any rank's)."""
    gen = np.random.RandomState(zlib.crc32(f"{tag}/{rank}".encode()))
    return gen.standard_normal(tuple(shape)).astype(dtype)


def t(array, dtype=None):
    import mindspore as ms
    return ms.Tensor(np.array(array, order="C"), dtype=dtype)


def np_of(x):
    if hasattr(x, "asnumpy"):
        return x.asnumpy()
    if hasattr(x, "full_tensor"):
        return x.full_tensor().asnumpy()
    return np.asarray(x)


def close(actual, expected, what, **tol):
    actual, expected = np_of(actual), np.asarray(expected)
    assert tuple(actual.shape) == tuple(expected.shape), \
        f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    if actual.dtype == np.bool_ or expected.dtype == np.bool_:
        assert (actual == expected).all(), f"{what}: {actual} != {expected}"
        return
    np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64),
                               err_msg=what, **(tol or TOL))


def call(fn, *args, async_op, **kwargs):
    from hyper_parallel.platform import AsyncHandle
    result = fn(*args, async_op=async_op, **kwargs)
    if async_op:
        assert isinstance(result, AsyncHandle), f"async_op=True returned {type(result)}"
        result = result.wait()
    return result


def grad_of(fn, *inputs):
    """d/d inputs of fn(*inputs) (a scalar) with MindSpore's autograd."""
    import mindspore as ms
    positions = tuple(range(len(inputs)))
    grads = ms.grad(fn, grad_position=positions)(*inputs)
    return grads if isinstance(grads, tuple) else (grads,)
