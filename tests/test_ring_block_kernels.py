"""One ring loop, two block kernels (core/attention/causal_blocks.py's ``CausalBlocks``, masked_ring.py's ``MaskedBlocks``).

* ``masked_ring_attention`` directly (packed documents + padding, causal or not, contiguous and
  zigzag chunks, K/V heads that split into the ring's head groups and heads that do not, GQA) equals
  single-device SDPA with the equivalent dense mask, output and dq, dk, dv within 1e-5 (fp32);
  ``ring_attention`` likewise with one K/V head (MQA) and odd K/V head counts;
* both kernels send the same bytes, the dK/dV hops in the input dtype (bf16 backward = 2x forward);
* both kernels overlap their hops: in forward every K/V hop has a kernel call between its start and
  its wait, in backward every hop but the last dK/dV hop home of each head group (events recorded by
  wrapping the platform's p2p exchange and block kernels: an order, not a time);
* peak live bytes of a fwd+bwd (the platform's storage tracker) stay within 2.5x single-device
  attention at the same local length, at P = 2 and 4, for both kernels, also with one K/V head and
  with 3 or 5 K/V heads; and through ContextParallel in every mode, zigzag included.
"""
import contextlib
from tests.harness import run_dist

B, HQ, D = 2, 4, 4
TOL = {"atol": 1e-5, "rtol": 1e-5}
DOCS = [[5, 11, 3, 13], [9, 2, 16, 5]]     # document lengths per batch row (sum 32 = S at P = 4)


def _masks(S):
    import torch
    ids = []
    for row in DOCS:
        scale = S / sum(row)
        ends = [round(scale * sum(row[:i + 1])) for i in range(len(row))]
        ids.append([sum(pos >= e for e in ends) for pos in range(S)])
    padding = torch.ones(B, S, dtype=torch.bool)
    padding[0, :3] = False          # left padding: with causal, rows that see no key at all
    padding[1, S - 6:] = False      # right padding
    return torch.tensor(ids), padding


def _dense(ids, padding, causal, S):
    import torch
    allowed = (ids.unsqueeze(-1) == ids.unsqueeze(-2)) & padding.unsqueeze(-2)
    if causal:
        allowed &= torch.ones(S, S, dtype=torch.bool).tril()
    return allowed.unsqueeze(1)


def _pick(t, rank, P, zigzag):
    import torch
    if not zigzag:
        return t.chunk(P, 2)[rank]
    chunks = t.chunk(2 * P, 2)
    return torch.cat([chunks[2 * rank], chunks[2 * P - 1 - 2 * rank]], 2)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _masked_case(rank, world):
    import torch
    import torch.nn.functional as F
    from hyper_parallel import attention_masks
    from hyper_parallel.core.context_parallel.masks.masked_ring import masked_ring_attention
    from hyper_parallel.core.context_parallel.ring.ring_attention import RingLayout

    S = 8 * world
    ids, padding = _masks(S)
    done = []
    for zigzag in (False, True):
        for hkv in (1, 2, 4):          # 1: one head group; 2 (GQA) and 4: two groups
            for causal in (True, False):
                gen = torch.Generator().manual_seed(len(done))
                full = [torch.randn(B, h, S, D, generator=gen) for h in (HQ, hkv, hkv)]
                w = torch.randn(B, HQ, S, D, generator=gen)
                refs = [_leaf(t) for t in full]
                ref = F.scaled_dot_product_attention(*refs, attn_mask=_dense(ids, padding, causal, S),
                                                     enable_gqa=True)
                (ref * w).sum().backward()
                mine = [_leaf(_pick(t, rank, world, zigzag)) for t in full]
                with attention_masks(document_ids=ids, padding_mask=padding, block_size=3) as masks:
                    out = masked_ring_attention(*mine, RingLayout(tuple(range(world)), rank, zigzag), masks,
                                                causal)
                where = f"zigzag={zigzag} kv_heads={hkv} causal={causal} P={world}"
                done.append(_compare(out, ref, w, mine, refs, (rank, world, zigzag), where))
    return done


def _compare(out, ref, w, mine, refs, block, where):
    """This rank's ``out`` and the gradients of its leaves ``mine`` (after backward of sum(out * w))
    against its ``block`` = (rank, world, zigzag) of the reference and its leaves' gradients."""
    import torch
    torch.testing.assert_close(out, _pick(ref.detach(), *block), **TOL, msg=lambda m: f"out {where}: {m}")
    (out * _pick(w, *block)).sum().backward()
    for name, leaf, r in zip("qkv", mine, refs):
        torch.testing.assert_close(leaf.grad, _pick(r.grad, *block), **TOL,
                                   msg=lambda m, n=name: f"d{n} {where}: {m}")
    return where


