"""Launch probes and run a validation session: predict, probe, compare, append.

Owns the process side of `distplan validate`:

- `detect_hardware()` asks a subprocess what torch sees (GPUs, names, memory, bf16), so the CLI process
  never initialises CUDA (where torch can see no GPU, torch/version.py and the environment answer
  without the 4-second import: `gpu_free_hardware`); `choose_mode()` turns that into where probes run: GPUs -> `gpu` (NCCL, one rank
  per GPU); `--simulate-world-size N` -> `fake` (one process, rank 0 of N on the fake process group);
  no GPU -> `cpu` (gloo, 2 processes).
- `ProbeRun` / `run_probe()` launch one probe under a guard (`python -m distplan.validate.guard`, in a
  session of its own) that kills the probe if distplan dies, even by SIGKILL, and removes its temp
  folder: `python -m torch.distributed.run --nnodes=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:0
  --local-addr=127.0.0.1 --nproc-per-node=W -m distplan.validate.probe --spec S --out R` (gpu: a
  rendezvous that never leaves the machine, so no network is needed; `--nnodes N --rdzv-endpoint E
  --rdzv-backend c10d` across nodes), the same through `python -m distplan.validate.launch` on the CPU
  (torchrun in a process that has imported the probe's modules, its workers forked from it: `launcher`),
  or `python -m distplan.validate.probe ...` (fake). On the CPU, with two or more in a run, a fake probe or
  a one-node gloo probe's launcher is a fork of one warm process that has imported the probe
  (`start_warm`, validate/warm.py). TMPDIR points
  inside the probe's temp folder (torchelastic's `torchelastic_*` goes with it). A timeout, an error,
  Ctrl-C or SIGTERM kill the whole probe: the guard's group, its descendants, and the torchrun workers
  (sessions of their own) found by the temp folder on their command lines (SIGTERM, then SIGKILL after
  a grace period). The probe's own result says ok / oom / error; without a result file the run is
  `crashed` (reason: a failed rendezvous in one line, else the last meaningful stderr line) or `timeout`.
- `run_validation()` runs a list of specs (fake probes several at a time, torchrun probes alone), asks
  the planner for each prediction (`distplan.planner.api.predict_probe`), compares, and appends one record
  per probe to the JSON-lines file the moment it ends. Fake probes on one GPU run side by side only while
  their predicted device needs (`gpu_need_bytes`) fit in 90% of its memory together, so `--jobs` cannot
  turn a probe that fits into a measured OOM; a probe that shared the GPU is marked `shared_gpu` and its
  step time is reported, not judged.

Known limitations: across nodes, only the node that hosts rank 0 gets the result file; the other nodes
record status `remote` (verdict SKIP) when their launcher exits cleanly. No retry of failed probes (use `--resume` after fixing).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from distplan.planner.api import predict_probe
from distplan.planner.config import installed_torch, torch_build, torch_version_file
from distplan.planner.footprint import CUDA_CONTEXT_BYTES

from .compare import DEFAULT_TOLERANCE, compare
from .guard import kill_tree, probe_processes, remove_dir
from .results import ResultsFile, deferred_signals, done, read_records
from .warm import WarmStarter

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


# -- hardware -------------------------------------------------------------------------------------

_HW_SCRIPT = r"""
import json, sys
try:
    import torch
except Exception as e:
    print(json.dumps({"error": f"cannot import torch: {e}"})); sys.exit(0)
out = {"torch_version": torch.__version__, "gpus": 0, "gpu_names": [], "gpu_memory_bytes": [], "bf16": True,
       "cpu_count": __import__("os").cpu_count()}
try:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out["gpus"] = n
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        out["gpu_names"].append(p.name); out["gpu_memory_bytes"].append(int(p.total_memory))
    if n:
        out["bf16"] = bool(torch.cuda.is_bf16_supported())
except Exception as e:
    out["cuda_error"] = str(e)
