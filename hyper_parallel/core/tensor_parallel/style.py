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

The styles mirror PyTorch's ``torch.distributed.tensor.parallel`` styles, so plans port as-is.
"""
from hyper_parallel.core.dtensor.api import distribute_tensor
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Placement, Replicate, Shard
from hyper_parallel.platform import get_platform

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "NoParallel"]


# ---------------------------------------------------------------------------- helpers
def _one_layout(value, default, what):
    """A single placement (also accepted: a 1-tuple of one, as PyTorch plans often write)."""
    if value is None:
        return default
    if isinstance(value, (tuple, list)):
        if len(value) != 1:
            raise ValueError(f"{what} takes one placement for the 1-D tensor-parallel mesh, got {value!r}")
        value = value[0]
    if not isinstance(value, Placement):
        raise ValueError(f"{what} must be a placement such as Shard(-1) or Replicate(), got {value!r}")
    return value


def _layout_tuple(value, what):
    """A tuple of placements-or-None, one per input/output (a single placement becomes a 1-tuple)."""
    if value is None:
        return None
    if isinstance(value, Placement):
        return (value,)
    value = tuple(value)
    for v in value:
        if v is not None and not isinstance(v, Placement):
            raise ValueError(f"{what} entries must be placements or None, got {v!r}")
    return value


def _is_tensor(x):
    return get_platform().is_tensor(x)


def to_dtensor(x, mesh, input_layout, desired_layout):
    """``x`` (a local tensor laid out as ``input_layout``, or a DTensor) as a DTensor of
    ``desired_layout`` on ``mesh`` (differentiable)."""
    if not _is_tensor(x):
        return x
    if isinstance(x, DTensor):
        if x.device_mesh != mesh:
            raise ValueError(f"input DTensor lives on {x.device_mesh}, but the module is parallelized on "
                             f"{mesh}; redistribute it onto the tensor-parallel mesh first")
        dt = x
    else:
        dt = DTensor.from_local(x, mesh, [input_layout], run_check=False)
    if desired_layout is not None:
        dt = dt.redistribute(placements=[desired_layout])
    return dt


def from_dtensor(x, mesh, output_layout, use_local_output, input_layout=None):
    """Move an output to ``output_layout``; plain tensor outputs are first taken as ``input_layout``
    (the layout the module produced); with ``use_local_output`` return the local shard."""
    if not _is_tensor(x):
        return x
    if not isinstance(x, DTensor):
        if input_layout is None:
            return x
        x = DTensor.from_local(x, mesh, [input_layout], run_check=False)
    if output_layout is not None:
        x = x.redistribute(placements=[output_layout])
    return x.to_local() if use_local_output else x


def check_tp_mesh(device_mesh, who):
    """A ValueError unless ``device_mesh`` is 1-D, pointing at the slice to pass instead."""
    if device_mesh.ndim == 1:
        return
    names = device_mesh.mesh_dim_names
    if names:
        example = f'mesh["{"tp" if "tp" in names else names[-1]}"]'
    else:
        example = 'mesh["tp"] (create the mesh with mesh_dim_names=(..., "tp") to slice it)'
    raise ValueError(f"{who} needs a 1-D tensor-parallel mesh, got a {device_mesh.ndim}-D mesh "
                     f"{device_mesh}; pass its tensor-parallel slice, e.g. {example}")


def _check_mesh(device_mesh, style):
    check_tp_mesh(device_mesh, type(style).__name__)


def _module_kind(module):
    platform = get_platform()
    if platform.is_linear(module):
        return "linear"
    if platform.is_embedding(module):
        return "embedding"
    return None


def _embedding_weight(module):
    return get_platform().embedding_weight_name(module)


def _distribute_param(module, name, mesh, placement, src_data_rank):
    platform = get_platform()
    param = dict(platform.named_parameters(module)).get(name)
    if param is None:
        return
    if isinstance(param, DTensor):
        if tuple(param.placements) == (placement.normalized(param.ndim),) and param.device_mesh == mesh:
            return  # already in this layout (the style was applied twice)
        raise ValueError(f"parameter {name!r} of {type(module).__name__} is already a DTensor "
                         f"({param.placements} on {param.device_mesh}); a module can be parallelized once")
    dt = distribute_tensor(param.detach() if hasattr(param, "detach") else param,  # MindSpore: no detach()
                           mesh, [placement], src_data_rank=src_data_rank)
    platform.set_parameter(module, name, dt.requires_grad_(param.requires_grad))


def _replicate_all_params(module, mesh, src_data_rank):
    platform = get_platform()
    for _, sub in platform.named_modules(module):
        for name, _ in list(platform.named_parameters(sub)):
            _distribute_param(sub, name, mesh, Replicate(), src_data_rank)


def _unsupported(style, module, supported="nn.Linear and nn.Embedding"):
    return ValueError(f"{type(style).__name__} supports {supported}; got a {type(module).__name__} module. "
                      f"Parallelize its Linear/Embedding children instead (a plan dict such as "
                      f"{{'attention.wq': ColwiseParallel()}}), or use PrepareModuleInput/"
                      f"PrepareModuleOutput, SequenceParallel or NoParallel for other modules")


# ---------------------------------------------------------------------------- styles
class ParallelStyle:
    """Base class: ``apply(module, device_mesh)`` parallelizes ``module`` in place and returns it."""

    src_data_rank = 0

    def apply(self, module, device_mesh):
        raise NotImplementedError

    def _apply(self, module, device_mesh):  # PyTorch's spelling
        return self.apply(module, device_mesh)

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_")
                           and k != "src_data_rank")
        return f"{type(self).__name__}({fields})"


class ColwiseParallel(ParallelStyle):
    """Split a Linear's output features (weight and bias ``Shard(0)``) or an Embedding's embedding
    dim (weight ``Shard(1)``). The input is replicated (``input_layouts``, default ``Replicate()``);
    the output is ``Shard(-1)`` unless ``output_layouts`` says otherwise. Forward needs no
    communication; backward all-reduces the input gradient."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=True):
        self.input_layouts = _one_layout(input_layouts, Replicate(), "ColwiseParallel input_layouts")
        self.output_layouts = _one_layout(output_layouts, Shard(-1), "ColwiseParallel output_layouts")
        self.use_local_output = use_local_output

    def apply(self, module, device_mesh):
        _check_mesh(device_mesh, self)
        kind = _module_kind(module)
        if kind is None:
            raise _unsupported(self, module)
        if kind == "linear":
            _distribute_param(module, "weight", device_mesh, Shard(0), self.src_data_rank)
            _distribute_param(module, "bias", device_mesh, Shard(0), self.src_data_rank)
        else:
            _distribute_param(module, _embedding_weight(module), device_mesh, Shard(1), self.src_data_rank)
        _install_io_hooks(module, device_mesh, self.input_layouts, Replicate(), self.output_layouts,
                          self.use_local_output)
        return module