def test_masked_ring_matches_single_device():
    done = run_dist(4, _masked_case, timeout=600)
    assert [len(d) for d in done] == [12] * 4


def _unmasked_heads_case(rank, world):
    """ring_attention (the unmasked kernel) with one K/V head (MQA: query-head chunks sharing the
    K/V block) and odd K/V head counts (unequal head groups) against single-device SDPA."""
    import torch
    import torch.nn.functional as F
    from hyper_parallel.core.context_parallel.ring.ring_attention import RingLayout, ring_attention

    S = 8 * world
    done = []
    for hq, hkv in ((4, 1), (5, 1), (6, 3), (5, 5)):
        for zigzag in (False, True):
            for causal in (True, False):
                gen = torch.Generator().manual_seed(len(done))
                full = [torch.randn(B, h, S, D, generator=gen) for h in (hq, hkv, hkv)]
                w = torch.randn(B, hq, S, D, generator=gen)
                refs = [_leaf(t) for t in full]
                ref = F.scaled_dot_product_attention(*refs, is_causal=causal, enable_gqa=hkv != hq)
                (ref * w).sum().backward()
                mine = [_leaf(_pick(t, rank, world, zigzag)) for t in full]
                out = ring_attention(*mine, RingLayout(tuple(range(world)), rank, zigzag), causal)
                where = f"hq={hq} kv_heads={hkv} zigzag={zigzag} causal={causal} P={world}"
                done.append(_compare(out, ref, w, mine, refs, (rank, world, zigzag), where))
    return done


def test_unmasked_ring_with_one_or_an_odd_number_of_kv_heads_matches_single_device():
    done = run_dist(4, _unmasked_heads_case, timeout=600)
    assert [len(d) for d in done] == [16] * 4


@contextlib.contextmanager
def _four_head_groups():
    """Every ring call in the block runs four head groups (ring_attention.LARGE_GROUP_BYTES = 0),
    restored after: the pool's workers outlive a case."""
    import hyper_parallel.core.context_parallel.ring.ring_attention as ring_module
    saved, ring_module.LARGE_GROUP_BYTES = ring_module.LARGE_GROUP_BYTES, 0
    try:
        yield
    finally:
        ring_module.LARGE_GROUP_BYTES = saved


def _four_groups_case(rank, world):
    """The unmasked (odd and single K/V head counts) and masked cases with four head groups forced."""
    with _four_head_groups():
        return _unmasked_heads_case(rank, world) + _masked_case(rank, world)


def test_four_head_groups_match_single_device():
    """Four groups (4 K/V heads: one head each; 5: 2 + 1 + 1 + 1; 3: three groups) give the same
    outputs and gradients as single-device attention, masked and unmasked, zigzag too."""
    done = run_dist(4, _four_groups_case, timeout=600)
    assert [len(d) for d in done] == [28] * 4


