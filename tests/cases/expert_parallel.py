"""The expert-parallel dispatch written once in core, on torch and MindSpore: each rank's tokens
routed to experts split over the ranks, against the dense experts of every rank's tokens computed
in the same process (outputs; gradients of tokens, scores and this rank's experts through the
framework's own autograd), and the bytes the dispatch sends against the closed form.

Imported by torch and MindSpore workers alike.
"""
import numpy as np

from tests.frameworks import close, grad_of, inp, t

E, H, INTER, K, T = 4, 3, 2, 2, 5


class _Experts:
    """What grouped_compute reads from an experts module: the activation (a polynomial, the same
    on every framework)."""

    @staticmethod
    def act_fn(a):
        return a * a


def _routing(rank):
    gen = np.random.RandomState(50 + rank)
    index = np.stack([gen.permutation(E)[:K] for _ in range(T)]).astype(np.int64)
    index[:2, 0] = 0        # skewed: uneven splits
    return index


def _dense(x, index, w, gate_up, down):
    """sum_k w[t, k] * expert_{index[t, k]}(x[t]) row by row (the single-process definition)."""
    rows = []
    for tok in range(T):
        acc = 0
        for k in range(K):
            e = int(index[tok, k])
            gu = x[tok:tok + 1] @ gate_up[e].swapaxes(0, 1)
            h = _Experts.act_fn(gu[:, :INTER]) * gu[:, INTER:]
            acc = acc + (h @ down[e].swapaxes(0, 1)) * w[tok:tok + 1, k:k + 1]
        rows.append(acc)
    from hyper_parallel import get_platform
    return get_platform().cat(rows, 0)


def dispatch_matches_dense(rank, world_size):
    from hyper_parallel import CommDebugMode, get_platform, init_device_mesh
    from hyper_parallel.core.expert_parallel import dispatch_combine
    from hyper_parallel.core.expert_parallel.experts import grouped_compute
    platform = get_platform()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    group, local = mesh.get_group(0), E // world_size
    gate_up, down = inp("ep_gu", 0, (E, 2 * INTER, H)), inp("ep_d", 0, (E, H, INTER))
    mine = slice(rank * local, (rank + 1) * local)
    index = t(_routing(rank))

    def ep_loss(x, w, gu, d):
        out = dispatch_combine(x, index, w, E, group, world_size,
                               lambda rows, sizes: grouped_compute(_Experts, {"gate_up_proj": gu,
                                                                              "down_proj": d}, rows, sizes))
        return (out * t(inp("ep_g", rank, (T, H)))).sum()

    args = (t(inp("ep_x", rank, (T, H))), t(np.abs(inp("ep_w", rank, (T, K)))), t(gate_up[mine]),
            t(down[mine]))
    with CommDebugMode() as comm:
        grads = grad_of(ep_loss, *args)

    def dense_loss(gu, d, *xs_ws):
        total = 0
        for r in range(world_size):
            out = _dense(xs_ws[2 * r], _routing(r), xs_ws[2 * r + 1], gu, d)
            total = total + (out * t(inp("ep_g", r, (T, H)))).sum()
        return total
    inputs = [t(gate_up), t(down)]
    for r in range(world_size):
        inputs += [t(inp("ep_x", r, (T, H))), t(np.abs(inp("ep_w", r, (T, K))))]
    ref = grad_of(dense_loss, *inputs)
    close(grads[0], ref[2 + 2 * rank], "token gradient")
    close(grads[1], ref[3 + 2 * rank], "score gradient")
    close(grads[2], platform_slice(ref[0], mine), "gate_up gradient")
    close(grads[3], platform_slice(ref[1], mine), "down gradient")
    if "all_gather" in str(platform.capabilities().get("all_to_all (list)", "")):
        return True     # MindSpore CPU: the all-to-alls are all-gathers (more bytes, by design)
    counts = [np.bincount(_routing(r).reshape(-1), minlength=E) for r in range(world_size)]
    away = sum(counts[rank][e] for e in range(E) if not rank * local <= e < (rank + 1) * local)
    back = sum(counts[s][rank * local:(rank + 1) * local].sum() for s in range(world_size) if s != rank)
    assert comm.get_comm_counts().get("all_to_all") == 5, comm.get_comm_counts()
    counts_bytes = (E + world_size) * 8 * (world_size - 1) // world_size
    assert comm.get_comm_bytes()["all_to_all"] == counts_bytes + 2 * int(away + back) * H * 4, \
        (comm.get_comm_bytes(), away, back)
    return True


def platform_slice(tensor, rows):
    from tests.frameworks import np_of
    return np_of(tensor)[rows]
