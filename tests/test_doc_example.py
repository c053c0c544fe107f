# tests/test_doc_example.py
from tests.harness import run_dist


def _case(rank, world_size, rows):
    # Runs on every rank, in a worker whose default process group (gloo) is already initialised
    # through hyper_parallel's platform. Import heavy things inside the function.
    import torch
    from hyper_parallel.platform import get_platform

    platform = get_platform()
    group = platform.new_group(range(world_size))
    mine = torch.arange(rows * 3.0).reshape(rows, 3) + 100 * rank

    out = platform.all_gather(mine, group, dim=0)

    # Every rank can build every rank's input, so the reference is computed locally.
    expected = torch.cat([torch.arange(rows * 3.0).reshape(rows, 3) + 100 * r
                          for r in range(world_size)])
    torch.testing.assert_close(out, expected)
    return out.shape[0]          # returned values must be picklable


def test_all_gather_rows():
    assert run_dist(4, _case, 3) == [12, 12, 12, 12]
