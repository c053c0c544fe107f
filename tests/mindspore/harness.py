"""Persistent pools of MindSpore worker processes, driven from pytest in the torch environment.

MindSpore and PyTorch do not have to share an environment: the workers run under a separate
interpreter that has ``mindspore`` (and ``numpy<2``), given by ``HP_MINDSPORE_PYTHON`` (default:
``<repo>/.venv-ms/bin/python`` when it exists; ``.ci/mindspore_env.sh`` creates it). Without one,
the MindSpore tests skip with the reason -- or fail, with ``HP_REQUIRE_MINDSPORE=1`` (CI).

One pool per world size: a MindSpore scheduler (``MS_ROLE=MS_SCHED``) and ``world_size`` workers
(``MS_ROLE=MS_WORKER``), started on the first ``run_ms`` for that size (import + ``init()`` takes
10-60 s on a small machine) and reused for the rest of the session. Each worker initialises
communication through ``hyper_parallel``'s MindSpore platform and then runs the cases sent to it:
``fn(rank, world_size, *args, **kwargs)``, where ``fn`` is a module-level function of a module the
worker can import without torch or pytest (``tests/cases/*.py``, ``tests/mindspore/cases_*.py``).

Arguments and results cross between numpy 2 (pytest) and numpy 1 (workers), so they must be plain
Python values (numbers, strings, lists, tuples, dicts); a worker converts MindSpore tensors and
numpy arrays in a result to nested lists.

A case fails with :class:`MsDistFailure` (an ``AssertionError``) when a rank raises, dies, or does
not answer within the case's timeout; the message has each failing rank's traceback (or, for a
stuck rank, its Python stacks; for a dead one, the tail of its log). The pool is then killed -- the
scheduler and every worker, by process id -- and the next ``run_ms`` starts a fresh one. Workers
and the scheduler also exit on their own when the pytest process dies.
"""
import atexit
import multiprocessing.connection as mpc
import os
import pickle
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from tests.harness.processes import describe_exit, free_port
from tests.harness.registry import PoolRegistry

__all__ = ["run_ms", "MsDistFailure", "mindspore_python", "mindspore_unavailable_reason",
           "require_mindspore", "ms_pool_pids", "kill_ms_pool", "shutdown_ms_pools"]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT_S = float(os.environ.get("HP_MS_TEST_START_TIMEOUT", "420"))
GRACE_AFTER_FAILURE_S = 3.0
STOP_TIMEOUT_S = 20.0
PROTOCOL = 4


class MsDistFailure(AssertionError):
    """A MindSpore distributed case failed: a rank raised, died, or timed out."""


# =============================================================================== interpreter
_probe = {}


def mindspore_python():
    """The interpreter for MindSpore workers, or None."""
    path = os.environ.get("HP_MINDSPORE_PYTHON")
    if path:
        return path
    default = os.path.join(REPO, ".venv-ms", "bin", "python")
    return default if os.path.exists(default) else None


def mindspore_unavailable_reason():
    """None if MindSpore workers can run here, else why not (cached)."""
    python = mindspore_python()
    if python is None:
        return ("no MindSpore interpreter: set HP_MINDSPORE_PYTHON to a python with mindspore and "
                "numpy<2 installed (`bash .ci/mindspore_env.sh` creates .venv-ms)")
    if python not in _probe:
        try:
            done = subprocess.run(
                [python, "-c", "import numpy, mindspore; print(mindspore.__version__, numpy.__version__)"],
                capture_output=True, text=True, timeout=300, env=_clean_env({}))
            if done.returncode != 0:
                _probe[python] = (f"HP_MINDSPORE_PYTHON={python} cannot import mindspore: "
                                  f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
            else:
                versions = done.stdout.strip().split()
                numpy_major = int(versions[-1].split(".")[0]) if versions else 0
                _probe[python] = None if numpy_major < 2 else (
                    f"{python} has numpy {versions[-1]}; MindSpore's communication needs numpy<2")
        except (OSError, subprocess.TimeoutExpired) as exc:
            _probe[python] = f"HP_MINDSPORE_PYTHON={python} does not run: {exc}"
    return _probe[python]


def require_mindspore():
    """Skip the calling test (or fail it, under HP_REQUIRE_MINDSPORE=1) without MindSpore."""
    import pytest
    reason = mindspore_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("HP_REQUIRE_MINDSPORE", "").strip().lower() in ("1", "true", "yes", "on"):
        pytest.fail(f"HP_REQUIRE_MINDSPORE=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _clean_env(extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MS_", "HP_MS_", "RANK", "WORLD_SIZE", "MASTER_", "LOCAL_RANK"))
           and k not in ("PYTHONHOME", "VIRTUAL_ENV")}
    env.update({"PYTHONPATH": REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
                "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOG_v": "3",
                "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"})
    env.update(extra)
    return env


def _tail(path, lines=25):
    try:
        with open(path, errors="replace") as f:
            text = f.read().splitlines()
    except OSError:
        return ""
    text = [t for t in text if t.strip() and "[WARNING]" not in t]
    return "\n".join(text[-lines:])


