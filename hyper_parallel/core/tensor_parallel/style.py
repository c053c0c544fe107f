"""Parallel styles: how one module is split over a 1-D tensor-parallel mesh.

A style does three things to the module it is applied to:

1. its parameters become DTensor parameters (sharded or replicated);
2. a forward pre-hook turns the inputs into DTensors of the layout the layer needs
   (``from_local`` with the declared ``input_layouts``, then ``redistribute``);
3. a forward hook moves the output to ``output_layouts`` and, with ``use_local_output``,
   hands back the local shard (a plain tensor).

The ops inside the module then run through the DTensor sharding rules: a column-wise Linear has
its weight split on the output features (``Shard(0)``) and yields ``Shard(-1)`` outputs with no
communication; a row-wise Linear contracts over a split dim and yields a ``Partial`` sum that the
output hook reduces (one all-reduce to ``Replicate``, or one reduce-scatter to ``Shard(1)``).

Feature counts the TP size does not divide are sharded unevenly (``torch.chunk`` pieces: earlier
ranks one larger, trailing ranks possibly empty) and give the single-process result.

The styles mirror PyTorch's ``torch.distributed.tensor.parallel`` styles, so plans port as-is. The
Prepare* styles live in ``prepare.py`` and are re-exported here.
"""
from typing import Any
from hyper_parallel.core.arguments import check_int
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.core.dtensor.rank_check import describing
from hyper_parallel.core.tensor_parallel.base import (ParallelStyle, _check_mesh, _one_layout, check_tp_mesh,
                                                      from_dtensor, map_outputs, replicate_parameters,
                                                      shard_parameters, to_dtensor)
from hyper_parallel.core.tensor_parallel.prepare import (PrepareModuleInput, PrepareModuleInputOutput,
                                                         PrepareModuleOutput)
from hyper_parallel.platform import get_platform

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "NoParallel",
           "check_tp_mesh"]


# ---------------------------------------------------------------------------- helpers
def _module_kind(module):
    platform = get_platform()
    if platform.is_linear(module):
        return "linear"
    if platform.is_embedding(module):
        return "embedding"
    return None


def _embedding_weight(module):
    return get_platform().embedding_weight_name(module)


def _unsupported(style, module, supported="nn.Linear and nn.Embedding"):
    return ValueError(f"{type(style).__name__} supports {supported}; got a {type(module).__name__} module. "
                      f"Parallelize its Linear/Embedding children instead (a plan dict such as "
                      f"{{'attention.wq': ColwiseParallel()}}), or use PrepareModuleInput/"
                      f"PrepareModuleOutput, SequenceParallel or NoParallel for other modules")


# ---------------------------------------------------------------------------- styles
class ColwiseParallel(ParallelStyle):
    """Split a Linear's output features (weight and bias ``Shard(0)``) or an Embedding's embedding
    dim (weight ``Shard(1)``). The input is replicated (``input_layouts``, default ``Replicate()``);
    the output is ``Shard(-1)`` unless ``output_layouts`` says otherwise. Forward needs no
    communication; backward all-reduces the input gradient."""

    def __init__(self, *, input_layouts: Any = None, output_layouts: Any = None,
                 use_local_output: bool = True) -> None:
        self.input_layouts = _one_layout(input_layouts, Replicate(), "ColwiseParallel input_layouts")
        self.output_layouts = _one_layout(output_layouts, Shard(-1), "ColwiseParallel output_layouts")
        self.use_local_output = use_local_output

    def apply(self, module: Any, device_mesh: Any) -> Any:
        _check_mesh(device_mesh, self)
        kind = _module_kind(module)
        if kind is None:
            raise _unsupported(self, module)
        if kind == "linear":
            shard_parameters(module, device_mesh, {"weight": Shard(0), "bias": Shard(0)}, self.src_data_rank)
        else:
            shard_parameters(module, device_mesh, {_embedding_weight(module): Shard(1)}, self.src_data_rank)
        _install_io_hooks(module, device_mesh, self.input_layouts, Replicate(), self.output_layouts,
                          self.use_local_output, _in_features(module, kind), type(self).__name__)
        return module


class RowwiseParallel(ParallelStyle):
    """Split a Linear's input features (weight ``Shard(1)``, bias replicated and added once) or an
    Embedding's vocabulary (weight ``Shard(0)``, masked lookup). The output is a Partial sum,
    reduced to ``output_layouts`` (default ``Replicate()``: one all-reduce; ``Shard(1)``: one
    reduce-scatter, as in sequence parallelism).

    ``input_layouts`` defaults to ``Shard(-1)`` for a Linear (the output of a ColwiseParallel
    layer) and to ``Replicate()`` for an Embedding (token ids are replicated)."""

    def __init__(self, *, input_layouts: Any = None, output_layouts: Any = None,
                 use_local_output: bool = True) -> None:
        self.input_layouts = _one_layout(input_layouts, None, "RowwiseParallel input_layouts")
        self.output_layouts = _one_layout(output_layouts, Replicate(), "RowwiseParallel output_layouts")
        self.use_local_output = use_local_output

    def apply(self, module: Any, device_mesh: Any) -> Any:
        _check_mesh(device_mesh, self)
        kind = _module_kind(module)
        if kind is None:
            raise _unsupported(self, module)
        desired: Any   # Shard or Replicate
        if kind == "linear":
            shard_parameters(module, device_mesh, {"weight": Shard(1), "bias": Replicate()},
                             self.src_data_rank)
            input_layout, desired = self.input_layouts or Shard(-1), Shard(-1)
        else:
            shard_parameters(module, device_mesh, {_embedding_weight(module): Shard(0)}, self.src_data_rank)
            input_layout, desired = self.input_layouts or Replicate(), Replicate()
        _install_io_hooks(module, device_mesh, input_layout, desired, self.output_layouts,
                          self.use_local_output, _in_features(module, kind), type(self).__name__)
        return module


