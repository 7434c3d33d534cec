"""User code in a child process, bounded: a `--module` factory, its import and the model's forward and
backward on fake tensors (`trace.profile`, `trace.check_factory`) run in a forked child, so that a factory
that never returns, ends the process (`os._exit(3)`), eats the machine's memory or leaves processes behind is
one line naming the flag, and nothing of it outlives the call.

    value = run_isolated(fn, "--module", "pkg.mod:factory")

How (POSIX; Linux for the reaping):

- distplan (torch imported already: a fork costs milliseconds, not the seconds of a new interpreter) forks a
  *reaper* in a session of its own, which makes itself the subreaper of its descendants
  (`PR_SET_CHILD_SUBREAPER`: a process user code starts, even one that calls `setsid()` and whose parent
  exits, stays below it) and gets `PR_SET_PDEATHSIG(SIGTERM)` (distplan gone, even by SIGKILL: the
  reaper kills its tree and exits).
- the reaper forks the *worker*, which runs `fn()` under an address-space cap (`RLIMIT_AS`: what it had
  at the fork plus `memory_cap()`, half the available memory by default) with `TMPDIR` in a folder of its
  own, and writes `fn`'s value (pickled) or its error (one line) to a pipe.
- when the worker ends, however it ends, the reaper kills every process left below it (SIGKILL), reaps
  them, writes the worker's exit status to the pipe and exits.
- distplan reads the pipe until it closes (every writer gone) or the time limit (`--timeout`) passes; at
  the limit it kills the tree below the reaper itself (every live descendant found under it in /proc,
  until none is left), lets the reaper reap them and exit, and kills it (and its process group) if it has
  not within seconds. The folder goes after the call, whatever happened.

Verdicts: `fn`'s own ValueError passes as a ValueError (the model's error: one regime of a trace may fail
where another runs). A hang, an exit, a signal, memory beyond the cap raise `UserCodeFailure` (a
ValueError too), one line naming the flag; inside `user_code_limits` the same workload is then not run
again (a plan traces one model in several regimes: a hang costs one --timeout, not one per regime).

Known limitations: without `fork` (not POSIX) `fn` runs in-process, unbounded; without /proc and prctl
(not Linux) only the reaper's process group is killed. CUDA initialised in distplan before the fork (the
cuDNN workspaces measured on a GPU) cannot be used by the child; the fake-tensor trace does not use it.
The cap is on address space, not resident memory: a model whose trace maps more than the cap allows fails
with a MemoryError line.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import shutil
import signal
import struct
import sys
import tempfile
import time

DEFAULT_TIMEOUT_S = 300.0
"""The time limit where none is given: `distplan validate`'s default --timeout per probe."""
MEMORY_FRACTION = 0.5
"""The memory cap's share of the memory available when the call starts (`MemAvailable`)."""
MIN_MEMORY_CAP = 1 << 30
WHAT = "the factory, its import or the model's forward and backward on fake tensors"
ACCEPTED = "accepted: a factory that builds the model and returns it"

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_HEADER = struct.Struct("<cQ")  # a frame: kind (V value, E error line, M out of memory, X exit status), length


class UserCodeFailure(ValueError):
    """User code hung, ended its process, was killed or ran out of its memory: one line naming the flag."""


_LIMITS: dict = {"timeout_s": None, "memory_bytes": None, "failed": None, "in_child": False}


@contextlib.contextmanager
def user_code_limits(timeout_s: float | None = None, memory_bytes: int | None = None):
    """The time limit and memory cap of every `run_isolated` call inside (None: the enclosing one's, else
    DEFAULT_TIMEOUT_S and `memory_cap()`); a workload that failed as a process is not run again inside."""
    saved = dict(_LIMITS)
    if timeout_s is not None:
        _LIMITS["timeout_s"] = float(timeout_s)
    if memory_bytes is not None:
        _LIMITS["memory_bytes"] = int(memory_bytes)
    if _LIMITS["failed"] is None:
        _LIMITS["failed"] = {}
    try:
        yield
    finally:
        _LIMITS.clear()
        _LIMITS.update(saved)


def memory_cap() -> int | None:
    """The bytes the worker may map beyond what it had at the fork: `user_code_limits`' or MEMORY_FRACTION
    of MemAvailable (at least MIN_MEMORY_CAP); None where /proc/meminfo cannot be read."""
    if _LIMITS["memory_bytes"]:
        return _LIMITS["memory_bytes"]
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return max(MIN_MEMORY_CAP, int(MEMORY_FRACTION * avail))


