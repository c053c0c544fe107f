"""hyper_parallel: one line per parallelism for long-context transformers.

Names are resolved lazily so that ``import hyper_parallel`` never imports a framework before
``HP_PLATFORM`` is read.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "DeviceMesh": "hyper_parallel.core.dtensor",
    "init_device_mesh": "hyper_parallel.core.dtensor",
    "DTensor": "hyper_parallel.core.dtensor",
    "Shard": "hyper_parallel.core.dtensor",
    "StridedShard": "hyper_parallel.core.dtensor",
    "Replicate": "hyper_parallel.core.dtensor",
    "Partial": "hyper_parallel.core.dtensor",
    "distribute_tensor": "hyper_parallel.core.dtensor",
    "distribute_module": "hyper_parallel.core.dtensor",
    "local_map": "hyper_parallel.core.dtensor",
    "register_sharding": "hyper_parallel.core.dtensor",
    "implicit_replication": "hyper_parallel.core.dtensor",
    "zeros": "hyper_parallel.core.dtensor.factories",
    "ones": "hyper_parallel.core.dtensor.factories",
    "empty": "hyper_parallel.core.dtensor.factories",
    "full": "hyper_parallel.core.dtensor.factories",
    "rand": "hyper_parallel.core.dtensor.factories",
    "randn": "hyper_parallel.core.dtensor.factories",
    "CommDebugMode": "hyper_parallel.core.comm_mode",
    "get_platform": "hyper_parallel.platform",
    "ParallelStyle": "hyper_parallel.core.tensor_parallel",
    "ColwiseParallel": "hyper_parallel.core.tensor_parallel",
    "RowwiseParallel": "hyper_parallel.core.tensor_parallel",
    "SequenceParallel": "hyper_parallel.core.tensor_parallel",
    "PrepareModuleInput": "hyper_parallel.core.tensor_parallel",
    "PrepareModuleOutput": "hyper_parallel.core.tensor_parallel",
    "PrepareModuleInputOutput": "hyper_parallel.core.tensor_parallel",
    "NoParallel": "hyper_parallel.core.tensor_parallel",
    "parallelize_module": "hyper_parallel.core.tensor_parallel",
    "loss_parallel": "hyper_parallel.core.tensor_parallel",
    "ContextParallel": "hyper_parallel.core.context_parallel",
    "ExpertParallel": "hyper_parallel.core.expert_parallel",
    "AsyncContextParallel": "hyper_parallel.core.context_parallel",
    "attention": "hyper_parallel.core.context_parallel",
    "attention_masks": "hyper_parallel.core.context_parallel",
    "start_attention": "hyper_parallel.core.context_parallel",
    "data_parallel": "hyper_parallel.core.data_parallel",
    "fully_shard": "hyper_parallel.core.fully_shard",
    "MixedPrecisionPolicy": "hyper_parallel.core.fully_shard",
    "shard_sequence": "hyper_parallel.core.data_parallel.shard_sequence",
    "chunked_cross_entropy": "hyper_parallel.core.long_sequence",
    "tiled_mlp": "hyper_parallel.core.long_sequence",
    "offload_activations": "hyper_parallel.core.long_sequence",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hyper_parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
