"""Long sequences beyond attention (SPEC §15): the loss, the MLP and the saved activations in tiles
or off the device, so that what context parallelism leaves per rank fits (docs/long_sequences.md)."""
from hyper_parallel.core.long_sequence.chunked_loss import chunked_cross_entropy
from hyper_parallel.core.long_sequence.offload import offload_activations
from hyper_parallel.core.long_sequence.tiled_mlp import tiled_mlp

__all__ = ["chunked_cross_entropy", "offload_activations", "tiled_mlp"]
