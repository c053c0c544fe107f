"""Tiny cases for the harness's own tests."""


def hello(rank, world_size):
    import numpy as np
    import mindspore as ms
    from hyper_parallel.platform import get_platform
    platform = get_platform()
    group = platform.new_group(range(world_size))
    out = platform.all_gather(ms.Tensor(np.array([rank], np.float32)), group)
    return {"rank": platform.get_rank(), "world": platform.get_world_size(), "gathered": out}


def raise_on(rank, world_size, bad_rank):
    if rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    return rank


def sleep_on(rank, world_size, slow_rank, seconds):
    import time
    if rank == slow_rank:
        time.sleep(seconds)
    return rank


def exit_on(rank, world_size, bad_rank, code):
    import os
    if rank == bad_rank:
        os._exit(code)
    return rank


def environment(rank, world_size):
    """What a case sees: the platform, the seeds, the numpy version."""
    import os
    import numpy as np
    import mindspore as ms
    from hyper_parallel.platform import get_platform
    return {"platform": get_platform().name, "pid": os.getpid(), "numpy": np.__version__,
            "mindspore": ms.__version__, "random": float(np.random.rand()),
            "ms_random": float(ms.ops.rand((1,)).asnumpy()[0])}
