"""Persistent pools of gloo worker processes for multi-process tests.

One pool per world size, spawned lazily on the first ``run_dist`` for that size and reused for
the rest of the pytest session (starting a torch process costs seconds on a small CI machine).
Each worker initialises the default process group through ``hyper_parallel``'s platform, then
runs cases sent to it: ``fn(rank, world_size, *args, **kwargs)``.

A case fails with :class:`DistTestFailure` (an ``AssertionError``) when a rank raises, dies, or
does not answer within the case's timeout. The message names the rank(s) and carries their
tracebacks (and, for ranks that were stuck, the Python stacks where they were stuck). The pool is
then killed, and the next ``run_dist`` for that world size starts a fresh one, so a broken case
never poisons the next one and the suite never hangs.

Workers exit on their own when the parent process dies (a thread polls ``os.getppid()``, and a
closed pipe ends the receive loop), so no worker outlives the test session.

This module must not import torch at import time: workers import it while unpickling their
entry point, before they set ``OMP_NUM_THREADS``.
"""
import atexit
import multiprocessing
import multiprocessing.connection as mp_connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback

from tests.harness.processes import describe_exit, free_port
from tests.harness.registry import PoolRegistry

__all__ = ["run_dist", "DistTestFailure", "pool_pids", "kill_pool", "shutdown_pools"]

SEED = 1234
# Start-up of a pool (import torch + rendezvous): 8 ranks on 2 cores take ~10-20 s.
START_TIMEOUT_S = float(os.environ.get("HP_TEST_START_TIMEOUT", "180"))
# gloo's own collective timeout inside workers. The harness's per-case timeout is what normally
# fires first; this only bounds a worker that somehow outlives its case.
GLOO_TIMEOUT_S = float(os.environ.get("HP_TEST_GLOO_TIMEOUT", "600"))
# After one rank fails, how long the others get to report (their own errors, typically
# "connection closed by peer") before the pool is killed.
GRACE_AFTER_FAILURE_S = 2.0
STOP_TIMEOUT_S = 15.0


class DistTestFailure(AssertionError):
    """A distributed case failed: a rank raised, died, or timed out. The message says which."""


# =============================================================================== worker side
_stack_file = None  # kept open for faulthandler


