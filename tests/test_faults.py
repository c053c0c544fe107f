"""Faults: a rank that raises while its process lives on must not hang the others.

``init_device_mesh(..., timeout=s)`` gives the mesh's process groups a collective timeout; a rank
that skips a collective makes its peers fail within that time with an error naming the collective,
the group's ranks and the timeout. Each case uses a mesh with a timeout no other case uses, so
its groups are fresh (a gloo group whose collective timed out is not used again).
"""
import os
import subprocess
import sys
import textwrap

from tests.harness import run_dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _skipped_collective(rank, world_size, timeout):
    import time

    import pytest
    import torch
    from hyper_parallel import DTensor, init_device_mesh
    from hyper_parallel.core.dtensor import Partial, Replicate
    from hyper_parallel.platform import get_platform
    from hyper_parallel.platform.torch.collectives import CollectiveError

    platform = get_platform()
    with pytest.raises(ValueError, match="timeout"):
        init_device_mesh("cpu", (world_size,), timeout=0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",), timeout=timeout)
    assert platform.group_timeout(mesh.get_group(0)) == timeout
    # the mesh works: a Partial -> Replicate all-reduce is exact
    part = torch.arange(6.0).reshape(2, 3) * (rank + 1)
    total = DTensor.from_local(part, mesh, [Partial()]).redistribute(placements=[Replicate()]).to_local()
    torch.testing.assert_close(total, torch.arange(6.0).reshape(2, 3) * sum(range(1, world_size + 1)))

    if rank == world_size - 1:
        try:  # this rank's step raises; it catches the error and goes on without the collective
            raise RuntimeError("user code failed on the last rank")
        except RuntimeError:
            return None
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        DTensor.from_local(part, mesh, [Partial()]).full_tensor()
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert isinstance(info.value, CollectiveError) and isinstance(info.value, RuntimeError)
    assert "all_reduce" in message and str(list(range(world_size))) in message, message
    assert f"{timeout:g} s" in message, message
    return elapsed


def test_skipped_collective_times_out_with_a_named_error():
    timeout = 2.25
    elapsed = run_dist(2, _skipped_collective, timeout, timeout=60)
    assert elapsed[1] is None
    assert timeout * 0.8 <= elapsed[0] < timeout + 5, elapsed


_FRESH_WORLD = textwrap.dedent("""
    import os, sys, time
    import torch
    from hyper_parallel import init_device_mesh
    from hyper_parallel.platform import get_platform
    from hyper_parallel.platform.torch.collectives import CollectiveTimeoutError
    mesh = init_device_mesh("cpu", (2,), timeout=2)     # initialises the default group
    platform = get_platform()
    assert mesh.get_group(0) is torch.distributed.group.WORLD
    assert platform.group_timeout(None) == 2
    if int(os.environ["RANK"]) == 1:
        time.sleep(4)                                     # alive, but never joins
        sys.exit(0)
    start = time.monotonic()
    try:
        platform.all_reduce(torch.ones(3), mesh.get_group(0))
    except CollectiveTimeoutError as exc:
        print("ELAPSED", time.monotonic() - start)
        print("MESSAGE", exc)

        os._exit(0)
    os._exit(3)
""")


def test_timeout_initialises_the_default_group(tmp_path):
    """Without a default group, init_device_mesh(timeout=) creates it with that timeout."""
    from tests.harness.processes import free_port
    script = tmp_path / "fresh.py"
    script.write_text(_FRESH_WORLD)
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    lines = dict(line.split(" ", 1) for line in outs[0][0].splitlines() if " " in line)
    assert 1.5 <= float(lines["ELAPSED"]) < 4, lines
    assert "all_reduce on process group ranks [0, 1] timed out after 2 s" in lines["MESSAGE"], lines
