"""How q, k, v and the output travel between the caller's sequence split and a mode's layout.

One plan per move, each with ``run`` (now, as one autograd function) and ``start`` (a split
collective whose ``finish`` returns the moved blocks, so compute overlaps it):

- ``QKVAllToAll`` (mode_moves.py): q, k, v sequence -> heads in one all-to-all;
- ``KVAllGather`` (kv_all_gather.py): k and v in one all-gather;
- ``to_mode`` / ``mode_dtensors`` (mode_moves.py, with each mode's placements): both, chosen and
  cached per signature;
- ``start_output`` (output_move.py): the output heads -> sequence, split for overlap.
"""
from hyper_parallel.core.context_parallel.movement.kv_all_gather import KVAllGather
from hyper_parallel.core.context_parallel.movement.output_move import start_output
from hyper_parallel.core.context_parallel.movement.steps import Block, shared_step, single_step
from hyper_parallel.core.context_parallel.movement.mode_moves import QKVAllToAll, mode_dtensors, to_mode

__all__ = ["Block", "KVAllGather", "QKVAllToAll", "mode_dtensors", "shared_step", "single_step",
           "start_output", "to_mode"]
