"""fully_shard: ZeRO-3 / HSDP sharded data parallel (docs/fully_shard.md)."""
from hyper_parallel.core.fully_shard.api import fully_shard
from hyper_parallel.core.fully_shard.mixed_precision import MixedPrecisionPolicy

__all__ = ["fully_shard", "MixedPrecisionPolicy"]
