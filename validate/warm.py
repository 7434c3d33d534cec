"""A warm start for CPU probes: one process imports torch and the probe once, and each fake-process-group
probe of a validation run, or one-node gloo probe's launcher (validate/launch.py, whose torchrun workers
are forks of it in turn), is a fork of it instead of a new interpreter.

    python -m distplan.validate.warm PARENT_PID      # started by the runner (`WarmStarter`), pipes on 0/1

A fake-process-group probe on the CPU runs for 1-3 s, after importing torch, FSDP and DTensor for about
5 CPU-seconds on a 2-core machine. `WarmStarter` (the runner's side) starts this process once per
`run_validation`; it imports what a probe imports (`preload.preload`), then for each probe forks a guard
(validate/guard.py, unchanged: a session of its own, the probe's environment, stdout/stderr to the
probe's files), whose child is a second fork that runs `MODULE.main(ARGS)` in-process (`fork_module`)
instead of `python -m MODULE ARGS`. The process tree, and so every kill path, is the guard's as before,
one level down: runner -> this process -> guard -> probe.

- This process gets `PR_SET_PDEATHSIG(SIGKILL)`: it dies with the runner, even by SIGKILL; each guard's
  own `PR_SET_PDEATHSIG(SIGTERM)` then makes the guard kill its probe and remove the probe's folder, as
  when a runner that started the guard itself dies.
- Protocol (JSON lines): the runner writes `{"id": N, "argv": [PROBE_DIR, "--", python, "-m", MODULE,
  ARGS...], "env": {...}, "stdout": path, "stderr": path}`; this process answers `{"id": N, "pid": P}`
  (the guard's pid, a session leader: the probe's process group) and, when that guard ends,
  `{"pid": P, "rc": RC}` (RC as `Popen.returncode`: -N for a signal). It never runs a tensor operation,
  starts no thread and never touches CUDA, so a fork is safe; a worker gets a new interpreter's signal
  handlers.

A gloo probe's `python -m distplan.validate.launch ...` is such a module command: its fork runs the
launcher's `main`, which runs torchrun in-process (the agent's threads and the c10d store start in that
fork, never here); `launch.preload` has this process import what its workers will.

Known limitations: CPU probes only (GPU probes start a new interpreter, as validated on the GPU); a probe
inherits this process's imported modules and `warnings` filters.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from .guard import _preexec_child, fresh_signals, set_pdeathsig
from .preload import preload, preload_module
from . import guard

START_TIMEOUT_S = 300.0
"""How long the runner waits for the warm process's answer to a request (its first answer follows the
imports: seconds; minutes on a machine under load)."""


class Forked:
    """A forked child of this process, with the part of `subprocess.Popen`'s interface the guard uses."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def _status(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped elsewhere: ended, its status unknown
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._status(os.WNOHANG)

    def wait(self) -> int:
        while True:
            try:
                rc = self._status(0)
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
            if rc is not None:
                return rc


def is_module_command(cmd: list[str]) -> bool:
    """`[python, "-m", MODULE, ...]` with this interpreter: what `fork_module` can run in a fork."""
    return len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m"


def fork_module(cmd: list[str]):
    """Start `python -m MODULE ARGS` as a fork of this process running `MODULE.main(ARGS)` (the guard's
    child: it dies with the guard, `PR_SET_PDEATHSIG(SIGKILL)`, as `guard._preexec_child` makes it);
    any other command as a new process."""
    if not is_module_command(cmd):
        return subprocess.Popen(cmd, preexec_fn=_preexec_child)
    module, args = cmd[2], list(cmd[3:])
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return Forked(pid)

    def body() -> int:
        set_pdeathsig(signal.SIGKILL)
        fresh_signals()
        sys.argv = [module, *args]
        return importlib.import_module(module).main(args)
    _exit_with(body)


def _exit_with(body) -> None:
    """The end of a forked child: run `body()` and exit with its status as the interpreter would (a
    SystemExit's code; 1 and the traceback for an exception), without the parent's atexit handlers."""
    rc = 1
    try:
        rc = int(body() or 0)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - a traceback, as the interpreter would print
        traceback.print_exc()
        rc = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


# -- the warm process ------------------------------------------------------------------------------

def _preload(cmd: list[str]) -> None:
    if is_module_command(cmd):
        preload_module(cmd[2], cmd[3:])  # transformers on the first Hugging Face probe, then cached


def _start_guard(req: dict, proto_fds: tuple[int, int]) -> int:
    """Fork a guard for request `req`; its pid."""

    argv = [str(os.getpid()), *req["argv"]]
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid

    def body() -> int:
        for fd in proto_fds:
            os.close(fd)
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.environ.clear()
        os.environ.update(req["env"])
        tempfile.tempdir = None  # computed again from the probe's TMPDIR (inside its folder)
        fresh_signals()
        return guard.main(argv, start=fork_module)
    _exit_with(body)
    return -1  # not reached: the child exits in _exit_with


