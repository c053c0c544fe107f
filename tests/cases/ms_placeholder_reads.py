"""Every way a MindSpore user may read a DTensor's data outside the library's operators (SPEC §19,
issue 36 item 7): each gives the right value or raises naming the fix, never the empty placeholder.
``ms.Tensor(dt)`` is the one path left: MindSpore's constructor copies the placeholder in C++ and
reads nothing a DTensor could answer (it asks only ``__class__``), so it returns an empty tensor of
shape (0,): an open limit."""
import numpy as np

from tests.frameworks import inp

FIX = "dt.to_local()"
RAISE = {  # path -> the fragment its error names
    "ms.Parameter(dt)": "ms.Parameter(dtensor)", "ms.Parameter(dt, name)": "ms.Parameter(dtensor)",
    "np.asarray(dt)": FIX, "np.array(dt)": FIX, "dt.asnumpy()": FIX, "dt.numpy()": FIX,
    "dt.tolist()": FIX, "dt.item()": FIX, "pickle": "pickling a DTensor", "ms.Tensor(dt.asnumpy())": FIX,
    "dt.untyped_storage()": FIX, "ms.save_checkpoint": "ms.save_checkpoint",
}
EXACT = ("copy.copy(dt)", "copy.deepcopy(dt)", "dt.data", "dt.copy()", "dt.contiguous()")


def _paths(ms, dt, rank):
    import copy
    import pickle
    return {
        "ms.Parameter(dt)": lambda: ms.Parameter(dt),
        "ms.Parameter(dt, name)": lambda: ms.Parameter(dt, name="w"),
        "np.asarray(dt)": lambda: np.asarray(dt),
        "np.array(dt)": lambda: np.array(dt),
        "dt.asnumpy()": lambda: dt.asnumpy(),
        "dt.numpy()": lambda: dt.numpy(),
        "dt.tolist()": lambda: dt.tolist(),
        "dt.item()": lambda: dt.item(),
        "pickle": lambda: pickle.loads(pickle.dumps(dt)),
        "ms.Tensor(dt.asnumpy())": lambda: ms.Tensor(dt.asnumpy()),
        "dt.untyped_storage()": lambda: dt.untyped_storage(),
        "ms.save_checkpoint": lambda: ms.save_checkpoint([{"name": "w", "data": dt}], f"ph-{rank}.ckpt"),
        "copy.copy(dt)": lambda: copy.copy(dt),
        "copy.deepcopy(dt)": lambda: copy.deepcopy(dt),
        "dt.data": lambda: dt.data,
        "dt.copy()": lambda: dt.copy(),
        "dt.contiguous()": lambda: dt.contiguous(),
    }


def placeholder_reads(rank, world_size):
    import os
    import tempfile

    import mindspore as ms

    from hyper_parallel import DTensor, Shard, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    whole = inp("ms-ph", 0, (2 * world_size, 3))
    dt = DTensor.from_local(ms.Tensor(whole[2 * rank:2 * rank + 2]), mesh, [Shard(0)])
    os.chdir(tempfile.mkdtemp())
    for name, fn in _paths(ms, dt, rank).items():
        try:
            value = fn()
        except (ValueError, TypeError) as exc:
            assert name in RAISE and RAISE[name] in str(exc), (name, str(exc))
            continue
        assert name in EXACT, f"{name} returned {type(value).__name__} without raising"
        assert isinstance(value, DTensor) and tuple(value.shape) == whole.shape, (name, value.shape)
        np.testing.assert_allclose(value.full_tensor().asnumpy(), whole, err_msg=name)
    return True