class RowwiseParallel(ParallelStyle):
    """Split a Linear's input features (weight ``Shard(1)``, bias replicated and added once) or an
    Embedding's vocabulary (weight ``Shard(0)``, masked lookup). The output is a Partial sum,
    reduced to ``output_layouts`` (default ``Replicate()``: one all-reduce; ``Shard(1)``: one
    reduce-scatter, as in sequence parallelism).

    ``input_layouts`` defaults to ``Shard(-1)`` for a Linear (the output of a ColwiseParallel
    layer) and to ``Replicate()`` for an Embedding (token ids are replicated)."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=True):
        self.input_layouts = _one_layout(input_layouts, None, "RowwiseParallel input_layouts")
        self.output_layouts = _one_layout(output_layouts, Replicate(), "RowwiseParallel output_layouts")
        self.use_local_output = use_local_output

    def apply(self, module, device_mesh):
        _check_mesh(device_mesh, self)
        kind = _module_kind(module)
        if kind is None:
            raise _unsupported(self, module)
        if kind == "linear":
            _distribute_param(module, "weight", device_mesh, Shard(1), self.src_data_rank)
            _distribute_param(module, "bias", device_mesh, Replicate(), self.src_data_rank)
            input_layout, desired = self.input_layouts or Shard(-1), Shard(-1)
        else:
            _distribute_param(module, _embedding_weight(module), device_mesh, Shard(0), self.src_data_rank)
            input_layout, desired = self.input_layouts or Replicate(), Replicate()
        _install_io_hooks(module, device_mesh, input_layout, desired, self.output_layouts,
                          self.use_local_output)
        return module


def _install_io_hooks(module, mesh, input_layout, desired_input, output_layout, use_local_output):
    platform = get_platform()

    def pre_hook(mod, args):
        if not args:
            raise ValueError(f"{type(mod).__name__} under tensor parallelism expects its input "
                             f"positionally")
        return (to_dtensor(args[0], mesh, input_layout, desired_input),) + tuple(args[1:])

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

    def __init__(self, *, sequence_dim=1, use_local_output=False):
        if not isinstance(sequence_dim, int):
            raise ValueError(f"SequenceParallel sequence_dim must be an int, got {sequence_dim!r}")
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def apply(self, module, device_mesh):
        _check_mesh(device_mesh, self)
        _replicate_all_params(module, device_mesh, self.src_data_rank)
        platform = get_platform()
        layout = Shard(self.sequence_dim)

        def pre_hook(mod, args):
            return tuple(to_dtensor(a, device_mesh, layout, layout) for a in args)

        def post_hook(mod, args, output):
            if not self.use_local_output:
                return output
            return _map_outputs(output, lambda o: from_dtensor(o, device_mesh, None, True))

        platform.register_forward_pre_hook(module, pre_hook)
        platform.register_forward_hook(module, post_hook)
        return module


def _map_outputs(output, fn):
    if isinstance(output, tuple):
        return tuple(fn(o) for o in output)
    if isinstance(output, list):
        return [fn(o) for o in output]
    return fn(output)


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs before its forward: each positional input with a layout in
    ``input_layouts`` (None: leave it alone) is taken as that layout and redistributed to the
    matching ``desired_input_layouts``; likewise keyword inputs by name. With
    ``use_local_output=True`` the module receives local shards instead of DTensors."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_output=False):
        self.input_layouts = _layout_tuple(input_layouts, "PrepareModuleInput input_layouts")
        self.desired_input_layouts = _layout_tuple(desired_input_layouts,
                                                   "PrepareModuleInput desired_input_layouts")
        have, want = self.input_layouts, self.desired_input_layouts
        if (have is None) != (want is None) or (have is not None and len(have) != len(want)):
            raise ValueError(f"PrepareModuleInput: input_layouts {have} and desired_input_layouts {want} "
                             f"must have one entry per input each")
        for have, want in zip(self.input_layouts or (), self.desired_input_layouts or ()):
            if (have is None) != (want is None):
                raise ValueError(f"PrepareModuleInput: input layout {have!r} has desired layout {want!r}; "
                                 f"give both or neither (None) for each input")
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise ValueError(f"PrepareModuleInput: input_kwarg_layouts {sorted(self.input_kwarg_layouts)} "
                             f"and desired_input_kwarg_layouts {sorted(self.desired_input_kwarg_layouts)} "
                             f"must name the same keyword inputs")
        self.use_local_output = use_local_output

    def _convert(self, x, mesh, have, want):
        if have is None or not _is_tensor(x):
            return x
        dt = to_dtensor(x, mesh, have, want)
        return dt.to_local() if self.use_local_output else dt

    def prepare(self, args, kwargs, mesh):
        if self.input_layouts is not None:
            if len(args) < len(self.input_layouts):
                raise ValueError(f"PrepareModuleInput has {len(self.input_layouts)} input_layouts but the "
                                 f"module got {len(args)} positional inputs")
            args = tuple(self._convert(a, mesh, self.input_layouts[i], self.desired_input_layouts[i])
                         if i < len(self.input_layouts) else a for i, a in enumerate(args))
        if self.input_kwarg_layouts:
            kwargs = dict(kwargs)
            for name, have in self.input_kwarg_layouts.items():
                if name in kwargs:
                    want = self.desired_input_kwarg_layouts[name]
                    kwargs[name] = self._convert(kwargs[name], mesh, have, want)
        return args, kwargs

    def apply(self, module, device_mesh):
        _check_mesh(device_mesh, self)

        def pre_hook(mod, args, kwargs):
            return self.prepare(args, kwargs, device_mesh)

        get_platform().register_forward_pre_hook(module, pre_hook, with_kwargs=True)
        return module


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs after its forward: each output with a layout in
    ``output_layouts`` (plain tensors are taken as that layout; DTensors keep their own) is
    redistributed to the matching ``desired_output_layouts``; local shards with
    ``use_local_output=True``."""

    def __init__(self, *, output_layouts, desired_output_layouts, use_local_output=True):
        self.output_layouts = _layout_tuple(output_layouts, "PrepareModuleOutput output_layouts")
        self.desired_output_layouts = _layout_tuple(desired_output_layouts,
                                                    "PrepareModuleOutput desired_output_layouts")
        if self.output_layouts is None or self.desired_output_layouts is None or \
                len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError(f"PrepareModuleOutput: output_layouts {self.output_layouts} and "
                             f"desired_output_layouts {self.desired_output_layouts} must have one entry per "
                             f"output each")
        self.use_local_output = use_local_output

    def prepare(self, output, mesh):
        single = not isinstance(output, (tuple, list))
        outs = (output,) if single else tuple(output)
        if len(outs) != len(self.output_layouts):
            raise ValueError(f"PrepareModuleOutput has {len(self.output_layouts)} output_layouts but the "
                             f"module returned {len(outs)} outputs")
        converted = []
        for out, have, want in zip(outs, self.output_layouts, self.desired_output_layouts):
            if have is None or not _is_tensor(out):
                converted.append(out)
                continue
            converted.append(from_dtensor(out, mesh, want, self.use_local_output, input_layout=have))
        if single:
            return converted[0]
        return type(output)(converted) if isinstance(output, list) else tuple(converted)

    def apply(self, module, device_mesh):
        _check_mesh(device_mesh, self)

        def post_hook(mod, args, output):
            return self.prepare(output, device_mesh)

        get_platform().register_forward_hook(module, post_hook)
        return module


