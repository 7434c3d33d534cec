"""The guard between `distplan validate` and one probe: nothing of a probe outlives distplan.

    python -m distplan.validate.guard PARENT_PID PROBE_DIR -- ARGV...

The runner starts this (pure Python, no torch: a few tens of milliseconds) in a new session instead of
the probe itself; the guard starts ARGV (torchrun, or the fake-process-group probe) as its child and
exits with the child's status (a child killed by signal N: the guard kills itself with N, so the runner
sees the same). What it adds:

- The child gets `PR_SET_PDEATHSIG(SIGKILL)` (Linux, via ctypes in its preexec): it dies with the guard
  however the guard ends. The probe does the same for its torchrun workers (`probe.main`), which
  torchelastic starts in sessions of their own.
- The guard gets `PR_SET_PDEATHSIG(SIGTERM)`: when distplan dies, even by SIGKILL, the guard kills the
  probe's processes (TERM, then KILL after a grace period; `kill_tree`: the child's process group, its
  descendants, and every process whose command line names PROBE_DIR) and removes PROBE_DIR, the probe's
  temp folder (TMPDIR points inside it, so torchelastic's `torchelastic_*` folder goes with it). Where
  there is no prctl (not Linux), a thread checks every 0.2 s whether the parent pid changed.
- SIGTERM / SIGINT / SIGHUP to the guard (the runner's kill of the group) kill the probe's processes
  the same way; PROBE_DIR is then the runner's to remove (it reads the result from it), unless the
  parent is gone.

- The guard is the subreaper of its descendants (`PR_SET_CHILD_SUBREAPER`, Linux): a process the probe
  (user code) starts whose parent exits is re-parented to the guard, not to init, even in a session of
  its own and with another command line, so it is still found below the guard; when the child ends, and
  when the guard is signalled, everything left below it is killed and reaped (`kill_leftovers`).

Known limitations: where there is no prctl (not Linux), a probe process that escapes both its session and
PROBE_DIR's name (a grandchild started with another command line in a new session) is found only while
its parent chain is intact.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
KILL_GRACE_S = 3.0


def set_pdeathsig(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent thread exits (Linux). True if set."""
    return _prctl(PR_SET_PDEATHSIG, int(sig))


def set_child_subreaper() -> bool:
    """Make this process the subreaper of its descendants (Linux): one whose parent exits is re-parented
    here, not to init, even in a session of its own, so it stays among our descendants. True if set."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _prctl(option: int, arg: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def fresh_signals() -> None:
    """A new interpreter's signal handlers, for a process forked without exec (validate/launch.py's
    workers, validate/warm.py's guards and probes): a fork keeps its parent's (torchelastic's agent turns
    SIGTERM, SIGINT, SIGHUP and SIGQUIT into an exception), so it would not die of a SIGTERM as a new
    interpreter does."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _preexec_child() -> None:  # runs in the child between fork and exec
    set_pdeathsig(signal.SIGKILL)


# -- finding a probe's processes ---------------------------------------------------------------------

def _proc_stat(pid: int) -> tuple[int, int, str, int] | None:
    """(ppid, pgid, state, start time) of a process from /proc, None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[2]), fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def probe_processes(root_pid: int | None, marker: str | None, pgid: int | None = None) -> dict[int, int]:
    """{pid: start time} of the live processes that belong to a probe: `root_pid`'s descendants, the
    members of process group `pgid`, and every process whose command line contains `marker` (the
    probe's temp folder). Not `root_pid` itself, nor this process. Empty without /proc."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    stats = {}
    for pid in pids:
        st = _proc_stat(pid)
        if st is not None and st[2] != "Z":
            stats[pid] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_rest) in stats.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    if root_pid is not None:
        todo = list(children.get(root_pid, ()))
        while todo:
            pid = todo.pop()
            if pid not in found:
                found.add(pid)
                todo.extend(children.get(pid, ()))
    for pid, (_ppid, pg, _state, _start) in stats.items():
        if pgid is not None and pg == pgid:
            found.add(pid)
        elif marker and pid not in found and marker in _cmdline(pid):
            found.add(pid)
    found.discard(os.getpid())
    if root_pid is not None:
        found.discard(root_pid)
    return {pid: stats[pid][3] for pid in found if pid in stats}