print(json.dumps(out))
"""

_hw_cache: dict | None = None


def _torch_version_file() -> str | None:

    return torch_version_file()


def _torch_build() -> dict | None:
    """torch/version.py's `__version__`, `cuda` and `hip` (planner.config.torch_build), without importing
    torch (a 4-second import on a small CPU machine); None when torch is not installed or a field is
    missing (then torch is asked)."""

    path = _torch_version_file()
    build = torch_build(path) if path else {}
    return build if all(k in build for k in ("__version__", "cuda", "hip")) else None


def _hidden_devices(var: str) -> bool:
    """True when `var` (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES) hides every device: set and empty, or
    its first entry invalid (the runtime stops at the first invalid entry: "-1" means none)."""
    value = os.environ.get(var)
    return value is not None and (not value.strip() or value.split(",")[0].strip().startswith("-"))


def gpu_free_hardware() -> dict | None:
    """The hardware record without the subprocess, where torch can see no GPU whatever it would do: a CPU
    build of torch (torch/version.py: `cuda` and `hip` None), every device hidden by
    CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES, or a CUDA build on a Linux machine with no NVIDIA driver
    (no /dev/nvidiactl: `torch.cuda.is_available()` is False there). None otherwise (ask torch)."""
    build = _torch_build()
    if build is None:
        return None
    if build["hip"] is not None:
        gpu_free = _hidden_devices("HIP_VISIBLE_DEVICES") or _hidden_devices("CUDA_VISIBLE_DEVICES")
    elif build["cuda"] is not None:
        gpu_free = _hidden_devices("CUDA_VISIBLE_DEVICES") or (
            sys.platform.startswith("linux") and not os.path.exists("/dev/nvidiactl"))
    else:
        gpu_free = True
    if not gpu_free:
        return None
    return {"torch_version": build["__version__"], "gpus": 0, "gpu_names": [], "gpu_memory_bytes": [],
            "bf16": True, "cpu_count": os.cpu_count()}


def detect_hardware(timeout_s: float = 120.0) -> dict:
    """{"torch_version", "gpus", "gpu_names", "gpu_memory_bytes", "bf16", "cpu_count", "ram_bytes"} or
    {"error": ...} when torch cannot be imported. Where no GPU can be seen (`gpu_free_hardware`) from
    torch's files; else torch answers in a subprocess, so this process never initialises CUDA. Cached per
    process."""
    global _hw_cache
    if _hw_cache is not None:
        return dict(_hw_cache)
    hw = gpu_free_hardware()
    if hw is not None:
        hw["ram_bytes"] = available_ram_bytes()
        _hw_cache = hw
        return dict(hw)
    try:
        cp = subprocess.run([sys.executable, "-c", _HW_SCRIPT], capture_output=True, text=True,
                            timeout=timeout_s)
        line = [ln for ln in cp.stdout.splitlines() if ln.startswith("{")]
        hw = json.loads(line[-1]) if line else {"error": _last_error_line(cp.stderr) or "no answer"}
    except (subprocess.TimeoutExpired, OSError) as e:
        hw = {"error": f"hardware probe failed: {e}"}
    hw["ram_bytes"] = available_ram_bytes()
    _hw_cache = hw
    return dict(hw)


def available_ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


DEFAULT_FAKE_WORLD = 8
"""The world a probe simulates on the fake process group when this machine has too few GPUs (or, on
CPU, ranks) for a distributed strategy: one node of 8 GPUs, the usual server."""
MAX_FAKE_WORLD = 4096
"""Largest `--simulate-world-size`: the fake process group's rank 0 holds per-rank state for every rank
in one process (FSDP's all-gather output is world x the shard, DDP/ZeRO size buckets and partitions
by world), so beyond a few thousand ranks the probe measures the bookkeeping, not the strategy; 4096
ranks is 512 nodes of 8 GPUs."""


def choose_mode(hw: dict, simulate_world_size: int | None = None, nproc: int | None = None,
                nnodes: int = 1, explain: bool = False):
    """(mode, world_size) for a run on this machine; see the module docstring. With `explain`, a third
    item: None, or the one line that says why probes run on the fake process group although nobody
    asked (fewer than 2 ranks here: one GPU, or `--nproc 1`; a world of 1 validates no distributed
    strategy, so rank 0 of `DEFAULT_FAKE_WORLD` on the fake process group instead)."""
    note = None
    if simulate_world_size:
        if simulate_world_size > MAX_FAKE_WORLD:
            raise ValueError(f"--simulate-world-size={simulate_world_size}: at most {MAX_FAKE_WORLD} (rank 0 of "
                             f"the fake process group keeps per-rank buffers for every rank in one process)")
        mode, world = "fake", int(simulate_world_size)
    else:
        gpus = int(hw.get("gpus") or 0)
        if gpus:
            per_node = nproc or gpus
            if per_node > gpus:
                raise ValueError(f"--nproc={per_node}: this machine has {gpus} GPU(s); accepted: 1..{gpus}, "
                                 f"or --simulate-world-size for more ranks")
            mode, world = "gpu", per_node * nnodes
        else:
            mode, world = "cpu", (nproc or DEFAULT_CPU_RANKS) * nnodes
        if world < 2:
            have = (f"{gpus} GPU here" if gpus and not nproc else f"--nproc {nproc}" if nproc
                    else "1 rank here")
            note = (f"{have}, and a distributed strategy needs 2 ranks or more: probing rank 0 of "
                    f"{DEFAULT_FAKE_WORLD} on the fake process group (as --simulate-world-size "
                    f"{DEFAULT_FAKE_WORLD}; give that flag for another world)")
            mode, world = "fake", DEFAULT_FAKE_WORLD
    return (mode, world, note) if explain else (mode, world)


def describe_mode(mode: str, world_size: int, hw: dict) -> str:
    """The header line saying where probes run and what that means for the numbers."""
    if mode == "fake":
        where = (f"on {hw['gpu_names'][0]}" if hw.get("gpus") else "on CPU")
        return (f"fake process group {where}: rank 0 of {world_size}, real allocations, "
                f"collectives counted, not executed (no step time)")
    if mode == "gpu":
        name = hw.get("gpu_names", ["GPU"])[0] if hw.get("gpu_names") else "GPU"
        return (f"{world_size} x {name}, NCCL, torchrun: memory from torch.cuda.max_memory_allocated, "
                f"collectives counted, step time measured")
    return (f"CPU, gloo, {world_size} process{'es' if world_size != 1 else ''}: memory from the storage "
            f"tracker, collectives counted, no GPU step time")


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


# -- a session ------------------------------------------------------------------------------------

def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def default_predict(spec: dict) -> dict:
    return predict_probe(spec)


def make_record(spec: dict, prediction: dict | None, prediction_error: str | None, measurement: dict,
                tolerance: float) -> dict:
    if prediction_error:
        measurement = dict(measurement, prediction_error=prediction_error)
    comparison = compare(prediction, measurement, tolerance)
    return {"id": spec.get("id"), "inputs": spec, "prediction": prediction,
            "prediction_error": prediction_error, "measurement": measurement, "comparison": comparison,
            "verdict": comparison["verdict"], "status": measurement.get("status"),
            "device": measurement.get("device"), "torch_version": measurement.get("torch_version"),
            "date": measurement.get("date") or _now()}


def with_fits(prediction: dict | None, device_memory_bytes: int | None) -> dict | None:
    if prediction is None or "fits" in prediction or not device_memory_bytes:
        return prediction
    peak = (prediction.get("memory") or {}).get("peak_allocated")
    if peak is None:
        return prediction
    return dict(prediction, fits=bool(peak <= device_memory_bytes),
                fits_source=f"predicted peak_allocated <= device memory {device_memory_bytes} B")


GPU_SHARE = 0.90
"""Fraction of the GPU's memory that probes running side by side on one GPU may be predicted to need
together (`run_validation`); the rest is slack for what the prediction does not hold (other processes'
CUDA contexts are counted per probe)."""


def _shares_gpu(spec: dict) -> bool:
    """A fake-process-group probe on a GPU: one process, which `--jobs` may run beside others on the same
    device (a torchrun probe, mode 'gpu', takes every GPU and runs alone)."""
    return spec.get("mode") == "fake" and spec.get("device_type") == "cuda"


def _full_param_bytes(spec: dict) -> int:
    """fp32 bytes of the probe's model, all of it: the probes build it whole on the device (the reference
    decoder in place, a module on the CPU then `.to(device)`) before any wrapper shards it. 0 where the
    planner does not read the model's size from its spec (an `nn.Module` factory, a config the analytic
    front end does not read)."""
    try:
        from distplan.planner.api import resolve_model
        from distplan.planner.model import ModelSpec
        module = spec.get("module") or {}
        if module.get("hf_config"):
            model, _ = resolve_model(hf_config=module["hf_config"], overrides={"layers": module.get("layers")})
        elif module:
            return 0
        else:
            model = ModelSpec(**spec["model"])
        return 4 * int(model.param_count())
    except (ValueError, KeyError, TypeError):
        return 0


def gpu_need_bytes(spec: dict, prediction: dict | None) -> int:
    """Device bytes a probe sharing a GPU is expected to hold at most: the larger of its predicted reserved
    peak (else its allocated peak) and the whole model built before wrapping, plus a CUDA context
    (planner.footprint.CUDA_CONTEXT_BYTES). With no prediction, only the model and the context."""
    mem = (prediction or {}).get("memory") or {}
    peak = int(mem.get("peak_reserved") or mem.get("peak_allocated") or 0)
    return max(peak, _full_param_bytes(spec)) + CUDA_CONTEXT_BYTES


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


WARM_MIN_PROBES = 2
"""A validation run with this many warm-startable probes or more starts the warm process: its imports
are one probe's, so it pays from the second probe on."""


