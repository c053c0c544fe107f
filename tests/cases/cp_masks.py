"""ContextParallel under ``attention_masks`` on any framework (torch and MindSpore).

The reference is the plain module on the full sequence with the equivalent dense (S, S) mask
(matmul / softmax attention: the same on both frameworks); every batch row carries the same
documents and padding so one (S, S) mask describes them, and no row is left without a visible
key (softmax of an all -inf row is NaN in plain attention). The ContextParallel module calls
SDPA inside ``attention_masks(...)`` with the whole sequence's ids / padding; output and dq, dk, dv
blocks are compared (fp32, 1e-5).
"""
import numpy as np

from tests.frameworks import close, current, grad_of, inp, t

B, S, H, D = 2, 16, 4, 4
MODES = {"ulysses": {}, "allgather": {"ulysses_degree": 1},
         "allgather_lb": {"ulysses_degree": 1, "load_balance": True},
         "ring": {"ulysses_degree": 1, "kv_exchange": "ring"},
         "zigzag": {"ulysses_degree": 1, "kv_exchange": "ring", "load_balance": True}}
CASES = {"padding": (False, True, False), "packed": (True, False, False),
         "packed_causal": (True, False, True)}
DOCS = [0] * 3 + [1] * 6 + [2] + [3] * 6          # document ids of every row
PAD = [True] * 13 + [False] * 3                   # right padding


def _dense(documents, padding, causal):
    ids, valid = np.array(DOCS), np.array(PAD)
    allowed = np.ones((S, S), dtype=bool)
    if documents:
        allowed &= ids[:, None] == ids[None, :]
    if padding:
        allowed &= valid[None, :]
    if causal:
        allowed &= np.tril(np.ones((S, S), dtype=bool))
    return allowed


def check(mesh, mode, case, block_size=3):
    from hyper_parallel import ContextParallel, attention_masks
    fw = current()
    documents, padding, causal = CASES[case]
    q, k, v, w = (inp(f"cpmask{name}", 0, (B, S, H, D)) for name in "qkvw")
    dense = t(_dense(documents, padding, causal))
    ref_cell = fw.attention("matmul", "bshd")

    def reference(a, b, c):
        return ref_cell(a, b, c, mask=dense)
    ref_out = fw.numpy(reference(t(q), t(k), t(v)))
    ref_grads = [fw.numpy(g) for g in
                 grad_of(lambda a, b, c: (reference(a, b, c) * t(w)).sum(), t(q), t(k), t(v))]

    cell = fw.attention("sdpa", "bshd")
    ContextParallel(seq_dim=1, head_dim=2, **MODES[mode]).apply(cell, mesh)
    me, n = mesh.get_local_rank(0), mesh.size()
    blocks = [t(np.split(x, n, axis=1)[me]) for x in (q, k, v)]
    w_block = t(np.split(w, n, axis=1)[me])
    kwargs = {"block_size": block_size}
    if documents:
        kwargs["document_ids"] = t(np.array([DOCS] * B, dtype=np.int64))
    if padding:
        kwargs["padding_mask"] = t(np.array([PAD] * B))

    def dist(a, b, c):
        with attention_masks(**kwargs):
            return cell(a, b, c, causal=causal)
    what = f"{mode} {case} world={n}"
    close(dist(*blocks), np.split(ref_out, n, axis=1)[me], "forward " + what)
    grads = grad_of(lambda a, b, c: (dist(a, b, c) * w_block).sum(), *blocks)
    for name, g, ref in zip("qkv", grads, ref_grads):
        close(g, np.split(ref, n, axis=1)[me], f"d{name} " + what)
    return what


def every_mode(rank, world_size):
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    return [check(mesh, mode, case) for mode in MODES for case in CASES]
