"""Padding masks and packed documents under context parallelism, without an S×S mask:
``attention_masks`` (the user's context, attention_masks.py), the tile masks built from ids
(block_masks.py), the mode wrapper that applies them at the attention op (mask_mode.py), the tiled
kernel that skips empty tiles (masked_attention.py) and its ring form (masked_ring.py)."""
from hyper_parallel.core.context_parallel.masks.attention_masks import (active_masks, attention_masks,
                                                                        check_masks)

__all__ = ["active_masks", "attention_masks", "check_masks"]