def _watch_parent(parent_pid):
    """Exit when the parent dies (we are reparented), even if the main thread is stuck in C."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(70)


def _send(conn, obj):
    try:
        conn.send_bytes(pickle.dumps(obj))
    except (OSError, EOFError):  # parent gone
        os._exit(0)


def _worker_main(rank, world_size, port, conn, sys_path, parent_pid, gloo_timeout_s, stack_path):
    global _stack_file
    sys.path[:] = sys_path
    os.environ.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                     name="hp-parent-watch").start()
    try:
        import faulthandler
        _stack_file = open(stack_path, "w")
        faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
    except (OSError, AttributeError, ValueError):
        pass
    try:
        import torch
        torch.set_num_threads(1)
        from hyper_parallel.platform import get_platform
        platform = get_platform()
        platform.init_process_group(timeout_s=gloo_timeout_s)
    except BaseException:
        _send(conn, ("init_error", traceback.format_exc()))
        return
    _send(conn, ("ready", os.getpid()))

    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)  # the parent closed the pipe or died
        try:
            message = pickle.loads(data)
        except BaseException:
            _send(conn, ("error", "the worker could not unpickle the case (is fn defined at module "
                                  "level in an importable module?):\n" + traceback.format_exc()))
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
        _, fn, args, kwargs = message
        torch.manual_seed(SEED)
        try:
            result = fn(rank, world_size, *args, **kwargs)
        except BaseException:
            _send(conn, ("error", traceback.format_exc()))
            continue
        try:
            payload = pickle.dumps(("ok", result))
        except BaseException:
            payload = pickle.dumps(("error", "the return value could not be pickled:\n"
                                             + traceback.format_exc()))
        try:
            conn.send_bytes(payload)
        except (OSError, EOFError):
            os._exit(0)


# =============================================================================== parent side
def _fn_name(fn):
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class _Pool:
    def __init__(self, world_size):
        self.world_size = world_size
        self.procs = []
        self.conns = []
        self.stack_paths = []
        self.tmpdir = None
        self.closed = False

    # ------------------------------------------------------------------ lifecycle
    def start(self):
        for attempt in range(3):
            self._spawn()
            replies, dead, pending = self._collect(time.monotonic() + START_TIMEOUT_S)
            if not dead and not pending and all(r[0] == "ready" for r in replies.values()):
                return
            texts = " ".join(r[1] for r in replies.values() if r[0] == "init_error")
            port_clash = "address already in use" in texts.lower() or "EADDRINUSE" in texts
            message = self._failure_message(f"starting the world-size-{self.world_size} pool",
                                            replies, dead, pending, START_TIMEOUT_S, ok_tag="ready")
            self.kill()
            if not port_clash or attempt == 2:
                raise DistTestFailure(message)
            self.closed = False  # retry on a new port

    def _spawn(self):
        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        self.tmpdir = tempfile.mkdtemp(prefix=f"hp_pool{self.world_size}_")
        self.procs, self.conns, self.stack_paths = [], [], []
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            stack_path = os.path.join(self.tmpdir, f"rank{rank}.stacks")
            proc = ctx.Process(
                target=_worker_main, name=f"hp-rank{rank}-of-{self.world_size}", daemon=True,
                args=(rank, self.world_size, port, child_end, list(sys.path), os.getpid(),
                      GLOO_TIMEOUT_S, stack_path))
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
            self.stack_paths.append(stack_path)

    def healthy(self):
        return not self.closed and all(p.is_alive() for p in self.procs)

    def pids(self):
        return [p.pid for p in self.procs]

    def kill(self):
        """Terminate, then kill, then reap every worker. Idempotent."""
        self.closed = True
        for proc in self.procs:
            if proc.is_alive():
                try:
                    proc.terminate()
                except OSError:
                    pass
        deadline = time.monotonic() + 3.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                try:
                    proc.kill()
                except OSError:
                    pass
        for proc in self.procs:
            proc.join(5.0)
        self._release()

    def stop(self):
        """Graceful shutdown: every worker destroys its process group (a barrier), then exits."""
        if self.closed:
            return
        if self.healthy():
            for conn in self.conns:
                try:
                    conn.send_bytes(pickle.dumps(("stop",)))
                except (OSError, EOFError):
                    pass
            self._collect(time.monotonic() + STOP_TIMEOUT_S, grace=STOP_TIMEOUT_S)
            deadline = time.monotonic() + 5.0
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()  # reaps the ones that exited; kills any leftover

    def _release(self):
        for conn in self.conns:
            try:
                conn.close()
            except OSError:
                pass
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    # ------------------------------------------------------------------ cases
    def run(self, payload, timeout, label):
        for conn in self.conns:
            conn.send_bytes(payload)
        replies, dead, pending = self._collect(time.monotonic() + timeout)
        if not dead and not pending and all(r[0] == "ok" for r in replies.values()):
            return [replies[rank][1] for rank in range(self.world_size)]
        message = self._failure_message(label, replies, dead, pending, timeout, ok_tag="ok")
        self.kill()
        raise DistTestFailure(message)

    def _collect(self, deadline, grace=GRACE_AFTER_FAILURE_S):
        """Wait for one message per rank until ``deadline``. Returns (replies, dead, pending):
        replies[rank] = message tuple, dead[rank] = exit code, pending = ranks that never
        answered. Once a rank fails (error or death), the others get ``grace`` seconds more."""
        n = self.world_size
        replies, dead, eof = {}, {}, set()
        give_up = deadline
        while True:
            waiting = [r for r in range(n) if r not in replies and r not in dead]
            now = time.monotonic()
            if not waiting or now >= give_up:
                break
            objects = [self.procs[r].sentinel for r in waiting]
            objects += [self.conns[r] for r in waiting if r not in eof]
            mp_connection.wait(objects, timeout=min(1.0, give_up - now))
            failed = False
            for rank in waiting:
                if rank not in eof:
                    try:
                        if self.conns[rank].poll():
                            replies[rank] = self._receive(rank)
                            failed |= replies[rank][0] not in ("ok", "ready", "stopped")
                            continue
                    except (EOFError, OSError):
                        eof.add(rank)
                if not self.procs[rank].is_alive():
                    self.procs[rank].join(0.1)
                    dead[rank] = self.procs[rank].exitcode
                    failed = True
            if failed:
                give_up = min(give_up, time.monotonic() + grace)
        pending = [r for r in range(n) if r not in replies and r not in dead]
        return replies, dead, pending

    def _receive(self, rank):
        data = self.conns[rank].recv_bytes()
        try:
            return pickle.loads(data)
        except Exception:
            return ("error", f"the test process could not unpickle rank {rank}'s reply:\n"
                             + traceback.format_exc())

    def _stacks(self, ranks):
        """Python stacks of ``ranks`` (still running), via faulthandler on SIGUSR1."""
        signalled = []
        for rank in ranks:
            proc = self.procs[rank]
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                    signalled.append(rank)
                except OSError:
                    pass
        if not signalled:
            return {}
        time.sleep(0.5)
        stacks = {}
        for rank in signalled:
            try:
                with open(self.stack_paths[rank]) as f:
                    stacks[rank] = f.read().strip()
            except OSError:
                pass
        return stacks

    def _failure_message(self, label, replies, dead, pending, timeout, ok_tag):
        stacks = self._stacks(pending)
        lines = [f"{label} failed on world size {self.world_size}:"]
        failing = sorted([r for r, m in replies.items() if m[0] != ok_tag] + list(dead) + pending)
        lines.append(f"failing rank(s): {failing}")
        for rank in range(self.world_size):
            if rank in replies:
                reply = replies[rank]
                if reply[0] == ok_tag:
                    lines.append(f"--- rank {rank}: ok")
                else:
                    lines.append(f"--- rank {rank}: raised\n{reply[1].rstrip()}")
            elif rank in dead:
                lines.append(f"--- rank {rank}: died ({describe_exit(dead[rank])}) without "
                             f"answering")
            else:
                why = (f"timed out: no answer within {timeout:g} s" if not (dead or any(
                    m[0] != ok_tag for m in replies.values()))
                    else "did not finish (probably blocked in a collective with a failed rank)")
                lines.append(f"--- rank {rank}: {why}; killed")
                if stacks.get(rank):
                    lines.append(f"    its Python stacks when killed:\n{stacks[rank]}")
        return "\n".join(lines)


# =============================================================================== public API
_registry = PoolRegistry(lambda world_size: _Pool(world_size))


def run_dist(world_size, fn, *args, timeout=120, **kwargs):
    """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank of the persistent pool for
    ``world_size``; return the list of per-rank return values (index = rank).

    ``fn`` must be a module-level function of an importable module (it is pickled by
    reference); ``args``/``kwargs``/return values must be picklable. Each rank calls
    ``torch.manual_seed(1234)`` first. Raises :class:`DistTestFailure` if any rank raises, dies,
    or has not answered after ``timeout`` seconds; the pool is then replaced.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    qualname = getattr(fn, "__qualname__", "")
    if not callable(fn) or "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"run_dist needs a module-level function (pickled by reference), got "
                        f"{fn!r}; define it at the top level of the test module")
    payload = pickle.dumps(("run", fn, args, kwargs))  # unpicklable arguments fail here
    label = f"run_dist({world_size}, {_fn_name(fn)})"
    return _registry.run(world_size, payload, timeout, label)


def pool_pids(world_size):
    """Process ids of the live pool for ``world_size`` (empty if there is none)."""
    return _registry.pids(world_size)


def kill_pool(world_size):
    """Kill the pool for ``world_size`` now (the next run_dist spawns a fresh one)."""
    _registry.kill(world_size)


def shutdown_pools():
    """Stop every pool gracefully (destroy_process_group on each rank), killing leftovers."""
    _registry.shutdown()


atexit.register(shutdown_pools)
