"""The masked tile kernel (masked_attention.py) keeps one tile's mask at a time (issue 17, round
three, item 3): ``plan()`` holds tile kinds only, and a ``masked`` tile's mask is rebuilt from the
ids where the kernel runs it. Single process: the kernel on a whole sequence (what a Ulysses rank
runs) equals SDPA with the dense mask, forward and gradients (fp32, 1e-5), while the boolean bytes
alive at once stay within a few tiles (keeping every partial tile's mask would be O(B·S·block)).
"""
B, H, S, D, BLOCK = 2, 2, 96, 4, 4


def _inputs():
    import torch
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 7, (B, S), generator=gen).sort(-1).values   # packed documents, sorted ids
    padding = torch.ones(B, S, dtype=torch.bool)
    padding[0, :5] = False
    q, k, v, w = (torch.randn(B, H, S, D, generator=gen) for _ in range(4))
    return ids, padding, (q, k, v), w


class _BoolBytes:
    """Peak bytes of boolean storages alive at once inside the region (a TorchDispatchMode)."""

    def __new__(cls):
        import weakref

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        class Mode(TorchDispatchMode):
            live = peak = 0
            seen = set()

            def _release(self, key, n):
                self.seen.discard(key)
                self.live -= n

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if type(t) is not torch.Tensor or t.dtype != torch.bool:
                        continue
                    storage = t.untyped_storage()
                    key, n = storage.data_ptr(), storage.nbytes()
                    if key in self.seen or n == 0:
                        continue
                    self.seen.add(key)
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._release, key, n)
                return out
        return Mode()


def test_plan_keeps_kinds_only_and_one_mask_is_alive_at_a_time():
    import torch
    import torch.nn.functional as F
    from hyper_parallel import attention_masks
    from hyper_parallel.core.attention.block_masks import Span
    from hyper_parallel.core.attention.masked_attention import masked_attention, plan

    ids, padding, full, w = _inputs()
    allowed = (ids.unsqueeze(-1) == ids.unsqueeze(-2)) & padding.unsqueeze(-2)
    allowed &= torch.ones(S, S, dtype=torch.bool).tril()
    refs = [t.clone().requires_grad_() for t in full]
    ref = F.scaled_dot_product_attention(*refs, attn_mask=allowed.unsqueeze(1))
    (ref * w).sum().backward()
    leaves = [t.clone().requires_grad_() for t in full]
    whole, rows = Span(0, S), Span(0, B)
    with attention_masks(document_ids=ids, padding_mask=padding, block_size=BLOCK) as masks:
        tiles = plan(masks, rows, whole, whole, True)
        kinds = [kind for _, keys in tiles for _, kind in keys]
        assert all(len(entry) == 2 for _, keys in tiles for entry in keys)   # (key tile, kind): no mask
        assert kinds.count("masked") >= 20, kinds   # enough partial tiles for the bound below to bite
        with _BoolBytes() as meter:
            out = masked_attention(*leaves, masks, rows, whole, whole, True, None)
            (out * w).sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for leaf, r in zip(leaves, refs):
        torch.testing.assert_close(leaf.grad, r.grad, atol=1e-5, rtol=1e-5)
    # per-row flags (which rows saw no key: B·H·S) plus a few tiles; every partial tile's mask kept
    # for the call would be 70 x B·BLOCK² here
    one_tile, row_flags = B * BLOCK * BLOCK, B * H * S
    assert meter.peak <= row_flags + 8 * one_tile, (meter.peak, one_tile, kinds.count("masked"))
