"""MindSpore primitives mapped to the sharding rules of real models' ops (platform/mindspore/
op_names_models.py): each on DTensors in the listed placements -- uneven and empty pieces on a 1-D
mesh of 4 -- equals single-process MindSpore (values, dtype, shape, gradients of float inputs,
through tests/cases/ms_op_sweep.py's comparison) and takes a rule, not the replicated fallback.

Imported by MindSpore workers only.
"""
import numpy as np

from tests.cases.dtensor import _placements
from tests.cases.ms_op_sweep import _compare, _inputs


def cases():
    """name -> (fn, input specs (ms_op_sweep._inputs), 1-D combos, 2-D combos): a 1-D combo is one
    placement per input, a 2-D combo one pair per input."""
    from mindspore import mint, ops
    ids, rows = ("ids", (3,), 5), ("ids", (5, 2), 6)
    return {
        "prod": (lambda a: ops.prod(a, 1), [(5, 6)], [["S0"], ["S1"]], [[("S0", "S1")]]),
        "argmax": (lambda a: ops.argmax(a, 1), [(5, 6)], [["S0"], ["S1"]], [[("S1", "S0")]]),
        "gather_elements": (lambda a, i: mint.gather(a, 1, i), [(5, 6), rows],
                            [["S0", "S0"], ["R", "S1"], ["S1", "R"]], [[("S0", "R"), ("S0", "R")]]),
        "scatter": (lambda a, i, src: mint.scatter(a, 1, i, src), [(5, 6), rows, (5, 2)],
                    [["S0", "S0", "S0"], ["S1", "R", "R"]], [[("S0", "R"), ("S0", "R"), ("R", "R")]]),
        "index_select": (lambda a, i: ops.index_select(a, 1, i), [(5, 6), ids],
                         [["S0", "R"], ["R", "S0"], ["P", "R"]], [[("S0", "R"), ("R", "R")]]),
        "gather axis 1": (lambda a, i: ops.gather(a, i, 1), [(5, 6), ids], [["S0", "R"]],
                          [[("S0", "S0"), ("R", "R")]]),
        "index_add": (lambda a, i, src: a.index_add(1, i, src), [(5, 6), ("ids", (3,), 6), (5, 3)],
                      [["S0", "R", "S0"], ["S1", "R", "R"]], [[("S0", "R"), ("R", "R"), ("S0", "R")]]),
        "flip": (lambda a: mint.flip(a, (1,)), [(5, 6)], [["S0"], ["S1"], ["P"]], [[("S0", "S1")]]),
        "new_zeros/new_ones": (lambda a: a.new_zeros((2, 3)).sum() + a.new_ones((5, 6)) * a, [(5, 6)],
                               [["S0"], ["S1"]], [[("S0", "S1")]]),
    }


def check(rank, world_size, mesh_shape, names=None):
    """[(case, placements, status, problem)] for every case (or those in ``names``) on this mesh
    (status: rule / fallback / error; problem: None or what differs from one process)."""
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    out = []
    for name, (fn, specs, combos_1d, combos_2d) in cases().items():
        if names is not None and name not in names:
            continue
        xs = [x.astype(np.int32) if x.dtype != np.float32 else x for x in _inputs(specs, name)]
        for combo in (combos_1d if len(mesh_shape) == 1 else combos_2d):
            pls = [_placements([p] if isinstance(p, str) else list(p)) for p in combo]
            try:
                used_fallback, problem = _compare(name, fn, xs, pls, mesh)
                status = "fallback" if used_fallback else "rule"
            except Exception as exc:   # noqa: BLE001  (reported: a failure)
                status, problem = "error", f"{type(exc).__name__}: {exc}"[:400]
            out.append((name, str(combo), status, problem))
    return out
