"""What MindSpore training needs from the platform beyond DTensor ops: tensor factories, a gradient
reducer in ``nn.TrainOneStepCell``, checkpoint files, and the PyNative-only guard.

``MindSporeTrainingSupport`` is mixed into ``MindSporePlatform``. Core drives all of it:
``core/data_parallel/api.py`` (the gradient all-reduce, on ``core/data_parallel/reducer.py``),
``core/dtensor/checkpoint_layout.py`` (layouts and resharding) and ``core/dtensor/factories.py``.

MindSpore hands gradients to the training step as one tuple, in the optimizer's parameter order
(``grads = self.grad(self.network, self.weights)(...)``, then ``self.grad_reducer(grads)``), not
through per-parameter hooks as torch does; so data parallelism here replaces that ``grad_reducer``
Cell instead of hooking backward.
"""
from typing import Any
import numpy as np

import mindspore as ms
from mindspore import mint, ops

from hyper_parallel.platform.mindspore import compile_guard, placeholder_reads, reflected_ops
from hyper_parallel.platform.mindspore.compile_guard import GRAPH_MODE_MESSAGE, check_pynative
from hyper_parallel.platform.mindspore.fully_shard_support import MindSporeFullyShardSupport


class _GradReducerCell(ms.nn.Cell):
    """``TrainOneStepCell.grad_reducer``: applies core's reducer to the gradient tuple."""

    def __init__(self, reduce_fn):
        super().__init__(auto_prefix=False)
        self._reduce_fn = reduce_fn

    def construct(self, grads):
        return self._reduce_fn(grads)


def _graph_mode_refusal(who):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"{who} called in GRAPH_MODE. {GRAPH_MODE_MESSAGE}")
    return refuse


def _to_numpy(tensor):
    # numpy has no bfloat16: such pieces travel as float32 and are cast back on assignment
    if tensor.dtype == ms.bfloat16:
        tensor = tensor.astype(ms.float32)
    return tensor.asnumpy()


class MindSporeTrainingSupport(MindSporeFullyShardSupport):   # fully_shard's members: its own file
    """Mixin of ``MindSporePlatform`` (see the module docstring)."""

    # gradients become ready together, as the tuple a training step hands its grad_reducer (core:
    # data_parallel/api.py's TupleGradReducer), not one by one through hooks
    gradients_as_tuple = True

    def __init__(self) -> None:
        super().__init__()
        compile_guard.install()
        reflected_ops.install()
        placeholder_reads.install()

    @staticmethod
    def check_execution_mode(who: Any) -> None:
        check_pynative(who)

    # ---------------------------------------------------------------- tensor factories
    @staticmethod
    def create_tensor(kind: Any, shape: Any, dtype: Any = None, device: Any = None,
                      fill_value: Any = None) -> Any:
        """The factory ``kind`` (zeros / ones / empty / full / rand / randn) on ``shape``; rand and
        randn draw from MindSpore's global seed (``ms.set_seed``) exactly as ``ops.rand`` /
        ``ops.randn`` called directly do."""
        shape = tuple(int(s) for s in shape)
        dtype = dtype or ms.float32
        if kind == "full":  # mint.full has no CPU kernel (FillScalar)
            return ops.full(shape, fill_value, dtype=dtype)
        if kind in ("rand", "randn"):
            return getattr(ops, kind)(*shape, dtype=dtype) if shape else getattr(ops, kind)((), dtype=dtype)
        if kind == "empty":  # an uninitialised CPU buffer may hold NaN garbage; zeros is as cheap
            kind = "zeros"
        return getattr(mint, kind)(shape, dtype=dtype)

    # ---------------------------------------------------------------- gradient reducer
    @staticmethod
    def install_grad_reducer(cell: Any, reduce_fn: Any, who: Any) -> bool:
        """Make ``reduce_fn(grads) -> grads`` the gradient reducer of a ``TrainOneStepCell``-like
        Cell (one with ``network`` and ``grad_reducer``); returns False for any other Cell (the
        caller applies the reducer itself). Calling the train step in GRAPH_MODE then raises (GRAPH_MODE
        compiles it through ``compile_and_run``; PyNative never calls that)."""
        if not (isinstance(cell, ms.nn.Cell) and hasattr(cell, "grad_reducer") and hasattr(cell, "network")):
            return False
        cell.grad_reducer = _GradReducerCell(reduce_fn)
        object.__setattr__(cell, "compile_and_run", _graph_mode_refusal(who))
        return True

    @staticmethod
    def train_step_network(cell: Any) -> Any:
        """The network a ``TrainOneStepCell``-like Cell trains, or ``cell`` itself."""
        network = getattr(cell, "network", None)
        return network if isinstance(network, ms.nn.Cell) and hasattr(cell, "grad_reducer") else cell

    # ---------------------------------------------------------------- checkpoint files
    @staticmethod
    def save_tensor_file(path: Any, named_tensors: Any) -> None:
        """Write ``{name: tensor}`` as a MindSpore checkpoint (``ms.load_checkpoint`` reads it)."""
        ms.save_checkpoint([{"name": name, "data": ms.Tensor(t) if not isinstance(t, ms.Tensor) else t}
                            for name, t in named_tensors.items()], path)

    @staticmethod
    def load_tensor_file(path: Any) -> Any:
        """``{name: numpy array}`` of a MindSpore checkpoint file."""
        return {name: _to_numpy(param) for name, param in ms.load_checkpoint(path).items()}

    @staticmethod
    def tensor_to_numpy(tensor: Any) -> Any:
        return _to_numpy(tensor)

    @staticmethod
    def parameter_name(param: Any) -> Any:
        """The name a parameter is saved under (MindSpore: ``Parameter.name``, the Cell path)."""
        return param.name

    @staticmethod
    def assign_parameter(param: Any, array: Any) -> None:
        """Overwrite ``param``'s values in place (it keeps its dtype, shape and identity, so
        optimizers and DTensor views holding it see the new values)."""
        array = np.asarray(array)
        if tuple(array.shape) != tuple(param.shape):
            raise ValueError(f"cannot assign an array of shape {tuple(array.shape)} to parameter "
                             f"{param.name} of shape {tuple(param.shape)}")
        param.set_data(ms.Tensor(array.astype(np.float32) if param.dtype == ms.bfloat16 else array)
                       .astype(param.dtype))
