"""Attention maths, framework-neutral: the block kernels on local tensors and what they share.

offset_causal.py   the all-gather-KV kernel (local query rows on the whole keys, global causal mask);
                   the GQA head helpers
lse.py             log-sum-exp algebra: merging blocks, rows that saw no key, sinks and their gradient
band.py            causal + sliding window by global positions: which block pairs are skipped / masked
causal_blocks.py   the ring's block kernel on a chunk pair by global positions
block_masks.py     a tile's boolean mask from document ids / padding
masked_attention.py  the tiled masked kernel (skips empty tiles), forward and backward
variant_kernel.py  hyper_parallel.attention's kernel: softcap, sinks, window
roles.py           what a ContextParallel call promises the kernel (q split on seq or heads)
npu_args.py, npu_band.py, npu_packed.py  npu_fusion_attention's arguments, band / sparse modes, TND

The sharding rules that call these (sdpa, attention, npu_fusion_attention) are thin adapters in
core/dtensor/ops/; the ring loop that drives the kernels is core/context_parallel/ring/. Nothing is
imported here.
"""
