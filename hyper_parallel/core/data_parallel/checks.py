"""What data_parallel's gradient reducers share (reducer.py's hooks, api.py's tuple form for MindSpore): the
mesh checks, the ``no_sync`` switch, the ranks' agreement on the parameters and backward count."""
import contextlib

from hyper_parallel.core.agreement import check_agreement
from hyper_parallel.core.bounded_cache import lifetime_key
from hyper_parallel.core.dtensor.dtensor import DTensor


def check_one_dim(mesh):
    if mesh.ndim != 1:
        raise ValueError(f"data_parallel needs a 1-D mesh, got {mesh.ndim}-D {mesh.mesh_dim_names}; slice it "
                         f"(mesh['dp']) or flatten it (mesh['dp', 'cp'].flatten())")


def check_disjoint_meshes(param, dp_mesh, name):
    """A DTensor parameter's shards differ across its own mesh, so that mesh may share at most one
    rank (this one) with the data-parallel mesh."""
    if not isinstance(param, DTensor):
        return
    shared = set(param.device_mesh.rank_list) & set(dp_mesh.group_ranks(0))
    if len(shared) > 1:
        raise ValueError(f"data_parallel: the DTensor parameter {name} lives on mesh "
                         f"{param.device_mesh} which "
                         f"shares ranks {sorted(shared)} with the data-parallel mesh {dp_mesh}; its shards "
                         f"differ across those ranks, so their gradients cannot be averaged. Use a "
                         f"data-parallel mesh dim different from the parameter's (e.g. mesh['dp'] beside "
                         f"mesh['tp'])")


class Switchable:
    """``enabled`` and ``no_sync()``, the switch both gradient reducers (reducer.py's and api.py's)
    share."""
    enabled = True

    @contextlib.contextmanager
    def no_sync(self):
        """Skip the reduction (gradients accumulate locally); the next step outside reduces the sum."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous


def agree_parameters(mesh: object, named: list, reducer: object) -> None:
    """Every rank of the data-parallel mesh reduces the same trainable parameters (names, shapes,
    dtypes): the buckets' all-reduces would otherwise mismatch (SPEC §19). Checked once per
    wrapped module (``reducer``) and set of parameters."""
    check_agreement(mesh, "data_parallel", {
        "trainable parameters": tuple(name for name, _ in named),
        "their shapes": tuple(tuple(int(s) for s in p.shape) for _, p in named),
        "their dtypes": tuple(str(p.dtype) for _, p in named),
    }, signature=("trainable parameters", lifetime_key(reducer)),
        fix="wrap the same model on every rank and freeze, unfreeze or add the same parameters on every "
            "rank")


def backward_count_error(count: int, mesh: object) -> str:
    return (f"data_parallel: the ranks of {mesh} ran different numbers of backward passes since their last "
            f"forward (this rank's backward #{count}): each backward all-reduces the gradients, so every "
            f"rank "
            f"must call backward() the same number of times per forward (accumulate with module.no_sync(), "
            f"or sum the losses into one backward)")
