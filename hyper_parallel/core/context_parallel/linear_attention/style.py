"""``LinearAttentionContextParallel``: the ParallelStyle for a user's GDN / KDA module.

``parallelize_module(layer, cp_mesh, LinearAttentionContextParallel())`` wraps the layer's forward
(the platform's ``replace_forward``) so that its ``delta_rule`` / ``causal_conv1d`` calls
(functional.py) run on the CP blocks; the layer is then called with this rank's sequence block of
its inputs (``shard_sequence``) and returns this rank's block of its output. Parameter gradients
are this rank's share: sum them over the CP ranks (``data_parallel`` over the cp dim), as for any
CP model.
"""
from typing import Any
from hyper_parallel.core.context_parallel.linear_attention.checks import running
from hyper_parallel.core.context_parallel.linear_attention.checks import MODES
from hyper_parallel.core.bounded_cache import lifetime_key
from hyper_parallel.core.tensor_parallel.style import ParallelStyle
from hyper_parallel.platform import get_platform


class LinearAttentionContextParallel(ParallelStyle):
    """``mode``: how the recurrent state crosses the CP ranks — "allgather" (one all-gather of the
    blocks' affine summaries, default) or "p2p" (the state passed rank to rank)."""

    def __init__(self, mode: str = "allgather") -> None:
        if mode not in MODES:
            raise ValueError(f"LinearAttentionContextParallel(mode={mode!r}): pass one of {MODES}")
        self.mode = mode

    def apply(self, module: Any, device_mesh: Any) -> Any:
        if device_mesh.ndim != 1:
            raise ValueError(f"LinearAttentionContextParallel: the mesh has {device_mesh.ndim} dims "
                             f"{device_mesh.mesh_dim_names}; pass the 1-D context-parallel mesh (e.g. "
                             "mesh['cp'])")
        group, mode = device_mesh.get_group(), self.mode
        site = ("linear attention", lifetime_key(module))   # the agreement checks' call site

        def wrap(original):
            def forward(*args, **kwargs):
                with running(group, mode, site):
                    return original(*args, **kwargs)
            return forward
        get_platform().replace_forward(module, wrap)
        return module