def start_warm(specs: list[dict], probe_cmd: list[str] | None, nnodes: int = 1):
    """A `warm.WarmStarter` for this run's CPU probes, or None (too few of them, a GPU in sight, a custom
    launcher, or it could not start)."""
    if probe_cmd is not None or os.environ.get("DISTPLAN_WARM_START", "1") == "0":
        return None
    if sum(warm_startable(s, nnodes) for s in specs) < WARM_MIN_PROBES or gpu_free_hardware() is None:
        return None
    try:  # started with the probes' environment: libgomp reads OMP_NUM_THREADS when it loads
        return WarmStarter(probe_base_env())
    except OSError:
        return None


def spec_cost(spec: dict, capacity: int) -> int:
    """Slots a probe takes: one per local process on CPU; a GPU probe takes the machine."""
    if spec.get("mode") == "gpu":
        return capacity
    if spec.get("mode") == "fake":
        return 1
    return min(capacity, int(spec.get("world_size", 1)))


def run_validation(specs: list[dict], out_path: str, *, tolerance: float = DEFAULT_TOLERANCE,
                   timeout_s: float = DEFAULT_TIMEOUT_S, probe_cmd: list[str] | None = None,
                   nnodes: int = 1, rdzv_endpoint: str | None = None, resume: bool = False,
                   jobs: int = 1, predict=None, on_event=None,
                   results: ResultsFile | None = None, device_memory_bytes: int | None = None) -> list[dict]:
    """Run every spec (skipping those already done when `resume`), append each record as it ends,
    and return the records in spec order. `on_event(kind, index, spec, record_or_None)` is called with
    kind 'skip', 'start' or 'done'. A KeyboardInterrupt kills the running probes and propagates; the
    records already appended stay in the file (pass `results` to read `results.appended` afterwards).
    `device_memory_bytes` (the GPU's total memory) fills in `fits` = predicted peak <= it when the
    prediction has no verdict of its own, so a measured OOM can be compared."""
    predict = predict or default_predict
    on_event = on_event or (lambda *a: None)
    results = results or ResultsFile(out_path)
    # the torch the probes run (this interpreter's) is part of their inputs: the prediction follows its
    # release where PyTorch's implementations differ, and a record re-predicted later does the same
    specs = [s if s.get("torch_version") else dict(s, torch_version=installed_torch()) for s in specs]
    existing = read_records(out_path) if resume else []
    records: dict[int, dict] = {}
    todo: list[int] = []
    for i, spec in enumerate(specs):
        prev = done(existing, spec) if resume else None
        if prev is not None:
            records[i] = dict(prev, resumed=True)
            on_event("skip", i, spec, records[i])
        else:
            todo.append(i)
    capacity = max(1, int(jobs))
    running: list[tuple[int, ProbeRun, dict | None, str | None]] = []
    predicted: dict[int, tuple[dict | None, str | None]] = {}
    gpu_budget = GPU_SHARE * device_memory_bytes if device_memory_bytes else None
    need: dict[int, int] = {}  # device bytes of each running probe that shares the GPU
    shared: set[int] = set()  # probes that had another one beside them on the GPU
    warm = start_warm([specs[i] for i in todo], probe_cmd, nnodes)
    try:
        while todo or running:
            used = sum(spec_cost(specs[i], capacity) for i, *_ in running)
            while todo and (not running or used + spec_cost(specs[todo[0]], capacity) <= capacity):
                i = todo[0]
                spec = specs[i]
                if i not in predicted:
                    try:
                        prediction, perr = predict(spec), None
                        prediction = with_fits(prediction, device_memory_bytes)
                    except Exception as e:  # the planner's failure is recorded, the probe still runs
                        prediction, perr = None, f"{type(e).__name__}: {e}"
                    predicted[i] = (prediction, perr)
                prediction, perr = predicted.pop(i)
                if gpu_budget and _shares_gpu(spec):
                    # side by side on one GPU only while their predicted needs fit together; a probe that
                    # needs more than the GPU has still runs, alone (its OOM is what validate judges)
                    n = gpu_need_bytes(spec, prediction)
                    if need and sum(need.values()) + n > gpu_budget:
                        predicted[i] = (prediction, perr)
                        break
                    need[i] = n
                todo.pop(0)
                on_event("start", i, spec, None)
                running.append((i, ProbeRun(spec, probe_cmd, timeout_s, nnodes, rdzv_endpoint, warm=warm),
                                prediction, perr))
                used += spec_cost(spec, capacity)
            still = []
            for item in running:
                i, run, prediction, perr = item
                measurement = run.poll()
                if measurement is None:
                    still.append(item)
                    continue
                need.pop(i, None)
                if i in shared:
                    measurement = dict(measurement, shared_gpu=True)
                rec = make_record(specs[i], prediction, perr, measurement, tolerance)
                results.append(rec)
                records[i] = rec
                on_event("done", i, specs[i], rec)
            running = still
            if len(need) > 1:  # still running together after this round's ends (starts are not GPU work)
                shared.update(need)
            if running:
                time.sleep(0.05)
    except BaseException:
        for _, run, *_ in running:
            run.abandon()
        raise
    finally:
        if warm is not None:
            warm.close()
    return [records[i] for i in sorted(records)]

