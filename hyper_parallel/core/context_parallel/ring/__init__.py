"""Ring attention (``kv_exchange="ring"``): K/V blocks rotate rank to rank while partial results merge
by log-sum-exp — the algorithm (ring_attention.py) and how a ContextParallel call runs it
(ring_mode.py)."""
