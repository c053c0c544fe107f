"""``hyper_parallel.attention``'s variants (soft-capping, sinks, sliding window) under
ContextParallel on any framework (torch and MindSpore).

The reference is the same call on the whole sequence on one device (its plain path is checked
against an eager formula in tests/test_cp_variants.py); each rank's contiguous block runs through
the ContextParallel module. Output, dq, dk, dv blocks and the sinks' gradient summed over the ranks
(each rank's is its share) must match (fp32, 1e-5). The sinks are the module's fourth argument,
passed through untouched by ContextParallel, as a parameter would be.
"""
import numpy as np

from tests.frameworks import close, current, grad_of, inp, t

B, S, HQ, HKV, D = 1, 8, 4, 2, 4
MODES = {"ulysses": {}, "allgather": {"ulysses_degree": 1},
         "allgather_lb": {"ulysses_degree": 1, "load_balance": True},
         "ring": {"ulysses_degree": 1, "kv_exchange": "ring"},
         "zigzag": {"ulysses_degree": 1, "kv_exchange": "ring", "load_balance": True}}
OPTIONS = {"softcap": {"softcap": 0.8}, "window": {"window": 3}}


def _module(options):
    import hyper_parallel as hp

    def attend(q, k, v, sinks):
        return hp.attention(q, k, v, is_causal=True, sinks=sinks, **options)
    if current().name == "mindspore":
        import mindspore as ms

        class Core(ms.nn.Cell):
            def construct(self, q, k, v, sinks):
                return attend(q, k, v, sinks)
    else:
        import torch

        class Core(torch.nn.Module):
            def forward(self, q, k, v, sinks):
                return attend(q, k, v, sinks)
    return Core(), attend


def check(mesh, mode, name):
    from hyper_parallel import ContextParallel, get_platform
    fw = current()
    q, w = (inp(f"cpvar{x}", 0, (B, HQ, S, D)) for x in "qw")
    k, v = (inp(f"cpvar{x}", 0, (B, HKV, S, D)) for x in "kv")
    sinks = inp("cpvars", 0, (HQ,))
    cell, plain = _module(OPTIONS[name])
    ref_out = fw.numpy(plain(t(q), t(k), t(v), t(sinks)))
    ref_grads = [fw.numpy(g)
                 for g in grad_of(lambda *a: (plain(*a) * t(w)).sum(), t(q), t(k), t(v), t(sinks))]
    ContextParallel(seq_dim=2, head_dim=1, **MODES[mode]).apply(cell, mesh)
    me, n = mesh.get_local_rank(0), mesh.size()
    blocks = [t(np.split(x, n, axis=2)[me]) for x in (q, k, v)]
    w_block = t(np.split(w, n, axis=2)[me])
    what = f"{mode} {name} world={n}"
    close(cell(*blocks, t(sinks)), np.split(ref_out, n, axis=2)[me], "forward " + what)
    grads = grad_of(lambda a, b, c, s: (cell(a, b, c, s) * w_block).sum(), *blocks, t(sinks))
    for label, g, ref in zip("qkv", grads, ref_grads):
        close(g, np.split(ref, n, axis=2)[me], f"d{label} " + what)
    total = get_platform().all_reduce(grads[3], mesh.get_group())
    close(total, ref_grads[3], "dsinks " + what)
    return what


def every_mode(rank, world_size):
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    return [check(mesh, mode, name) for mode in MODES for name in OPTIONS]
