"""Starting the benchmark's local ranks, per platform.

* torch / npu: under torchrun (``RANK`` and ``WORLD_SIZE`` set) this process is a rank; otherwise it
  spawns ``--nproc`` ranks with ``torch.multiprocessing`` on one host (gloo on CPU).
* mindspore: MindSpore's cluster is a scheduler process plus worker processes, each told its role
  by the environment (``MS_ROLE``, ``MS_NODE_ID``, ``MS_WORKER_NUM``, ``MS_SCHED_HOST/PORT``). Under
  msrun (``MS_ROLE`` set) this process plays that role; otherwise it starts the scheduler and
  ``--nproc`` workers as subprocesses of this interpreter and supervises them: when one fails the
  others -- likely blocked in a collective with it -- are stopped, so a failure never hangs.

Children forward their output through the launcher, minus MindSpore's own log chatter.
"""
import os
import re
import selectors
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAUNCHER_PID = "HP_BENCH_LAUNCHER_PID"
# the variables that place a MindSpore process in a cluster: a child gets fresh ones
_MS_CLUSTER_ENV = ("MS_ROLE", "MS_NODE_ID", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT",
                   "MS_SERVER_NUM", "RANK_TABLE_FILE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                   "MASTER_PORT")
# MindSpore's log lines ("[WARNING] ME(pid:tid,...):time [file] message", C++ "[INFO] DISTRIBUTED(...)"),
# and one ERROR its runtime logs on CPU for every barrier (it asks CPU for device memory statistics)
_MS_CHATTER = re.compile(r"^\[(DEBUG|INFO|WARNING)\] [A-Z_]+\(|^\[ERROR\] ME\(.*CPU device is not supported")
STOP_GRACE_S = 5.0
SCHEDULER_EXIT_S = 15.0


def platform_name():
    """The platform hyper_parallel will pick (HP_PLATFORM, else torch if installed, else mindspore),
    without importing a framework."""
    from hyper_parallel.platform.selection import _default_name, _requested_name
    return _requested_name() or _default_name()


def role(platform):
    """'launcher' (start the local ranks here), 'rank', or 'scheduler' (MindSpore)."""
    if platform == "mindspore":
        ms_role = os.environ.get("MS_ROLE")
        if ms_role == "MS_SCHED":
            return "scheduler"
        return "rank" if ms_role or "RANK_TABLE_FILE" in os.environ else "launcher"
    return "rank" if "RANK" in os.environ and "WORLD_SIZE" in os.environ else "launcher"


def start_ranks(platform, args, argv):
    """Run the benchmark on ``args.nproc`` local ranks; the exit status of the whole run."""
    if platform == "mindspore":
        return _start_mindspore(argv, args.nproc)
    return _spawn_torch(args)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ torch
def run_or_spawn(run_rank, args):
    """A single-file torch benchmark's main: ``run_rank(args)`` here under torchrun, else on
    ``args.nproc`` spawned local ranks (``run_rank`` must be module-level: it is pickled)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        run_rank(args)
        return 0
    import torch.multiprocessing as mp
    mp.spawn(_spawned, args=(run_rank, args, free_port()), nprocs=args.nproc, join=True)
    return 0


def _spawned(rank, run_rank, args, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_rank(args)


def _spawn_torch(args):
    import torch.multiprocessing as mp
    port = free_port()
    from benchmarks.rss_peak import MMAP_THRESHOLD
    # freed buffers must leave RSS for the peak-memory column (benchmarks/rss_peak.py)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD)
    print(f"spawning {args.nproc} local ranks (no launcher environment found)", file=sys.stderr, flush=True)
    context = mp.start_processes(_torch_rank, args=(args, port), nprocs=args.nproc, join=False,
                                 start_method="spawn")
    try:
        while not context.join():
            pass
    except Exception as exc:  # a rank failed or exited non-zero
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    return 0


def _torch_rank(rank, args, port):
    from benchmarks.cp_attention import rank_main
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    code = rank_main(args)
    if code:
        sys.exit(code)


# -------------------------------------------------------------------------------------- mindspore
def run_scheduler():
    """The MindSpore scheduler role: serve the cluster until every worker has finished."""
    from mindspore.communication import init
    init()  # blocks while the workers run (MindSpore may end the process itself once they finalise)
    return 0


def as_child(role_main):
    """Run ``role_main()`` (a scheduler or a rank). In a child of our own launcher, exit with the
    launcher, and on failure leave at once: MindSpore's exit hooks would wait seconds for peers
    that the launcher is about to stop anyway."""
    launcher = int(os.environ.get(_LAUNCHER_PID, "0"))
    if not launcher:  # msrun, torchrun, or by hand: an ordinary process
        return role_main()
    _exit_with(launcher)
    try:
        code = role_main()
    except BaseException:  # noqa: BLE001 -- reported here, the launcher stops the others
        traceback.print_exc()
        code = 1
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _exit_with(launcher):
    """Exit when the launcher dies, so no rank is left blocked forever in a collective (e.g. after
    the launcher is killed by a timeout)."""
    def watch():
        while os.getppid() == launcher:
            time.sleep(0.5)
        os._exit(70)
    threading.Thread(target=watch, daemon=True, name="hp-bench-launcher-watch").start()


def _mindspore_env(nproc):
    env = {k: v for k, v in os.environ.items() if k not in _MS_CLUSTER_ENV}
    env.setdefault("GLOG_v", "3")  # MindSpore's C++ logs: errors only
    pythonpath = env.get("PYTHONPATH")
    env.update({"HP_PLATFORM": "mindspore", "MS_WORKER_NUM": str(nproc), "MS_SCHED_HOST": "127.0.0.1",
                "MS_SCHED_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": ROOT + (os.pathsep + pythonpath if pythonpath else ""),
                _LAUNCHER_PID: str(os.getpid())})
    return env


def _start_mindspore(argv, nproc):
    print(f"starting a MindSpore scheduler and {nproc} worker ranks (no MS_ROLE in the environment)",
          file=sys.stderr, flush=True)
    env = _mindspore_env(nproc)
    # import the module rather than run it as __main__: one copy of it per process, the one that
    # launchers, tests and patches see
    command = [sys.executable, "-c", "import sys; from benchmarks.cp_attention import main; sys.exit(main())",
               *argv]
    shown = set()  # the same error from several ranks is printed once
    children = [_Child("scheduler", command, {**env, "MS_ROLE": "MS_SCHED"}, shown)]
    try:
        for r in range(nproc):
            worker_env = {**env, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(r)}
            children.append(_Child(f"rank {r}", command, worker_env, shown))
        return _supervise(children[0], children[1:])
    except KeyboardInterrupt:
        _say("interrupted: stopping the scheduler and the ranks")
        return 130
    finally:
        _stop(children)


def _supervise(scheduler, workers):
    """Poll until every worker has exited 0, or one worker (or the scheduler) fails."""
    while True:
        for child in workers:
            code = child.popen.poll()
            if code not in (None, 0):
                _say(f"benchmark failed: {child.name} {_describe(code)}; "
                     "stopping the scheduler and the other ranks")
                return code if code > 0 else 1
        if all(child.popen.poll() == 0 for child in workers):
            try:  # it leaves by itself once the workers have finalised
                scheduler.popen.wait(SCHEDULER_EXIT_S)
            except subprocess.TimeoutExpired:
                pass
            return 0
        code = scheduler.popen.poll()
        if code not in (None, 0):
            _say(f"benchmark failed: the MindSpore scheduler {_describe(code)}; stopping the ranks")
            sys.stderr.writelines(scheduler.tail)
            return 1
        time.sleep(0.2)


def _stop(children):
    """Terminate the children still running (then kill those that ignore it); wait for their output."""
    running = [c for c in children if c.popen.poll() is None]
    for child in running:
        child.popen.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for child in running:
        try:
            child.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.popen.kill()
            child.popen.wait()
    for child in children:
        child.join_output()


def _describe(code):
    return f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"


def _say(message):
    print(message, file=sys.stderr, flush=True)


class _Child:
    """One MindSpore process; a thread forwards its stdout and stderr (filtered) line by line, in the
    order the process wrote them (one reader for both pipes keeps progress lines before the table)."""

    def __init__(self, name, command, env, shown):
        self.name = name
        self.tail = deque(maxlen=30)  # unfiltered, for a scheduler that dies
        self._shown = shown
        self.popen = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
        self._pump = threading.Thread(target=self._forward_all, daemon=True, name=f"hp-bench-{name}")
        self._pump.start()

    def _forward_all(self):
        sinks = {self.popen.stdout: sys.stdout, self.popen.stderr: sys.stderr}
        partial = {stream: b"" for stream in sinks}
        with selectors.DefaultSelector() as selector:
            for stream in sinks:
                selector.register(stream, selectors.EVENT_READ)
            while selector.get_map():
                for key, _ in selector.select():
                    stream = key.fileobj
                    data = os.read(stream.fileno(), 65536)
                    if not data:  # the process closed it (exited)
                        selector.unregister(stream)
                        data = b"\n" if partial[stream] else b""
                    *lines, partial[stream] = (partial[stream] + data).split(b"\n")
                    for line in lines:
                        self._forward(line.decode(errors="replace") + "\n", sinks[stream])

    def _forward(self, line, sink):
        self.tail.append(line)
        if _MS_CHATTER.match(line):
            return
        if line.startswith("error: "):
            if line in self._shown:
                return
            self._shown.add(line)
        sink.write(line)
        sink.flush()

    def join_output(self):
        self._pump.join(STOP_GRACE_S)