def _in_features(module, kind):
    """A Linear's global input features (the weight is (out, in) on every platform), so that a
    local input sharded on its features can be uneven; None for an Embedding (its input is ids)."""
    if kind != "linear":
        return None
    return int(dict(get_platform().named_parameters(module))["weight"].shape[1])


def _install_io_hooks(module, mesh, input_layout, desired_input, output_layout, use_local_output,
                      feature_size=None, style_name="tensor parallelism"):
    platform = get_platform()

    def pre_hook(mod, args):
        if not args:
            raise ValueError(f"{type(mod).__name__} under tensor parallelism expects its input "
                             f"positionally")
        # the cross-rank checks of from_local (rank_check.py) name the module they stopped
        with describing(f"{style_name} input ({input_layout}) of {type(mod).__name__}"):
            return (to_dtensor(args[0], mesh, input_layout, desired_input, feature_size),) + tuple(args[1:])

    def post_hook(mod, args, output):
        return from_dtensor(output, mesh, output_layout, use_local_output)

    platform.register_forward_pre_hook(module, pre_hook)
    platform.register_forward_hook(module, post_hook)


class SequenceParallel(ParallelStyle):
    """Run a norm / dropout (any module whose ops act per token) on sequence shards.

    Parameters are replicated. Tensor inputs are taken as ``Shard(sequence_dim)`` (local tensors
    are this rank's sequence chunk; DTensors are redistributed to it), so the output is
    ``Shard(sequence_dim)``: a DTensor, or its local chunk with ``use_local_output=True``.
    Norm-weight gradients are all-reduced in backward (each rank saw part of the sequence)."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        self.sequence_dim = check_int("SequenceParallel", "sequence_dim", sequence_dim,
                                      fix="the int sequence dim of the activations (1)")
        self.use_local_output = use_local_output

    def apply(self, module: Any, device_mesh: Any) -> Any:
        _check_mesh(device_mesh, self)
        replicate_parameters(module, device_mesh, self.src_data_rank)
        platform = get_platform()
        layout = Shard(self.sequence_dim)

        def pre_hook(mod, args):
            # each rank's chunk must be an equal share: from_local's cross-rank check (first call of a
            # shape, every call under HP_DTENSOR_DEBUG=1) raises on every rank otherwise, before the
            # uneven chunks reach a collective
            with describing(f"SequenceParallel(sequence_dim={self.sequence_dim}) input of "
                            f"{type(mod).__name__}",
                            f"Every rank must pass an equal chunk of the sequence: pad the sequence to a "
                            f"multiple of the tensor-parallel size {device_mesh.size()}"):
                return tuple(to_dtensor(a, device_mesh, layout, layout) for a in args)

        def post_hook(mod, args, output):
            if not self.use_local_output:
                return output
            return map_outputs(output, lambda o: from_dtensor(o, device_mesh, None, True))

        platform.register_forward_pre_hook(module, pre_hook)
        platform.register_forward_hook(module, post_hook)
        return module


class NoParallel(ParallelStyle):
    """Keep a module whole on every rank, but in DTensor form: its parameters become
    ``Replicate()`` DTensors (so optimizers, gradient clipping and checkpoints treat every
    parameter alike), its input is taken as ``input_layout`` (default ``Replicate()``) and
    replicated, and its output is moved to ``output_layout`` (default ``Replicate()``), as a local
    tensor with ``use_local_output=True``. Typical use: a small router or gate."""

    def __init__(self, *, input_layout: Any = None, output_layout: Any = None,
                 use_local_output: bool = True) -> None:
        self.input_layout = _one_layout(input_layout, Replicate(), "NoParallel input_layout")
        self.output_layout = _one_layout(output_layout, Replicate(), "NoParallel output_layout")
        self.use_local_output = use_local_output

    def apply(self, module: Any, device_mesh: Any) -> Any:
        _check_mesh(device_mesh, self)
        replicate_parameters(module, device_mesh, self.src_data_rank)
        platform = get_platform()

        def pre_hook(mod, args):
            if not args:
                return args
            with describing(f"NoParallel input of {type(mod).__name__}"):
                return (to_dtensor(args[0], device_mesh, self.input_layout, Replicate()),) + tuple(args[1:])

        def post_hook(mod, args, output):
            return map_outputs(output, lambda o: from_dtensor(o, device_mesh, self.output_layout,
                                                              self.use_local_output))

        platform.register_forward_pre_hook(module, pre_hook)
        platform.register_forward_hook(module, post_hook)
        return module