def _bytes_case(rank, world):
    """(forward bytes, backward bytes) sent per kernel, bf16, 2 K/V heads."""
    import torch
    from hyper_parallel import attention_masks
    from hyper_parallel.core.comm_mode import CommDebugMode
    from hyper_parallel.core.context_parallel.masks.masked_ring import masked_ring_attention
    from hyper_parallel.core.context_parallel.ring.ring_attention import RingLayout, ring_attention

    S, hkv = 8 * world, 2
    ids, padding = _masks(S)
    layout = RingLayout(tuple(range(world)), rank)
    kernels = {"unmasked": lambda q, k, v, m: ring_attention(q, k, v, layout, True),
               "masked": lambda q, k, v, m: masked_ring_attention(q, k, v, layout, m, True)}
    result = {}
    for name, kernel in kernels.items():
        q, k, v = (torch.randn(B, h, S // world, D).bfloat16().requires_grad_() for h in (HQ, hkv, hkv))
        with attention_masks(document_ids=ids, padding_mask=padding) as masks:
            with CommDebugMode() as comm:
                out = kernel(q, k, v, masks)
            fwd = comm.get_comm_bytes()
            with CommDebugMode() as comm:
                out.float().sum().backward()
            result[name] = (fwd, comm.get_comm_bytes())
    return result


def test_both_kernels_send_the_ring_bytes_in_the_input_dtype():
    world = 4
    hop = 2 * B * (8 * world // world) * 2 * D * 2          # a K and a V block, 2 heads, bf16
    for result in run_dist(world, _bytes_case, timeout=300):
        for name, (fwd, bwd) in result.items():
            assert dict(fwd) == {"send_recv": (world - 1) * hop}, (name, fwd)
            assert dict(bwd) == {"send_recv": 2 * (world - 1) * hop}, (name, bwd)


class _Events:
    """Records, in order, block-kernel calls and the start / wait of every ring hop."""

    def __init__(self, platform):
        self.platform, self.log = platform, []

    def __enter__(self):
        p = self.platform
        originals = {n: getattr(p, n) for n in ("p2p_exchange", "attention_block_forward",
                                                "attention_block_backward")}
        log = self.log

        class Handle:
            def __init__(self, inner, hop):
                self.inner, self.hop = inner, hop

            def wait(self):
                log.append(("wait", self.hop))
                return self.inner.wait()

        def exchange(*args, **kwargs):
            hop = len([e for e in log if e[0] == "start"])
            log.append(("start", hop))
            return Handle(originals["p2p_exchange"](*args, **kwargs), hop)

        def kernel(name):
            def call(*args, **kwargs):
                log.append(("kernel", name))
                return originals[name](*args, **kwargs)
            return call
        p.p2p_exchange = exchange
        p.attention_block_forward = kernel("attention_block_forward")
        p.attention_block_backward = kernel("attention_block_backward")
        self.originals = originals
        return self

    def __exit__(self, *exc):
        for name in self.originals:
            delattr(self.platform, name)   # back to the class's method

    def exposed(self):
        """Hops waited with no kernel call since their start."""
        started, exposed = {}, 0
        for i, event in enumerate(self.log):
            if event[0] == "start":
                started[event[1]] = i
            elif event[0] == "wait":
                between = self.log[started[event[1]] + 1:i]
                exposed += not any(e[0] == "kernel" for e in between)
        return exposed


def _order_case(rank, world):
    """{kernel: (exposed forward hops, exposed backward hops, head groups)}: padding only, not
    causal, so every visiting block has work for every query chunk."""
    import torch
    from hyper_parallel import attention_masks
    from hyper_parallel.core.context_parallel.masks.masked_ring import masked_ring_attention
    from hyper_parallel.core.context_parallel.ring.ring_attention import (RingLayout, _head_ranges,
                                                                          ring_attention)
    from hyper_parallel.platform import get_platform

    S, hkv = 8 * world, 2
    _, padding = _masks(S)
    layout = RingLayout(tuple(range(world)), rank)
    result = {}
    for name in ("unmasked", "masked"):
        q, k, v = (torch.randn(B, h, S // world, D).requires_grad_() for h in (HQ, hkv, hkv))
        with attention_masks(padding_mask=padding) as masks:
            with _Events(get_platform()) as fwd:
                out = (ring_attention(q, k, v, layout) if name == "unmasked"
                       else masked_ring_attention(q, k, v, layout, masks))
            with _Events(get_platform()) as bwd:
                out.sum().backward()
        result[name] = (fwd.exposed(), bwd.exposed(), len(_head_ranges(hkv)))
    return result


def test_both_kernels_overlap_every_hop_but_the_last_one_home():
    for result in run_dist(4, _order_case, timeout=300):
        for name, (fwd, bwd, groups) in result.items():
            assert fwd == 0, (name, result)
            assert bwd == groups, (name, result)


def _live_bytes(inputs):
    """The platform's storage tracker (torch CPU), told that the caller's inputs pre-exist: a view of
    an input made inside the region (a narrow, a chunk) is not new memory."""
    from hyper_parallel.platform.torch.memory import _LiveBytes
    mode = _LiveBytes()
    mode._seen.update(t.untyped_storage().data_ptr() for t in inputs)
    return mode


def _memory_case(rank, world, heads=((8, 8),), large_groups=False):
    """{(P, kernel, Hq, Hkv): peak live bytes of a ring fwd+bwd / single-device SDPA's} at a local
    length of 64 tokens, for rings of 2 and world ranks (ranks outside a ring of 2 ring alone), and
    the zigzag ring of world ranks; ``large_groups``: as if the blocks were large enough for four
    head groups (ring_attention.LARGE_GROUP_BYTES)."""
    import torch
    import torch.nn.functional as F
    from hyper_parallel import attention_masks
    from hyper_parallel.core.context_parallel.masks.masked_ring import masked_ring_attention
    from hyper_parallel.core.context_parallel.ring.ring_attention import RingLayout, ring_attention
    from hyper_parallel.platform import get_platform

    if large_groups:
        with _four_head_groups():
            return _memory_case(rank, world, heads)
    L = 64
    ratios = {}
    for hq, hkv in heads:
        q, k, v, g = (torch.randn(1, h, L, 16) for h in (hq, hkv, hkv, hq))

        def peak(fn):
            leaves = [_leaf(t) for t in (q, k, v)]
            with _live_bytes(leaves + [g]) as mem:
                fn(*leaves).backward(g)
            return mem.peak
        single = peak(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True,
                                                                     enable_gqa=hkv != hq))
        for P, zigzag in ((2, False), (world, False), (world, True)):
            ranks = tuple(range(P)) if rank < P else (rank,)
            layout = RingLayout(ranks, ranks.index(rank), zigzag)
            kind = "zigzag " if zigzag else ""
            ids = (torch.arange(L * len(ranks)) * 3 // (L * len(ranks))).unsqueeze(0)   # 3 documents
            with attention_masks(document_ids=ids, block_size=16) as masks:
                ratios[(P, kind + "unmasked", hq, hkv)] = peak(
                    lambda a, b, c: ring_attention(a, b, c, layout, True)) / single
                ratios[(P, kind + "masked", hq, hkv)] = peak(
                    lambda a, b, c: masked_ring_attention(a, b, c, layout, masks, True)) / single
            get_platform().barrier()
    return ratios


def test_ring_memory_within_two_and_a_half_single_device():
    """Measured (L = 64, H = 8, causal, fp32): single-device SDPA 5 q-sized blocks (output, dq, dk,
    dv, a gradient copy); the ring about 10.5 from P = 4 on (output; half-head K/V block in use and
    arriving, dK/dV hop send and receive, own block's dK/dV, the kernel's outputs, dq; the first head
    group's finished gradients). Without head groups it was 15."""
    for ratios in run_dist(4, _memory_case, timeout=300):
        assert all(r <= 2.5 for r in ratios.values()), ratios


def test_ring_memory_with_one_or_an_odd_number_of_kv_heads():
    """MQA (one K/V head: the query heads run in chunks sharing the K/V block) and 3 or 5 K/V heads
    (two head groups of unequal size) stay within 2.5x single-device attention too."""
    for ratios in run_dist(4, _memory_case, ((8, 1), (6, 3), (5, 5)), timeout=300):
        assert all(r <= 2.5 for r in ratios.values()), ratios


def test_ring_memory_with_four_head_groups_on_large_blocks():
    """Where a group's K block is large (>= LARGE_GROUP_BYTES at four groups), the ring runs four
    head groups: every per-step buffer halves again. Measured P = 4: 1.41 unmasked, 1.43 masked,
    1.49 zigzag (two groups: 2.01 / 1.91 / 2.16)."""
    from hyper_parallel.core.context_parallel.ring.ring_attention import LARGE_GROUP_BYTES, _group_count
    import torch
    assert _group_count(torch.empty(1, 8, 4 * LARGE_GROUP_BYTES // 32, 1)) == 4
    assert _group_count(torch.empty(1, 8, 4 * LARGE_GROUP_BYTES // 32 - 1, 1)) == 2
    for ratios in run_dist(4, _memory_case, ((8, 8),), True, timeout=300):
        assert all(r <= 1.75 for r in ratios.values()), ratios


def _mode_memory_case(rank, world):
    """{mode: peak live bytes of one ContextParallel fwd+bwd / single-device SDPA's} at a local
    length of 64 tokens (BSHD, causal), q, k and v made inside the step from leaves (as a model's
    projections make them: nothing keeps them once attention has them), the caller holding the
    output (both sides alike)."""
    import torch
    import torch.nn.functional as F
    from hyper_parallel import ContextParallel, init_device_mesh

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(1, 64, 8, 16, generator=gen) for _ in range(3)]
    grad = torch.randn(1, 64, 8, 16, generator=gen)

    def peak(fn):
        leaves = [_leaf(t) for t in inputs]
        with _live_bytes(leaves + [grad]) as mem:
            out = fn(*(t.mul(1.0) for t in leaves))
            out.backward(grad)
        return mem.peak
    single = peak(Attention())
    styles = {"ulysses": {}, "ring": {"ulysses_degree": 1, "kv_exchange": "ring"},
              "zigzag": {"ulysses_degree": 1, "kv_exchange": "ring", "load_balance": True},
              "hybrid": {"ulysses_degree": 2, "kv_exchange": "ring"}}
    ratios = {}
    for name, style in styles.items():
        module = ContextParallel(seq_dim=1, head_dim=2, **style).apply(Attention(), mesh)
        peak(module)   # the first call checks the ranks agree (collectives of its own)
        ratios[name] = peak(module) / single
    return ratios


def test_context_parallel_modes_memory_within_two_and_a_half_single_device():
    """Through ContextParallel, with q, k, v made in the step: every mode's peak stays within 2.5x
    single-device attention at the same local length (measured, P = 4, largest rank: Ulysses 1.42,
    ring 1.92, zigzag 2.24, hybrid 1.78). The zigzag ring's re-laid q, k, v blocks replace the
    caller's, which nothing else keeps; a caller that holds its q, k, v pays for both
    (docs/ring_attention.md, "Zigzag memory")."""
    for ratios in run_dist(4, _mode_memory_case, timeout=300):
        assert all(r <= 2.5 for r in ratios.values()), ratios
