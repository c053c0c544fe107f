"""PrepareModuleInput / PrepareModuleOutput / PrepareModuleInputOutput: convert a module's inputs
and outputs between local tensors, layouts and DTensors, without touching its parameters."""
from typing import Any
from hyper_parallel.core.tensor_parallel.base import (ParallelStyle, _check_mesh, _is_tensor, _layout_tuple,
                                                      from_dtensor, to_dtensor)
from hyper_parallel.platform import get_platform

__all__ = ["PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput"]


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs before its forward: each positional input with a layout in
    ``input_layouts`` (None: leave it alone) is taken as that layout and redistributed to the
    matching ``desired_input_layouts``; likewise keyword inputs by name. With
    ``use_local_output=True`` the module receives local shards instead of DTensors."""

    def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                 input_kwarg_layouts: Any = None, desired_input_kwarg_layouts: Any = None,
                 use_local_output: bool = False) -> None:
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

    def prepare(self, args: Any, kwargs: Any, mesh: Any) -> Any:
        if self.input_layouts is not None:
            # more inputs than layouts is an error too (as PyTorch): an input without a layout
            # would silently reach a sharded module as a local tensor taken for a replicated one
            if len(args) != len(self.input_layouts):
                raise ValueError(f"PrepareModuleInput has {len(self.input_layouts)} input_layouts "
                                 f"{self.input_layouts} but the module got {len(args)} positional inputs; "
                                 f"give one layout per positional input (None leaves an input as it is)")
            args = tuple(self._convert(a, mesh, have, want)
                         for a, have, want in zip(args, self.input_layouts, self.desired_input_layouts))
        if self.input_kwarg_layouts:
            kwargs = dict(kwargs)
            for name, have in self.input_kwarg_layouts.items():
                if name in kwargs:
                    want = self.desired_input_kwarg_layouts[name]
                    kwargs[name] = self._convert(kwargs[name], mesh, have, want)
        return args, kwargs

    def apply(self, module: Any, device_mesh: Any) -> Any:
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

    def __init__(self, *, output_layouts: Any, desired_output_layouts: Any,
                 use_local_output: bool = True) -> None:
        self.output_layouts = _layout_tuple(output_layouts, "PrepareModuleOutput output_layouts")
        self.desired_output_layouts = _layout_tuple(desired_output_layouts,
                                                    "PrepareModuleOutput desired_output_layouts")
        if self.output_layouts is None or self.desired_output_layouts is None or \
                len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError(f"PrepareModuleOutput: output_layouts {self.output_layouts} and "
                             f"desired_output_layouts {self.desired_output_layouts} must have one entry per "
                             f"output each")
        self.use_local_output = use_local_output

    def prepare(self, output: Any, mesh: Any) -> Any:
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

    def apply(self, module: Any, device_mesh: Any) -> Any:
        _check_mesh(device_mesh, self)

        def post_hook(mod, args, output):
            return self.prepare(output, device_mesh)

        get_platform().register_forward_hook(module, post_hook)
        return module


class PrepareModuleInputOutput(ParallelStyle):
    """``PrepareModuleInput`` and ``PrepareModuleOutput`` on one module."""

    def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                 input_kwarg_layouts: Any = None, desired_input_kwarg_layouts: Any = None,
                 use_local_input: bool = False, output_layouts: Any = None,
                 desired_output_layouts: Any = None, use_local_output: bool = True) -> None:
        self.prepare_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_output = PrepareModuleOutput(output_layouts=output_layouts,
                                                  desired_output_layouts=desired_output_layouts,
                                                  use_local_output=use_local_output)

    def apply(self, module: Any, device_mesh: Any) -> Any:
        self.prepare_input.apply(module, device_mesh)
        self.prepare_output.apply(module, device_mesh)
        return module