class PrepareModuleInputOutput(ParallelStyle):
    """``PrepareModuleInput`` and ``PrepareModuleOutput`` on one module."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_input=False, output_layouts=None,
                 desired_output_layouts=None, use_local_output=True):
        self.prepare_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_output = PrepareModuleOutput(output_layouts=output_layouts,
                                                  desired_output_layouts=desired_output_layouts,
                                                  use_local_output=use_local_output)

    def apply(self, module, device_mesh):
        self.prepare_input.apply(module, device_mesh)
        self.prepare_output.apply(module, device_mesh)
        return module


class NoParallel(ParallelStyle):
    """Keep a module whole on every rank, but in DTensor form: its parameters become
    ``Replicate()`` DTensors (so optimizers, gradient clipping and checkpoints treat every
    parameter alike), its input is taken as ``input_layout`` (default ``Replicate()``) and
    replicated, and its output is moved to ``output_layout`` (default ``Replicate()``), as a local
    tensor with ``use_local_output=True``. Typical use: a small router or gate."""

    def __init__(self, *, input_layout=None, output_layout=None, use_local_output=True):
        self.input_layout = _one_layout(input_layout, Replicate(), "NoParallel input_layout")
        self.output_layout = _one_layout(output_layout, Replicate(), "NoParallel output_layout")
        self.use_local_output = use_local_output

    def apply(self, module, device_mesh):
        _check_mesh(device_mesh, self)
        _replicate_all_params(module, device_mesh, self.src_data_rank)
        platform = get_platform()

        def pre_hook(mod, args):
            if not args:
                return args
            return (to_dtensor(args[0], device_mesh, self.input_layout, Replicate()),) + tuple(args[1:])

        def post_hook(mod, args, output):
            return _map_outputs(output, lambda o: from_dtensor(o, device_mesh, self.output_layout,
                                                               self.use_local_output))

        platform.register_forward_pre_hook(module, pre_hook)
        platform.register_forward_hook(module, post_hook)
        return module