# =============================================================================== the pool
class _Pool:
    def __init__(self, world_size):
        self.world_size = world_size
        self.procs = {}          # rank -> Popen; "sched" -> Popen
        self.conns = {}
        self.logs = {}
        self.tmpdir = None
        self.listener = None
        self.closed = False

    def start(self):
        for attempt in range(3):
            failure = self._start_once()
            if failure is None:
                return
            self.kill()
            port_clash = "address already in use" in failure.lower() or "bind" in failure.lower()
            if not port_clash or attempt == 2:
                raise MsDistFailure(failure)
            self.closed = False

    def _start_once(self):
        python = mindspore_python()
        self.tmpdir = tempfile.mkdtemp(prefix=f"hp_ms_pool{self.world_size}_")
        authkey = secrets.token_bytes(16)
        self.listener = mpc.Listener(("127.0.0.1", 0), authkey=authkey)
        control = "%s:%d" % self.listener.address
        sched_port = free_port()
        common = {"HP_PLATFORM": "mindspore", "HP_MS_CONTROL": control, "HP_MS_AUTHKEY": authkey.hex(),
                  "HP_MS_PARENT_PID": str(os.getpid()), "MS_WORKER_NUM": str(self.world_size),
                  "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": str(sched_port)}
        roles = [("sched", {"MS_ROLE": "MS_SCHED"})] + \
                [(r, {"MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(r), "HP_MS_RANK": str(r)})
                 for r in range(self.world_size)]
        for key, extra in roles:
            log = os.path.join(self.tmpdir, f"{key if key == 'sched' else 'rank%d' % key}.log")
            self.logs[key] = log
            env = _clean_env({**common, **extra,
                              "HP_MS_STACKS": os.path.join(self.tmpdir, f"{key}.stacks")})
            with open(log, "wb") as out:
                self.procs[key] = subprocess.Popen(
                    [python, "-m", "tests.mindspore.worker"], cwd=REPO, env=env, stdout=out,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        # accept one control connection per worker (the scheduler has none)
        deadline = time.monotonic() + START_TIMEOUT_S
        accepted = {}
        acceptor = threading.Thread(target=self._accept_all, args=(accepted,), daemon=True)
        acceptor.start()
        while acceptor.is_alive() and time.monotonic() < deadline:
            dead = {k: p.poll() for k, p in self.procs.items() if p.poll() is not None}
            if dead:
                break
            acceptor.join(0.5)
        self.conns = dict(accepted)
        replies, dead, pending = self._collect(deadline, ranks=list(range(self.world_size)),
                                               expect=("ready",))
        if not dead and not pending and all(m[0] == "ready" for m in replies.values()):
            return None
        return self._failure_message(f"starting the MindSpore world-size-{self.world_size} pool",
                                     replies, dead, pending, START_TIMEOUT_S, ok_tag="ready")

    def _accept_all(self, accepted):
        while len(accepted) < self.world_size:
            try:
                conn = self.listener.accept()
                hello = conn.recv()
            except (OSError, EOFError, mpc.AuthenticationError):
                if self.closed:
                    return
                continue
            accepted[int(hello[1])] = conn

    def healthy(self):
        return not self.closed and all(p.poll() is None for p in self.procs.values())

    def pids(self):
        return [p.pid for p in self.procs.values()]

    def kill(self):
        """SIGTERM, then SIGKILL, each child by its own process id (and its session). Idempotent."""
        self.closed = True
        for proc in self.procs.values():
            if proc.poll() is None:
                _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        for proc in self.procs.values():
            try:
                proc.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():
            if proc.poll() is None:
                _signal(proc, signal.SIGKILL)
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
        for conn in self.conns.values():
            try:
                conn.close()
            except OSError:
                pass
        if self.listener is not None:
            try:
                self.listener.close()
            except OSError:
                pass
            self.listener = None
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    def stop(self):
        if self.closed:
            return
        if self.healthy():
            for conn in self.conns.values():
                try:
                    conn.send_bytes(pickle.dumps(("stop",), protocol=PROTOCOL))
                except (OSError, EOFError):
                    pass
            self._collect(time.monotonic() + STOP_TIMEOUT_S, ranks=list(self.conns), expect=("stopped",),
                          grace=STOP_TIMEOUT_S)
        self.kill()

    # ------------------------------------------------------------------ cases
    def run(self, payload, timeout, label):
        for rank in range(self.world_size):
            self.conns[rank].send_bytes(payload)
        replies, dead, pending = self._collect(time.monotonic() + timeout, ranks=list(range(self.world_size)),
                                               expect=("ok",))
        if not dead and not pending and all(r[0] == "ok" for r in replies.values()):
            return [replies[rank][1] for rank in range(self.world_size)]
        message = self._failure_message(label, replies, dead, pending, timeout, ok_tag="ok")
        self.kill()
        raise MsDistFailure(message)

    def _collect(self, deadline, ranks, expect, grace=GRACE_AFTER_FAILURE_S):
        replies, dead, eof = {}, {}, set()
        give_up = deadline
        sched = self.procs.get("sched")
        while True:
            waiting = [r for r in ranks if r not in replies and r not in dead]
            now = time.monotonic()
            if not waiting or now >= give_up:
                break
            conns = [self.conns[r] for r in waiting if r in self.conns and r not in eof]
            if conns:
                mpc.wait(conns, timeout=min(0.5, give_up - now))
            else:
                time.sleep(min(0.5, max(0.0, give_up - now)))
            failed = False
            for rank in waiting:
                conn = self.conns.get(rank)
                if conn is not None and rank not in eof:
                    try:
                        if conn.poll():
                            replies[rank] = _loads(conn.recv_bytes(), rank)
                            failed |= replies[rank][0] not in expect
                            continue
                    except (EOFError, OSError):
                        eof.add(rank)
                proc = self.procs[rank]
                if proc.poll() is not None:
                    dead[rank] = proc.returncode
                    failed = True
            if sched is not None and sched.poll() is not None and "stopped" not in expect and \
                    not failed and waiting:
                # the scheduler died: the workers cannot communicate any more
                failed = True
                dead.setdefault("sched", sched.returncode)
            if failed:
                give_up = min(give_up, time.monotonic() + grace)
        pending = [r for r in ranks if r not in replies and r not in dead]
        return replies, dead, pending

    def _stacks(self, ranks):
        signalled = []
        for rank in ranks:
            proc = self.procs.get(rank)
            if proc is not None and proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                    signalled.append(rank)
                except OSError:
                    pass
        if not signalled:
            return {}
        time.sleep(1.0)
        stacks = {}
        for rank in signalled:
            try:
                with open(os.path.join(self.tmpdir, f"{rank}.stacks")) as f:
                    stacks[rank] = f.read().strip()
            except OSError:
                pass
        return stacks

    def _failure_message(self, label, replies, dead, pending, timeout, ok_tag):
        stacks = self._stacks(pending)
        lines = [f"{label} failed on world size {self.world_size}:"]
        failing = sorted([r for r, m in replies.items() if m[0] != ok_tag] +
                         [r for r in dead if r != "sched"] + list(pending))
        lines.append(f"failing rank(s): {failing}")
        if "sched" in dead:
            lines.append(f"--- scheduler: died ({describe_exit(dead['sched'])})\n"
                         f"{_tail(self.logs['sched'])}")
        for rank in range(self.world_size):
            if rank in replies:
                reply = replies[rank]
                if reply[0] == ok_tag:
                    lines.append(f"--- rank {rank}: ok")
                else:
                    lines.append(f"--- rank {rank}: raised\n{str(reply[1]).rstrip()}")
            elif rank in dead:
                lines.append(f"--- rank {rank}: died ({describe_exit(dead[rank])}) without answering; "
                             f"the end of its log:\n{_tail(self.logs.get(rank, ''))}")
            else:
                others_failed = bool(dead) or any(m[0] != ok_tag for m in replies.values())
                why = ("did not finish (probably blocked in a collective with a failed rank)"
                       if others_failed else f"timed out: no answer within {timeout:g} s")
                lines.append(f"--- rank {rank}: {why}; killed")
                if stacks.get(rank):
                    lines.append(f"    its Python stacks when killed:\n{stacks[rank]}")
                elif rank not in self.conns:
                    lines.append(f"    it never connected; the end of its log:\n"
                                 f"{_tail(self.logs.get(rank, ''))}")
        return "\n".join(lines)


def _signal(proc, sig):
    try:
        os.killpg(proc.pid, sig)   # the child leads its own session (start_new_session=True)
    except OSError:
        try:
            proc.send_signal(sig)
        except OSError:
            pass


def _loads(data, rank):
    try:
        return pickle.loads(data)
    except Exception as exc:  # noqa: BLE001
        return ("error", f"the test process could not unpickle rank {rank}'s reply: {exc!r}")


# =============================================================================== public API
_registry = PoolRegistry(lambda world_size: _Pool(world_size))


def run_ms(world_size, fn, *args, timeout=180, **kwargs):
    """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank of the MindSpore pool for
    ``world_size``; return the per-rank results (index = rank). See the module docstring."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", "")
    if not callable(fn) or "<locals>" in qualname or "<lambda>" in qualname or not module:
        raise TypeError(f"run_ms needs a module-level function, got {fn!r}")
    reason = mindspore_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    payload = pickle.dumps(("run", module, qualname, args, kwargs), protocol=PROTOCOL)
    label = f"run_ms({world_size}, {module}.{qualname})"
    return _registry.run(world_size, payload, timeout, label)


def ms_pool_pids(world_size):
    """Process ids (scheduler and workers) of the live pool for ``world_size``."""
    return _registry.pids(world_size)


def kill_ms_pool(world_size):
    _registry.kill(world_size)


def shutdown_ms_pools():
    _registry.shutdown()


atexit.register(shutdown_ms_pools)
if __name__ == "__main__":  # pragma: no cover
    sys.exit("import tests.mindspore.harness and call run_ms()")
