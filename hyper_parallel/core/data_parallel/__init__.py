"""Data parallelism's room: the one gradient reducer (reducer.py, also fully_shard's), data_parallel()
(api.py), shard_sequence() (shard_sequence.py) and their checks (checks.py)."""
from hyper_parallel.core.data_parallel.api import TupleGradReducer, data_parallel
from hyper_parallel.core.data_parallel.reducer import DEFAULT_BUCKET_MB, GradientReducer

__all__ = ["DEFAULT_BUCKET_MB", "GradientReducer", "TupleGradReducer", "data_parallel"]