def serve(parent: int) -> int:
    if not set_pdeathsig(signal.SIGKILL) or os.getppid() != parent:
        return 1  # no way to die with the runner (not Linux), or it is already gone
    proto_in, proto_out = os.dup(0), os.dup(1)
    os.dup2(2, 1)  # stray prints go to stderr (the runner discards it), never into the protocol
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)

    preload([])

    def send(msg: dict) -> None:
        os.write(proto_out, (json.dumps(msg) + "\n").encode())

    guards: set[int] = set()
    buf = b""
    eof = False
    while not eof:
        for pid in list(guards):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                guards.discard(pid)
                send({"pid": pid, "rc": os.waitstatus_to_exitcode(status)})
        ready, _, _ = select.select([proto_in], [], [], 0.05)
        if not ready:
            continue
        data = os.read(proto_in, 1 << 16)
        if not data:
            eof = True
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            try:
                _preload(req["argv"][2:])
                pid = _start_guard(req, (proto_in, proto_out))
            except Exception as e:  # noqa: BLE001 - the runner falls back to a new process
                send({"id": req["id"], "error": f"{type(e).__name__}: {e}"})
                continue
            guards.add(pid)
            send({"id": req["id"], "pid": pid})
    for pid in guards:  # the runner has gone or is done: its probes are its to kill; reap what ends
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    return 0


# -- the runner's side ------------------------------------------------------------------------------

class WarmStarter:
    """The runner's handle on the warm process: `start()` a guard in it, `close()` when done."""

    def __init__(self, env: dict):
        # its own stderr is only its imports' (each guard and probe writes to the probe's files): an import
        # that fails shows as the error of the first `start()`, and the runner starts new processes instead.
        # Its TMPDIR is a folder of its own, removed by `close()`: importing torch._dynamo (the preload) makes
        # inductor's cache folder, $TMPDIR/torchinductor_$USER (torch/_inductor/runtime/cache_dir_utils.py,
        # default_cache_dir), which would otherwise stay behind in the user's temp folder.
        self._tmp = tempfile.mkdtemp(prefix="distplan-warm-")
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(os.getpid())], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=dict(env, TMPDIR=self._tmp), start_new_session=True)
        self._cond = threading.Condition()
        self._answers: dict[int, dict] = {}
        self._rcs: dict[int, int] = {}
        self._next = 0
        self.dead = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self._cond:
                if "rc" in msg:
                    self._rcs[int(msg["pid"])] = int(msg["rc"])
                else:
                    self._answers[int(msg["id"])] = msg
                self._cond.notify_all()
        with self._cond:
            self.dead = True
            self._cond.notify_all()

    def start(self, argv: list[str], env: dict, stdout: str, stderr: str) -> "WarmProc":
        """Start a guard running `argv` (`[PROBE_DIR, "--", python, "-m", MODULE, ARGS...]`); OSError if
        the warm process cannot (the caller starts a new process instead)."""
        with self._cond:
            if self.dead:
                raise OSError("the warm process has exited")
            n = self._next
            self._next += 1
        try:
            self.proc.stdin.write((json.dumps({"id": n, "argv": argv, "env": env, "stdout": stdout,
                                               "stderr": stderr}) + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError) as e:
            raise OSError(f"the warm process has exited: {e}") from e
        deadline = time.monotonic() + START_TIMEOUT_S
        with self._cond:
            while n not in self._answers and not self.dead and time.monotonic() < deadline:
                self._cond.wait(0.5)
            msg = self._answers.pop(n, None)
        if msg is None or "pid" not in msg:
            raise OSError((msg or {}).get("error") or "the warm process did not answer")
        return WarmProc(self, int(msg["pid"]))

    def returncode(self, pid: int) -> int | None:
        with self._cond:
            if pid in self._rcs:
                return self._rcs[pid]
            dead = self.dead
        if dead and not os.path.exists(f"/proc/{pid}"):
            return -signal.SIGKILL  # its parent died before it: ended, status unknown
        return None

    def wait_rc(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            rc = self.returncode(pid)
            if rc is not None:
                return rc
            if deadline is not None and time.monotonic() >= deadline:
                return None
            with self._cond:
                self._cond.wait(0.05)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self._tmp, ignore_errors=True)


class WarmProc:
    """A guard started in the warm process, with the part of `subprocess.Popen`'s interface `ProbeRun`
    uses (pid, poll, wait, returncode)."""

    def __init__(self, starter: WarmStarter, pid: int):
        self.starter = starter
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.starter.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """As `Popen.wait`: the return code, or `subprocess.TimeoutExpired` after `timeout` seconds (the
        runner's reap after a kill waits 5 s, `ProbeRun._reap`)."""
        if self.returncode is None:
            self.returncode = self.starter.wait_rc(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout)
        return self.returncode


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        print("usage: python -m distplan.validate.warm PARENT_PID", file=sys.stderr)
        sys.exit(2)
    sys.exit(serve(int(sys.argv[1])))
