# tests/cases/doc_example.py -- imported by torch AND MindSpore workers: no torch, no pytest here
import numpy as np
from tests.frameworks import close, inp, t


def gather_rows(rank, world_size, rows):
    from hyper_parallel.platform import get_platform
    platform = get_platform()
    mine = inp("rows", rank, (rows, 3))                      # numpy, the same on every framework
    out = platform.all_gather(t(mine), platform.new_group(range(world_size)), dim=0)
    close(out, np.concatenate([inp("rows", r, (rows, 3)) for r in range(world_size)]), "all_gather")
    return int(out.shape[0])                                  # plain Python values only
