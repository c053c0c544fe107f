"""The attention output moved back to the caller's sequence split as a split collective (overlap): one
all-to-all heads -> sequence (nothing to move in the all-gather KV mode; any other plan runs the
ordinary redistribution, unsplit)."""
from typing import Any
from hyper_parallel.core.context_parallel.movement.steps import single_step
from hyper_parallel.core.context_parallel.output import caller_placements, output_seq_dim
from hyper_parallel.platform import get_platform


def start_output(out: Any, inputs: Any, ulysses_dims: Any, observer: Any = None) -> Any:
    """Start moving the attention output ``out`` (a DTensor on the working mesh) to the caller's
    sequence split: (finish -> this rank's local block, the output's seq dim, its placements)."""
    seq = output_seq_dim(out, inputs, ulysses_dims)
    target = caller_placements(tuple(out.placements), inputs.mesh, out.ndim, seq, inputs.cp_dims)
    if tuple(out.placements) == tuple(target):
        local = out.to_local()
        return (lambda: local), seq, target
    step = single_step(out.device_mesh, out.shape, out.placements, target, "all_to_all")
    if step is None:
        local = out.redistribute(placements=target).to_local()
        return (lambda: local), seq, target
    group = inputs.mesh.get_group(step.mesh_dim)
    pending = get_platform().start_differentiable_collective(
        "all_to_all", out.to_local(), group, (step.new_dim, step.dim), observer)
    return pending.wait, seq, target
