"""A MindSpore worker (or the scheduler) of the test harness: ``python -m tests.mindspore.worker``.

Runs under the MindSpore interpreter (no torch, no pytest). The scheduler (``MS_ROLE=MS_SCHED``)
only runs MindSpore's ``init()``; a worker initialises communication through hyper_parallel's
platform, connects to the pytest process (``HP_MS_CONTROL``) and runs the cases it is sent.
Both exit when the pytest process dies.
"""
import importlib
import multiprocessing.connection as mpc
import os
import pickle
import signal
import sys
import threading
import time
import traceback

SEED = 1234
PROTOCOL = 4
_stack_file = None


def _watch_parent(parent_pid):
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(70)


def _setup_process():
    global _stack_file
    parent = int(os.environ.get("HP_MS_PARENT_PID", "0"))
    if parent:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="hp-parent-watch").start()
    try:
        import faulthandler
        _stack_file = open(os.environ["HP_MS_STACKS"], "w")
        faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
    except (KeyError, OSError, AttributeError, ValueError):
        pass


def _plain(value):
    """Results cross numpy versions: tensors and arrays become nested lists."""
    import numpy as np
    if hasattr(value, "asnumpy"):
        value = value.asnumpy()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _send(conn, obj):
    try:
        conn.send_bytes(pickle.dumps(obj, protocol=PROTOCOL))
    except (OSError, EOFError):
        os._exit(0)


def _scheduler():
    from mindspore.communication import init  # the scheduler role comes from MS_ROLE
    init()
    # init() of the scheduler returns once the cluster is up; stay until every worker is gone
    while True:
        time.sleep(3600)


def _worker():
    rank = int(os.environ["HP_MS_RANK"])
    world_size = int(os.environ["MS_WORKER_NUM"])
    host, port = os.environ["HP_MS_CONTROL"].rsplit(":", 1)
    conn = mpc.Client((host, int(port)), authkey=bytes.fromhex(os.environ["HP_MS_AUTHKEY"]))
    conn.send(("hello", rank, os.getpid()))
    try:
        import numpy as np
        import mindspore as ms
        from hyper_parallel.platform import get_platform
        platform = get_platform()
        platform.init_process_group()
        if platform.get_rank() != rank or platform.get_world_size() != world_size:
            raise RuntimeError(f"MindSpore says rank {platform.get_rank()} of {platform.get_world_size()}, "
                               f"the harness started rank {rank} of {world_size}")
    except BaseException:
        _send(conn, ("init_error", traceback.format_exc()))
        return
    _send(conn, ("ready", os.getpid()))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)
        try:
            message = pickle.loads(data)
        except BaseException:
            _send(conn, ("error", "the worker could not unpickle the case:\n" + traceback.format_exc()))
            continue
        if message[0] == "stop":
            reply = ("stopped",)
            try:
                platform.destroy_process_group()
            except BaseException:
                reply = ("stop_error", traceback.format_exc())
            _send(conn, reply)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        _, module_name, qualname, args, kwargs = message
        try:
            fn = importlib.import_module(module_name)
            for part in qualname.split("."):
                fn = getattr(fn, part)
            ms.set_seed(SEED)
            np.random.seed(SEED)
            result = _plain(fn(rank, world_size, *args, **kwargs))
            payload = pickle.dumps(("ok", result), protocol=PROTOCOL)
        except BaseException:
            payload = pickle.dumps(("error", traceback.format_exc()), protocol=PROTOCOL)
        try:
            conn.send_bytes(payload)
        except (OSError, EOFError):
            os._exit(0)


def main():
    _setup_process()
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        _scheduler()
    else:
        _worker()


if __name__ == "__main__":
    main()
