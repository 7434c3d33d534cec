"""One probe run: its command line and launcher, its process under a timeout (`ProbeRun`), and what its
stderr says when it fails (the last error line, a rendezvous failure, the hung ranks' stacks)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time


from .guard import kill_tree, probe_processes, remove_dir
from .results import deferred_signals

PROBE_MODULE = "distplan.validate.probe"
PP_PROBE_MODULE = "distplan.validate.pp_probe"
"""Pipeline-parallel specs (`"pp"` > 1) run this probe: one process per stage (x dp), gloo."""
GUARD_MODULE = "distplan.validate.guard"
PROBE_DIR_ENV = "DISTPLAN_PROBE_DIR"
"""Set for a probe's processes: its temp folder (the probe's workers watch for their launcher's end)."""
DEFAULT_TIMEOUT_S = 300.0
STACKS_AT_ENV = "DISTPLAN_STACKS_AT"
"""The time (`time.time()`) at which a CPU probe's worker that is still running prints every thread's Python
stack to its stderr (`faulthandler.dump_traceback_later`, validate/launch.py's `_worker`) and goes on: a
probe that hangs ends, at the runner's timeout, with where each rank waited in its record's `hung_stacks`
(`hung_stacks` below)."""


def stacks_after_s(timeout_s: float) -> float:
    """How long after its launch a probe's workers print their stacks (`STACKS_AT_ENV`): shortly before
    the runner's timeout (20 s, or a tenth of a shorter one)."""
    return timeout_s - min(20.0, timeout_s / 10)


KILL_GRACE_S = 3.0
DEFAULT_CPU_RANKS = 2
MODES = ("cpu", "gpu", "fake")


def probe_base_env() -> dict:
    """Every probe's environment before its own variables (`ProbeRun`): one thread per process unless
    told, as torchrun sets it, and unbuffered output."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def warm_startable(spec: dict, nnodes: int = 1) -> bool:
    """A probe the warm process (validate/warm.py) can start, not on a GPU (the caller also checks that
    this machine shows the probe none: `gpu_free_hardware`): one process on the fake process group, or a
    one-node gloo probe, whose launcher (validate/launch.py: torchrun, its workers forks of it) is then
    itself a fork of the warm process."""
    if spec.get("device_type", "cpu") != "cpu":
        return False
    if spec.get("mode") == "fake":
        return int(spec.get("pp", 1)) == 1
    return spec.get("mode") == "cpu" and nnodes == 1


# -- one probe ------------------------------------------------------------------------------------

def probe_argv(spec: dict, spec_path: str, out_path: str, probe_cmd: list[str] | None = None,
               nnodes: int = 1, rdzv_endpoint: str | None = None) -> list[str]:
    """The command line that runs `spec`. `probe_cmd` (argv prefix) replaces the whole launcher."""
    tail = ["--spec", spec_path, "--out", out_path]
    if probe_cmd:
        return list(probe_cmd) + tail
    mode = spec.get("mode", "cpu")
    module = PP_PROBE_MODULE if int(spec.get("pp", 1)) > 1 else PROBE_MODULE  # pipeline stages: their own probe
    if mode == "fake":
        return [sys.executable, "-m", module] + tail
    world = int(spec["world_size"])
    if nnodes > 1:
        if world % nnodes:
            raise ValueError(f"world_size={world} is not a multiple of --nnodes={nnodes}")
        if not rdzv_endpoint:
            raise ValueError(f"--nnodes={nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")
        rdzv = ["--nnodes", str(nnodes), "--rdzv-endpoint", rdzv_endpoint, "--rdzv-backend", "c10d",
                "--rdzv-id", "distplan-" + str(abs(hash(spec.get("id"))) % 10**8)]
        per_node = world // nnodes
    else:
        rdzv = local_rendezvous()
        per_node = world
    return ([sys.executable, "-m", launcher(mode, nnodes), *rdzv, f"--nproc-per-node={per_node}",
             "-m", module] + tail)


LAUNCH_MODULE = "distplan.validate.launch"


def launcher(mode: str, nnodes: int = 1) -> str:
    """The module that launches a torchrun probe: on the CPU on one node `validate/launch.py` (torchrun
    itself, its workers forked from a process that has imported torch and the probe: ~5 s of imports
    saved per worker); on GPUs and across nodes torchrun as users run it."""
    return LAUNCH_MODULE if mode == "cpu" and nnodes == 1 else "torch.distributed.run"


LOOPBACK = "127.0.0.1"
RDZV_READ_TIMEOUT_S = 20
"""Seconds a single-node rendezvous store operation may take before torchrun gives up (default 60)."""
RDZV_JOIN_TIMEOUT_S = 60
"""Seconds torchrun's single-node rendezvous may take (default 600)."""