def run_isolated(fn, flag: str, label: str, what: str = WHAT):
    """`fn()`'s value, computed in a child process under the time limit and memory cap (module docstring).
    Raises ValueError with `fn`'s own ValueError line, or UserCodeFailure naming `flag`=`label`."""
    failed, key = _LIMITS["failed"], (flag, label)
    if failed is not None and key in failed:
        raise UserCodeFailure(failed[key])
    if _LIMITS["in_child"] or not hasattr(os, "fork"):
        return fn()
    timeout_s = _LIMITS["timeout_s"] or DEFAULT_TIMEOUT_S
    try:
        return _run_child(fn, flag, label, what, timeout_s, memory_cap())
    except UserCodeFailure as exc:
        if failed is not None:
            failed[key] = str(exc)
        raise


def _run_child(fn, flag: str, label: str, what: str, timeout_s: float, cap: int | None):
    for stream in (sys.stdout, sys.stderr):
        _flush(stream)  # nothing buffered here is written twice by the child
    tmp = tempfile.mkdtemp(prefix="distplan-user-")
    r, w = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:
            _reaper(fn, r, w, tmp, cap, (flag, label, what))  # never returns
        os.close(w)
        w = None
        try:
            data = _read_until(r, time.monotonic() + timeout_s)
        except BaseException:  # Ctrl-C while waiting: the child's tree goes too
            kill_tree(pid)
            raise
        if data is None:
            kill_tree(pid)
            raise UserCodeFailure(f"{flag}={label!r}: {what} did not return in {timeout_s:g} s (--timeout); "
                                  f"{ACCEPTED}")
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(r)
        if w is not None:
            os.close(w)
        shutil.rmtree(tmp, ignore_errors=True)
    return _verdict(_frames(data), status, flag, label, what, cap)


def _verdict(frames: dict, reaper_status: int, flag: str, label: str, what: str, cap: int | None):
    if "E" in frames:
        raise ValueError(frames["E"].decode(errors="replace"))
    if "M" in frames:
        raise UserCodeFailure(f"{flag}={label!r}: {what} ran out of memory under its cap of "
                              f"{(cap or 0) / 2**30:.2g} GiB (beyond what distplan had mapped; by default half "
                              f"the memory available); {ACCEPTED}")
    status = int(frames["X"]) if "X" in frames else reaper_status
    code = os.waitstatus_to_exitcode(status)
    if "V" in frames and code == 0:
        try:
            return pickle.loads(frames["V"])
        except Exception as exc:  # noqa: BLE001 - a value that names what this process cannot load
            raise UserCodeFailure(f"{flag}={label!r}: its result cannot be read back ({type(exc).__name__}: "
                                  f"{_line(str(exc))})") from None
    if code < 0:
        try:
            how = f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            how = f"signal {-code}"
    else:
        how = f"exit code {code}"
    raise UserCodeFailure(f"{flag}={label!r}: {what} ended the process ({how}) before returning; {ACCEPTED}")


# -- the child: reaper and worker --------------------------------------------------------------------

def _reaper(fn, r: int, w: int, tmp: str, cap: int | None, named: tuple) -> None:
    """The forked child: a session and subreaper of its own; runs the worker, then kills what it left."""
    status = 70
    try:
        os.close(r)
        parent = os.getppid()
        os.setsid()
        _prctl(PR_SET_CHILD_SUBREAPER, 1)

        def end(signum, frame):  # distplan gone (PDEATHSIG) or a signal: nothing of the call outlives it
            kill_descendants(os.getpid())
            shutil.rmtree(tmp, ignore_errors=True)
            os._exit(128 + signum)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, end)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if _prctl(PR_SET_PDEATHSIG, signal.SIGTERM) and os.getppid() != parent:
            end(signal.SIGTERM, None)  # distplan died before the prctl took effect
        worker = os.fork()
        if worker == 0:
            _worker(fn, w, tmp, cap, named)  # never returns
        while True:
            try:
                _, st = os.waitpid(worker, 0)
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
        kill_descendants(os.getpid())
        _write_frame(w, b"X", str(st).encode())
        status = 0
    finally:
        os._exit(status)


