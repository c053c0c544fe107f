"""Linear attention under CP on every framework (imported by torch AND MindSpore workers: no torch,
no pytest here). Each rank runs its block of the gated delta rule (GDN per-head decay with GQA, KDA
per-channel decay) and of the short causal convolution; output and every input gradient equal the
single-device rule computed on the rank from the whole sequence."""
import numpy as np

from tests.frameworks import close, current, inp, np_of, t

B, T, CHUNK = 1, 12, 4


def _inputs(kind):
    h_k, h_v, d_k, d_v = (2, 4, 4, 3) if kind == "gdn" else (2, 2, 4, 4)
    gate = (B, T, h_v) if kind == "gdn" else (B, T, h_v, d_k)
    arrays = [inp(f"la/{kind}/q", 0, (B, T, h_k, d_k)), inp(f"la/{kind}/k", 0, (B, T, h_k, d_k)),
              inp(f"la/{kind}/v", 0, (B, T, h_v, d_v)), -np.abs(inp(f"la/{kind}/g", 0, gate)) * 0.3,
              1 / (1 + np.exp(-inp(f"la/{kind}/b", 0, (B, T, h_v)))), inp(f"la/{kind}/h0", 0, (B, h_v, d_k, d_v))]
    return [a.astype(np.float32) for a in arrays], inp(f"la/{kind}/w", 0, (B, T, h_v, d_v))


def delta_rule_exact(rank, world_size, kind, mode):
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.context_parallel.linear_attention import chunk_delta_rule, context_parallel_delta_rule
    fw = current()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    arrays, weight = _inputs(kind)
    lo, hi = rank * T // world_size, (rank + 1) * T // world_size

    def whole(q, k, v, g, beta, h0):
        return (chunk_delta_rule(q, k, v, g, beta, initial_state=h0, chunk_size=CHUNK)[0] * t(weight)).sum()

    def blocks(q, k, v, g, beta, h0):
        out = context_parallel_delta_rule(q, k, v, g, beta, mesh, mode=mode, initial_state=h0, chunk_size=CHUNK)
        return (out * t(weight[:, lo:hi])).sum()
    expected = np_of(chunk_delta_rule(*[t(a) for a in arrays[:5]], initial_state=t(arrays[5]), chunk_size=CHUNK)[0])
    mine = [t(a[:, lo:hi]) for a in arrays[:5]] + [t(arrays[5])]
    out = context_parallel_delta_rule(*mine[:5], mesh, mode=mode, initial_state=mine[5], chunk_size=CHUNK)
    close(out, expected[:, lo:hi], f"{kind} {mode} output")
    ref_grads = fw.grad(whole, *[t(a) for a in arrays])
    grads = fw.grad(blocks, *mine)
    for name, grad, ref in zip(("q", "k", "v", "g", "beta"), grads, ref_grads):
        close(grad, np_of(ref)[:, lo:hi], f"{kind} {mode} d{name}")
    close(grads[5], np_of(ref_grads[5]), f"{kind} {mode} dinitial_state")
    return True


def conv_exact(rank, world_size):
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.context_parallel.linear_attention import causal_conv1d, context_parallel_causal_conv1d
    fw = current()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    x, w, probe = inp("la/conv/x", 0, (2, 3, T)), inp("la/conv/w", 0, (3, 4)), inp("la/conv/p", 0, (2, 3, T))
    lo, hi = rank * T // world_size, (rank + 1) * T // world_size
    ref = fw.grad(lambda a: (causal_conv1d(a, t(w)) * t(probe)).sum(), t(x))[0]
    close(context_parallel_causal_conv1d(t(x[..., lo:hi]), t(w), None, mesh), np_of(causal_conv1d(t(x), t(w)))[..., lo:hi],
          "conv output")
    grad = fw.grad(lambda a: (context_parallel_causal_conv1d(a, t(w), None, mesh) * t(probe[..., lo:hi])).sum(),
                   t(x[..., lo:hi]))[0]
    close(grad, np_of(ref)[..., lo:hi], "conv input gradient")
    return True


def all_cases(rank, world_size):
    """GDN by all-gather, KDA by P2P, the convolution (every combination runs on torch in
    tests/test_cp_linear_attention.py; MindSpore's eager autograd is slow on a small machine)."""
    for kind, mode in (("gdn", "allgather"), ("kda", "p2p")):
        delta_rule_exact(rank, world_size, kind, mode)
    return conv_exact(rank, world_size)