def local_rendezvous() -> list[str]:
    """torchrun options for a one-node run that never leaves this machine: the c10d rendezvous store on
    127.0.0.1 (a free port, chosen by the store), this node's address 127.0.0.1 (so the workers'
    MASTER_ADDR is not this host's name, which needs a working resolver), shortened timeouts. Works
    with no network at all as long as the loopback interface is up (`check_loopback`)."""
    return ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={LOOPBACK}:0",
            f"--rdzv-id=distplan-{os.getpid()}-{time.monotonic_ns() % 10**9}",
            f"--rdzv-conf=is_host=1,read_timeout={RDZV_READ_TIMEOUT_S},join_timeout={RDZV_JOIN_TIMEOUT_S}",
            f"--local-addr={LOOPBACK}"]


def check_loopback(timeout_s: float = 2.0) -> str | None:
    """None when a TCP connection to 127.0.0.1 works here (what a one-node torchrun probe needs), else
    the one-line reason. Takes milliseconds."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
            srv.bind((LOOPBACK, 0))
            srv.listen(1)
            port = srv.getsockname()[1]
            with socket.create_connection((LOOPBACK, port), timeout=timeout_s):
                pass
    except OSError as e:
        why = e.strerror or str(e)
        return (f"rendezvous on {LOOPBACK} impossible: {why} (is the loopback interface down? "
                f"torchrun probes need it; --simulate-world-size N runs without it)")
    return None


_ERROR_RE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b")


_CAUSE = "The above exception was the direct cause of the following exception"


def _last_error_line(text: str) -> str:
    """The most telling line of a crashed run's stderr: the last `SomeError: ...` (not torchrun's
    ChildFailedError summary), else the last non-rule line. When that error was raised from another
    (`raise ... from e`, as torch.distributed.pipelining wraps a stage's backward), the root error's line
    follows it after "caused by"."""
    lines = [re.sub(r"^\[(?:default)?rank\d+\]:\s*", "", ln.strip()) for ln in (text or "").splitlines()]
    lines = [ln for ln in lines if ln and not set(ln) <= set("=-*#_ ")]
    for i in range(len(lines) - 1, -1, -1):
        ln = lines[i]
        if _ERROR_RE.match(ln) and "ChildFailedError" not in ln:
            if ln.endswith(":") and i + 1 < len(lines):  # pipelining's message starts on the next line
                ln = f"{ln} {lines[i + 1]}"
            causes = [j for j in range(i) if lines[j].startswith(_CAUSE)]
            if causes:
                root = next((c for c in reversed(lines[:causes[0]]) if _ERROR_RE.match(c)), None)
                if root and root != ln:
                    return f"{ln[:300]} caused by {root[:300]}"
            return ln[:500]
    return lines[-1][:500] if lines else ""


STDERR_TAIL_CHARS = 6000
"""How much of a failed probe's stderr its record keeps: enough for a chained traceback from one rank."""

_LIVE: set = set()
"""ProbeRuns started by this process and not yet finished: `abandon_all()` (atexit, SIGTERM) ends them."""


class Terminated(BaseException):
    """Raised in the main thread by the SIGTERM/SIGHUP handler of `handle_termination()`."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def abandon_all() -> None:
    """Kill every live probe of this process and remove its temp folder (atexit; after SIGTERM)."""
    for run in list(_LIVE):
        try:
            run.abandon()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


_ATEXIT = []


def handle_termination():
    """Until the returned `restore()` is called, SIGTERM and SIGHUP raise `Terminated` in the main
    thread (so the session's cleanup runs: probes killed, temp folders removed, records kept); live
    probes are abandoned at exit in any case. A SIGKILL cannot be caught: each probe's guard
    (validate/guard.py) cleans up after it."""
    import atexit
    import threading

    if not _ATEXIT:
        atexit.register(abandon_all)
        _ATEXIT.append(True)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        def raise_terminated(signum, frame):
            raise Terminated(signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                previous[sig] = signal.signal(sig, raise_terminated)
            except (ValueError, OSError):
                pass

    def restore():
        for sig, h in previous.items():
            try:
                signal.signal(sig, h)
            except (ValueError, OSError):
                pass
    return restore


class ProbeRun:
    """One launched probe. `poll()` returns its measurement dict once it has ended, else None.

    The probe runs under a guard (`python -m distplan.validate.guard`, in a new session) that kills it
    when this process dies, even by SIGKILL, and then removes its temp folder; the probe's processes get
    TMPDIR inside that folder (torchelastic's `torchelastic_*` folder goes with it) and the folder's
    path on their command lines (`--spec`), by which `kill()` finds torchrun workers that left the
    session."""

    def __init__(self, spec: dict, probe_cmd: list[str] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 nnodes: int = 1, rdzv_endpoint: str | None = None, env: dict | None = None,
                 warm=None):

        self.spec = spec
        self.timeout_s = timeout_s
        self.nnodes = nnodes
        self.result: dict | None = None
        self.proc = None
        self.warm_started = False
        self.dir = tempfile.mkdtemp(prefix="distplan-probe-")
        try:
            self.spec_path = os.path.join(self.dir, "spec.json")
            self.out_path = os.path.join(self.dir, "result.json")
            with open(self.spec_path, "w") as f:
                json.dump(spec, f)
            self.argv = probe_argv(spec, self.spec_path, self.out_path, probe_cmd, nnodes, rdzv_endpoint)
            tmp = os.path.join(self.dir, "tmp")
            os.mkdir(tmp)
            full_env = probe_base_env()
            full_env["TMPDIR"] = tmp  # torchelastic's torchelastic_* folder, the probe's temp files
            full_env[PROBE_DIR_ENV] = self.dir
            full_env[STACKS_AT_ENV] = f"{time.time() + stacks_after_s(timeout_s):.3f}"
            if spec.get("mode") == "cpu" and nnodes == 1 and os.path.isdir("/sys/class/net/lo"):
                full_env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one node: gloo on the loopback
            full_env.update(env or {})
            conf = (spec.get("train") or {}).get("alloc_conf")
            if conf is not None:  # the caching allocator's configuration the prediction assumed
                full_env["PYTORCH_CUDA_ALLOC_CONF"] = conf
            self._stdout = open(os.path.join(self.dir, "stdout.log"), "wb")
            self._stderr = open(os.path.join(self.dir, "stderr.log"), "wb")
            guard = [sys.executable, "-m", GUARD_MODULE, str(os.getpid()), self.dir, "--"]
            self.t0 = time.monotonic()
            if warm is not None and warm_startable(spec, nnodes) and probe_cmd is None:
                try:  # a fork of the warm process (validate/warm.py), else a new process below
                    self.proc = warm.start([self.dir, "--", *self.argv], full_env, self._stdout.name,
                                           self._stderr.name)
                    self.warm_started = True
                except OSError:
                    self.proc = None
            if self.proc is None:
                self.proc = subprocess.Popen(guard + self.argv, stdin=subprocess.DEVNULL, stdout=self._stdout,
                                             stderr=self._stderr, env=full_env, start_new_session=True)
        except BaseException:
            for f in (getattr(self, "_stdout", None), getattr(self, "_stderr", None)):
                if f is not None:
                    f.close()
            if self.proc is not None:
                self.kill()
            remove_dir(self.dir)
            raise
        self.pgid = self.proc.pid  # a new session's leader: its pid is the group id
        _LIVE.add(self)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.t0

    def poll(self) -> dict | None:
        if self.result is not None:
            return self.result
        rc = self.proc.poll()
        if rc is None:
            if self.elapsed_s > self.timeout_s:
                self.kill()
                self.result = self._finish(rc=self.proc.returncode, timed_out=True)
                return self.result
            return None
        self.kill()  # reap stragglers (torchrun workers in sessions of their own, probe children)
        self.result = self._finish(rc=rc, timed_out=False)
        return self.result

    def wait(self, interval_s: float = 0.05) -> dict:
        while True:
            res = self.poll()
            if res is not None:
                return res
            time.sleep(interval_s)

    def kill(self) -> None:
        """SIGTERM the guard, its process group, every descendant and every process whose command line
        names this probe's folder; SIGKILL whatever is left after the grace period (validate/guard.py)."""

        if self.proc.poll() is not None and not probe_processes(None, self.dir, self.pgid):
            return
        kill_tree(self.proc.pid, self.dir, self.pgid, KILL_GRACE_S, reap=self._reap)
        self._reap(block=True)

    def abandon(self) -> None:
        """Kill the probe and remove its scratch directory without reading a result (Ctrl-C, SIGTERM).
        Signals that arrive meanwhile (a second Ctrl-C) wait until the folder is gone."""

        with deferred_signals():
            try:
                self.kill()
            finally:
                for f in (self._stdout, self._stderr):
                    f.close()
                remove_dir(self.dir)
                _LIVE.discard(self)

    def _reap(self, block: bool = False) -> None:
        try:
            self.proc.wait(timeout=5.0 if block else 0.0)
        except subprocess.TimeoutExpired:
            pass

    def _finish(self, rc: int | None, timed_out: bool) -> dict:

        wall = self.elapsed_s
        for f in (self._stdout, self._stderr):
            f.close()
        stderr = _read_tail(os.path.join(self.dir, "stderr.log"))
        result = None
        if os.path.exists(self.out_path):
            try:
                with open(self.out_path) as f:
                    result = json.load(f)
            except ValueError:
                result = None
        if (result is None or not isinstance(result, dict)) and rc == 0 and self.nnodes > 1:
            result = {"id": self.spec.get("id"), "status": "remote", "mode": self.spec.get("mode"),
                      "world_size": self.spec.get("world_size"),
                      "error": "rank 0 ran on another node; its record is in that node's results file"}
        if result is None or not isinstance(result, dict):
            status = "timeout" if timed_out else "crashed"
            if timed_out:
                reason = f"no result after {self.timeout_s:g} s; process group killed"
            elif rc == 0:
                reason = "exited 0 without writing a result"
            else:
                reason = _rendezvous_failure(stderr) or _last_error_line(stderr) or f"exit code {rc}"
                if rc is not None and rc < 0:
                    reason = f"killed by signal {-rc}" + (f": {reason}" if reason else "")
            result = {"id": self.spec.get("id"), "status": status, "error": reason,
                      "mode": self.spec.get("mode"), "world_size": self.spec.get("world_size")}
        result.setdefault("status", "error")
        if timed_out:  # where each worker waited (their faulthandler dumps, STACKS_AT_ENV)
            stacks = hung_stacks(_read_tail(os.path.join(self.dir, "stderr.log"), 4 << 20))
            if stacks:
                result["hung_stacks"] = stacks
        result["returncode"] = rc
        if self.warm_started:
            result["warm_start"] = True  # a fork of validate/warm.py's process, not a new interpreter
        result["wall_s"] = round(wall, 3)
        if result["status"] not in ("ok", "remote"):
            result["stderr_tail"] = stderr[-STDERR_TAIL_CHARS:]
        try:
            remove_dir(self.dir)
        finally:
            _LIVE.discard(self)
        return result


_RDZV_HOST = (re.compile(r"failed to connect/validate to host (\S+?) - timed out"),
              re.compile(r"The client socket has failed to connect to any network address of \(([^)]*)\)"))
_RDZV_ERROR = re.compile(r"\b(RendezvousTimeoutError|RendezvousConnectionError|DistNetworkError)\b.*")


def _rendezvous_failure(stderr: str) -> str | None:
    """One line for a probe whose processes never met (torchrun's C++ stack otherwise ends the log)."""
    for pat in _RDZV_HOST:
        m = pat.search(stderr or "")
        if m:
            return f"rendezvous failed: cannot connect to {m.group(1)} (see stderr_tail)"
    m = _RDZV_ERROR.search(stderr or "")
    if m:
        return f"rendezvous failed: {m.group(0)[:200]}"
    return None


_STACKS_HEADER = re.compile(r"^Timeout \(\d+:\d\d:\d\d(?:\.\d+)?\)!$", re.M)


def hung_stacks(stderr: str, frames: int = 8) -> str:
    """The stacks a hung probe's workers printed (`STACKS_AT_ENV`; faulthandler's format: a "Timeout
    (H:MM:SS.ffffff)!" line, then per thread a "Thread 0x... (most recent call first):" line and its frames),
    each thread cut to its innermost `frames` frames: where it waited. "" when there are none."""
    out = []
    for block in _STACKS_HEADER.split(stderr)[1:]:
        lines, kept = block.strip("\n").splitlines(), []
        depth = 0
        for line in lines:
            if line.startswith(("Thread 0x", "Current thread 0x")):
                kept.append(line)
                depth = 0
            elif line.startswith("  File ") and kept:
                depth += 1
                if depth <= frames:
                    kept.append(line)
            elif kept:
                break  # the end of the dump: what the process printed next
        out.append("\n".join(kept))
    return "\n--\n".join(b for b in out if b)


def _read_tail(path: str, nbytes: int = 20000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def run_probe(spec: dict, probe_cmd: list[str] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
              nnodes: int = 1, rdzv_endpoint: str | None = None, env: dict | None = None) -> dict:
    """Run one probe to its end and return its measurement (status ok/oom/error/timeout/crashed).
    Ctrl-C kills the probe's process group and re-raises."""
    run = ProbeRun(spec, probe_cmd, timeout_s, nnodes, rdzv_endpoint, env)
    try:
        return run.wait()
    except BaseException:
        run.abandon()
        raise