def _worker(fn, w: int, tmp: str, cap: int | None, named: tuple) -> None:
    """The grandchild: `fn()` under the cap, its value or error line to the pipe; nothing else survives."""
    status = 70
    me = os.getpid()
    try:
        _LIMITS["in_child"] = True
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.environ["TMPDIR"] = tmp
        tempfile.tempdir = tmp
        _cap_memory(cap)
        try:
            kind, payload = b"V", pickle.dumps(fn(), protocol=pickle.HIGHEST_PROTOCOL)
        except MemoryError:
            kind, payload = b"M", b""
        except ValueError as exc:  # (the trace's line for a MemoryError it caught: memory, as above)
            kind, payload = ((b"M", b"") if isinstance(exc.__context__, MemoryError)
                             else (b"E", _line(str(exc)).encode(errors="replace")))
        except BaseException as exc:  # noqa: BLE001 - every way out of user code is one line
            flag, label, what = named
            text = f"{flag}={label!r}: {type(exc).__name__}: {_line(str(exc))}"
            if isinstance(exc, SystemExit):
                text = f"{flag}={label!r}: {what} called sys.exit({exc.code!r})"
            kind, payload = b"E", text[:2000].encode(errors="replace")
        if os.getpid() == me:  # (a process user code forked that returned here writes nothing)
            _write_frame(w, kind, payload)
            for stream in (sys.stdout, sys.stderr):
                _flush(stream)
            status = 0
    finally:
        os._exit(status)


def _line(text: str) -> str:
    return (text.splitlines() or [""])[0][:2000]


def _cap_memory(cap: int | None) -> None:
    if not cap:
        return
    try:
        import resource

        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = mapped + cap
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        if soft == resource.RLIM_INFINITY or limit < soft:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, OSError, ValueError, IndexError):
        pass  # no cap where none can be set


def _prctl(option: int, arg: int) -> bool:
    """Linux prctl(option, arg); True when it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, int(arg), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


# -- the pipe ----------------------------------------------------------------------------------------

def _write_frame(fd: int, kind: bytes, payload: bytes) -> None:
    view = memoryview(_HEADER.pack(kind, len(payload)) + payload)
    while view:
        view = view[os.write(fd, view):]


def _read_until(fd: int, deadline: float) -> bytes | None:
    """Everything written to the pipe until its last writer closes it; None at the deadline."""
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        if not select.select([fd], [], [], min(left, 3600.0))[0]:
            continue
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _frames(data: bytes) -> dict:
    """{kind: payload} of the frames in `data` (the first of each kind; anything unreadable ends it)."""
    out: dict = {}
    at = 0
    while at + _HEADER.size <= len(data):
        kind, n = _HEADER.unpack_from(data, at)
        at += _HEADER.size
        if at + n > len(data):
            break
        out.setdefault(kind.decode(errors="replace"), data[at:at + n])
        at += n
    return out


def _flush(stream) -> None:
    try:
        stream.flush()
    except (OSError, ValueError, AttributeError):
        pass


# -- finding and killing a tree ----------------------------------------------------------------------

def _live_children() -> dict[int, list[int]]:
    """{ppid: [pid, ...]} of the processes alive (not zombies), from /proc; {} without it."""
    children: dict[int, list[int]] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return children
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(pid)
    return children


def descendants(root: int) -> list[int]:
    """The live descendants of `root` (not itself), from /proc."""
    children = _live_children()
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.append(pid)
            todo.extend(children.get(pid, ()))
    return found


def kill_descendants(root: int, rounds: int = 200, reap_s: float = 5.0) -> None:
    """SIGKILL every live descendant of `root` (a subreaper: orphans below it stay below it), again until
    none is left (one forked meanwhile joins the next round); when `root` is this process, reap its
    children too (for up to `reap_s`), so that no zombie is left to init."""
    for _ in range(rounds):
        pids = descendants(root)
        if not pids:
            break
        for pid in pids:
            _kill(pid, signal.SIGKILL)
        time.sleep(0.005)
    if root != os.getpid():
        return
    deadline = time.monotonic() + reap_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.005)
        except ChildProcessError:
            break


def kill_tree(pid: int, grace_s: float = 5.0) -> None:
    """The reaper `pid` and everything below it, killed, and `pid` reaped: its descendants killed until
    none is left, the reaper given `grace_s` to reap them and exit (no zombie left to init), then killed
    with its process group (where there is no /proc, the group is all that is found)."""
    kill_descendants(pid)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            return
        kill_descendants(pid, rounds=1)
        time.sleep(0.01)
    _kill(pid, signal.SIGKILL)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