def _still(pid: int, start: int) -> bool:
    st = _proc_stat(pid)
    return st is not None and st[2] != "Z" and st[3] == start


def kill_tree(root_pid: int | None, marker: str | None, pgid: int | None = None,
              grace_s: float = KILL_GRACE_S, reap=None, with_root: bool = True) -> None:
    """SIGTERM every process of the probe (`probe_processes`) and `root_pid` (unless not `with_root`),
    SIGKILL what is left after `grace_s` (a stopped process ignores SIGTERM until continued: it gets
    SIGKILL). `reap()` is called while waiting (to collect a direct child's exit status)."""
    procs = probe_processes(root_pid, marker, pgid)
    if with_root and root_pid is not None and _proc_stat(root_pid) is not None:
        procs[root_pid] = _proc_stat(root_pid)[3]
    for pid in procs:
        _kill(pid, signal.SIGTERM)
        _kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while True:
        if reap is not None:
            reap()
        alive = {p: s for p, s in procs.items() if _still(p, s)}
        # processes started meanwhile (a worker spawned as we signalled) join the kill
        for pid, start in probe_processes(root_pid, marker, pgid).items():
            if pid not in procs:
                procs[pid] = alive[pid] = start
                _kill(pid, signal.SIGTERM)
        if not alive:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid, start in procs.items():
        if _still(pid, start):
            _kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if reap is not None:
            reap()
        if not any(_still(p, s) for p, s in procs.items()):
            return
        time.sleep(0.02)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def reap_children() -> None:
    """Collect the exit status of every child of this process that has ended (the orphans a subreaper
    inherits), without waiting."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def kill_leftovers(probe_dir: str) -> None:
    """Every process still below this one (the guard, a subreaper: what the probe started, in a session of
    its own too, whose parent is gone) or naming `probe_dir`, killed and reaped."""
    kill_tree(os.getpid(), probe_dir, reap=reap_children, with_root=False)
    reap_children()


def remove_dir(path: str, attempts: int = 5) -> None:
    """rmtree that finishes even when interrupted: a KeyboardInterrupt (or another signal's exception)
    during the removal is held until the folder is gone, then re-raised."""
    pending: BaseException | None = None
    for _ in range(attempts):
        try:
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                break
        except BaseException as e:  # noqa: BLE001 - retried, then re-raised
            pending = pending or e
    if pending is not None:
        raise pending


# -- the guard ---------------------------------------------------------------------------------------

def main(argv: list[str] | None = None, start=None) -> int:
    """The guard. `start(cmd)` starts the child and returns a `subprocess.Popen`-like object (pid, poll,
    wait); the default is a new process (`subprocess.Popen`), validate/warm.py's a fork."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m distplan.validate.guard PARENT_PID PROBE_DIR -- ARGV...", file=sys.stderr)
        return 2
    parent, probe_dir, cmd = int(argv[0]), argv[1], argv[3:]
    state = {"child": None, "ending": False}

    def end(signum: int) -> None:
        if state["ending"]:
            return
        state["ending"] = True
        child = state["child"]
        kill_tree(child.pid if child else None, probe_dir, reap=(child.poll if child else None))
        kill_leftovers(probe_dir)  # the orphans re-parented here (set_child_subreaper)
        if os.getppid() != parent:  # distplan is gone: nobody else will remove the folder
            remove_dir(probe_dir)
        os._exit(128 + signum)

    def on_signal(signum, frame):
        end(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    set_child_subreaper()
    if not set_pdeathsig(signal.SIGTERM):
        def watch():
            while os.getppid() == parent:
                time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:  # the parent died before prctl took effect
        end(signal.SIGTERM)
    try:
        state["child"] = (start(cmd) if start is not None else
                          subprocess.Popen(cmd, preexec_fn=_preexec_child if sys.platform.startswith("linux")
                                           else None))
    except OSError as e:
        print(f"cannot start the probe: {e}", file=sys.stderr)
        return 127
    while True:
        try:
            rc = state["child"].wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            continue
    state["ending"] = True  # (a signal from here on: the leftovers are being killed already)
    kill_leftovers(probe_dir)  # what the probe started and left: orphans in sessions of their own too
    if rc < 0:  # killed by a signal: end the same way, so the runner reports that signal
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
        time.sleep(1.0)
    return rc


if __name__ == "__main__":
    sys.exit(main())
