"""User code in a child process, bounded: a `--module` factory, its import and the model's forward and
backward on fake tensors (`trace.profile`, `trace.check_factory`) run in a child process, so that a factory
that never returns, ends the process (`os._exit(3)`), eats the machine's memory or leaves processes behind is
one line naming the flag, and nothing of it outlives the command.

    with user_code_limits(timeout_s=30):
        value = run_isolated("--module", "pkg.mod:factory", fn, *args)  # fn module-level, args picklable

How (POSIX; Linux for the reaping):

- distplan starts the *reaper*, a new interpreter (not a fork: a fork of a process whose autograd engine
  has started its thread pool, as torch 2.15 does for a fake-tensor backward, cannot run autograd:
  `forked_autograd_child`, torch/csrc/autograd/engine.cpp) in a session of its own, with distplan's `sys.path`. It makes itself the
  subreaper of its descendants (`PR_SET_CHILD_SUBREAPER`: a process user code starts, even one that calls
  `setsid()` and whose parent exits, stays below it) and gets `PR_SET_PDEATHSIG(SIGTERM)` (distplan gone,
  even by SIGKILL: the reaper kills its tree, removes the folder below and exits).
- the reaper forks the *worker*, which imports torch, says it is ready (its start, seconds, is not counted
  in the time limit), then runs under an address-space cap (`RLIMIT_AS`: what it had mapped then plus
  `memory_cap()`, half the available memory by default) with `TMPDIR` in a folder of its own, and answers
  requests over a pipe, one at a time: `fn(*args)`'s value (pickled) or its error (one line).
  Inside the outermost `user_code_limits` one worker answers every request (a plan traces one model in
  several regimes: the later traces are warm, as in one process); outside, one request, one worker.
- each request waits at most the time limit (`--timeout`); at the limit distplan kills the tree below the
  reaper itself (every live descendant found under it in /proc, until none is left), lets the reaper reap
  them and exit, and kills it (and its process group) if it has not within seconds.
- when the worker ends (asked to quit at the end of the limits, or however it ends), the reaper kills every
  process left below it (SIGKILL), reaps them, writes the worker's exit status to the pipe and exits; the
  folder is removed.

Verdicts: `fn`'s own ValueError passes as a ValueError (the model's error: one regime of a trace may fail
where another runs; the worker stays). A hang, an exit, a signal, memory beyond the cap raise
`UserCodeFailure` (a ValueError too), one line naming the flag, and end the worker (the next request starts
another); inside `user_code_limits` the same workload is then not run again (a hang costs one --timeout,
not one per regime).

`DISTPLAN_ISOLATE=0` runs `fn` in-process, unbounded (a debugger in user code).

Known limitations: without `fork` (not POSIX) `fn` runs in-process, unbounded; without /proc and prctl
(not Linux) only the reaper's process group is killed. The worker inherits nothing of distplan's state but
its environment and `sys.path` (`fn` and `args` carry the rest). The cap is on address space, not resident memory. Processes user code starts live until the worker ends
(the end of the command), not the end of the request that started them.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

from .limits import DEFAULT_TIMEOUT_S, LIMITS, memory_cap

STARTUP_S = 300.0
"""The most a worker may take to start (a new interpreter importing torch: seconds), before user code's time."""
WHAT = "the factory, its import or the model's forward and backward on fake tensors"
ACCEPTED = "accepted: a factory that builds the model and returns it"

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_HEADER = struct.Struct("<cQ")
"""A frame: its kind (R request, Q quit; O the worker ready, V value, E error line, M out of memory, X the
worker's exit status), its length."""


class UserCodeFailure(ValueError):
    """User code hung, ended its process, was killed or ran out of its memory: one line naming the flag."""


def run_isolated(flag: str, label: str, fn, *args, what: str = WHAT, preload: tuple = ("torch",)):
    """`fn(*args)`'s value, computed in a child process under the time limit and memory cap (module
    docstring); `fn` a module-level function, `args` picklable. Raises ValueError with `fn`'s own
    ValueError line, or UserCodeFailure naming `flag`=`label`."""
    failed, key = LIMITS["failed"], (flag, label)
    if failed is not None and key in failed:
        raise UserCodeFailure(failed[key])
    if LIMITS["in_child"] or not hasattr(os, "fork") or os.environ.get("DISTPLAN_ISOLATE") == "0":
        return fn(*args)
    timeout_s = LIMITS["timeout_s"] or DEFAULT_TIMEOUT_S
    server = LIMITS["server"]
    if server is None or not server.alive:
        server = _Server(memory_cap(), preload)
        if failed is not None:  # inside user_code_limits: kept for the calls after this one
            LIMITS["server"] = server
    try:
        try:
            frame = server.call((fn, args, flag, label, what), time.monotonic() + timeout_s)
        except BaseException:  # Ctrl-C while waiting: the child's tree goes too
            server.stop(kill=True)
            raise
        return _verdict(server, frame, flag, label, what, timeout_s)
    except UserCodeFailure as exc:
        if failed is not None:
            failed[key] = str(exc)
        raise
    finally:
        if failed is None:  # outside user_code_limits: one call, one child
            server.stop()


def _verdict(server, frame, flag: str, label: str, what: str, timeout_s: float):
    """`fn`'s value from the worker's answer `frame` (kind, payload), or the one-line error."""
    if frame is None:
        server.stop(kill=True)
        raise UserCodeFailure(f"{flag}={label!r}: {what} did not return in {timeout_s:g} s (--timeout); "
                              f"{ACCEPTED}")
    kind, payload = frame
    if kind == b"V":
        try:
            return pickle.loads(payload)
        except Exception as exc:  # noqa: BLE001 - a value that names what this process cannot load
            raise UserCodeFailure(f"{flag}={label!r}: its result cannot be read back ({type(exc).__name__}: "
                                  f"{_line(str(exc))})") from None
    if kind == b"E":
        raise ValueError(payload.decode(errors="replace"))
    if kind == b"M":
        server.stop(kill=True)
        raise UserCodeFailure(f"{flag}={label!r}: {what} ran out of memory under its cap of "
                              f"{(server.cap or 0) / 2**30:.2g} GiB (beyond what distplan had mapped; by default "
                              f"half the memory available); {ACCEPTED}")
    reaper_status = server.stop()  # the worker ended: its status (X), or the reaper's where none came
    code = os.waitstatus_to_exitcode(int(payload) if payload else reaper_status)
    if code < 0:
        try:
            how = f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            how = f"signal {-code}"
    else:
        how = f"exit code {code}"
    raise UserCodeFailure(f"{flag}={label!r}: {what} ended the process ({how}) before returning; {ACCEPTED}")


class _Server:
    """A reaper and its worker (module docstring), answering requests (fn, args, flag, label, what) over a
    pipe, one at a time; `stop()` ends both and removes the worker's TMPDIR."""

    def __init__(self, cap: int | None, preload: tuple = ()):
        self.cap, self.alive, self.ready, self.buf = cap, True, False, bytearray()
        for stream in (sys.stdout, sys.stderr):
            _flush(stream)  # nothing buffered here is written twice by the child
        self.tmp = tempfile.mkdtemp(prefix="distplan-user-")
        req_r, self.req_w = os.pipe()
        self.resp_r, resp_w = os.pipe()
        try:
            self.proc = subprocess.Popen(_reaper_command(req_r, resp_w, self.tmp, cap, preload),
                                         pass_fds=(req_r, resp_w), start_new_session=True,
                                         stdin=subprocess.DEVNULL)
        except BaseException:
            for fd in (self.req_w, self.resp_r):
                os.close(fd)
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        finally:
            os.close(req_r)
            os.close(resp_w)
        self.pid = self.proc.pid

    def call(self, request: tuple, deadline: float):
        """The worker's answer (kind, payload) to `request`; (b"X", None) if it ended; None at `deadline`
        (which counts from the worker's ready frame: its start, a new interpreter importing `preload`, is
        not user code's time)."""
        if not self.ready:
            started = time.monotonic()
            frame = self._next_frame(started + STARTUP_S)
            if frame is None or frame[0] != b"O":
                return frame
            self.ready = True
            deadline += time.monotonic() - started
        try:
            _write_frame(self.req_w, b"R", pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
        except BrokenPipeError:
            pass  # the worker is gone: its status follows
        return self._next_frame(deadline)

    def _next_frame(self, deadline: float):
        """The worker's next frame (kind, payload); (b"X", None) at the end of the pipe; None at `deadline`."""
        while True:
            if len(self.buf) >= _HEADER.size:
                kind, n = _HEADER.unpack_from(self.buf, 0)
                if len(self.buf) >= _HEADER.size + n:
                    payload = bytes(self.buf[_HEADER.size:_HEADER.size + n])
                    del self.buf[:_HEADER.size + n]
                    return kind, payload
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not select.select([self.resp_r], [], [], min(left, 3600.0))[0]:
                continue
            chunk = os.read(self.resp_r, 1 << 20)
            if not chunk:
                return b"X", None
            self.buf += chunk

    def stop(self, kill: bool = False, grace_s: float = 5.0) -> int:
        """End the worker (asked to: a quit frame; `kill`: at once) and the reaper, which kills what is left
        below it; the reaper's wait status (0 where it was ended before)."""
        if not self.alive:
            return 0
        self.alive = False
        status = 0
        try:
            if not kill:
                try:
                    _write_frame(self.req_w, b"Q", b"")
                except OSError:
                    pass
                status = _wait(self.pid, grace_s)
            if kill or status is None:
                status = kill_tree(self.pid)
            self.proc.returncode = os.waitstatus_to_exitcode(status or 0)  # reaped here, not by Popen
        finally:
            for fd in (self.req_w, self.resp_r):
                try:
                    os.close(fd)
                except OSError:
                    pass
            shutil.rmtree(self.tmp, ignore_errors=True)
        return status or 0


def _wait(pid: int, timeout_s: float) -> int | None:
    """`pid`'s wait status once it ends within `timeout_s`, else None."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return 0
        if got == pid:
            return status
        if time.monotonic() > deadline:
            return None
        time.sleep(0.005)


# -- the child: reaper and worker --------------------------------------------------------------------

def _reaper_command(req_r: int, resp_w: int, tmp: str, cap: int | None, preload: tuple) -> list[str]:
    """The command line of a reaper: a new interpreter (nothing of this process's state inherited, the
    autograd engine's included: module docstring) with this process's `sys.path` (the user's modules found
    as here), running `_reaper`."""
    boot = (f"import json, sys; sys.path[:] = json.loads(sys.argv[1]); from {__name__} import _reaper; "
            f"_reaper(*json.loads(sys.argv[2]))")
    return [sys.executable, "-c", boot, json.dumps(sys.path), json.dumps([req_r, resp_w, tmp, cap, list(preload)])]


def _reaper(req_r: int, resp_w: int, tmp: str, cap: int | None, preload: list) -> None:
    """The reaper (in a session of its own): a subreaper; runs the worker, then kills what it left."""
    status = 70
    try:
        parent = os.getppid()
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
            _worker(req_r, resp_w, tmp, cap, preload)  # never returns
        while True:
            try:
                _, st = os.waitpid(worker, 0)
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
        kill_descendants(os.getpid())
        _write_frame(resp_w, b"X", str(st).encode())
        status = 0
    finally:
        os._exit(status)


def _worker(req_r: int, resp_w: int, tmp: str, cap: int | None, preload: list) -> None:
    """The grandchild: each request's `fn(*args)` under the cap, its value or error line to the pipe, until a
    quit frame or the end of the pipe."""
    status = 70
    me = os.getpid()
    try:
        LIMITS["in_child"] = True
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.environ["TMPDIR"] = tmp
        tempfile.tempdir = tmp
        _preload(preload)
        _cap_memory(cap)
        _write_frame(resp_w, b"O", b"")
        while True:
            request = _read_frame(req_r)
            if request is None or request[0] != b"R":
                break
            kind, payload = _answer(request[1])
            if os.getpid() != me:  # (a process user code forked that returned here: gone quietly)
                break
            _write_frame(resp_w, kind, payload)
            for stream in (sys.stdout, sys.stderr):
                _flush(stream)
        status = 0
    finally:
        os._exit(status)


def _answer(request: bytes) -> tuple[bytes, bytes]:
    """(kind, payload) for one request: V and the pickled value, E and one line, M (out of memory)."""
    fn, args, flag, label, what = pickle.loads(request)
    try:
        return b"V", pickle.dumps(fn(*args), protocol=pickle.HIGHEST_PROTOCOL)
    except MemoryError:
        return b"M", b""
    except ValueError as exc:  # (the trace's line for a MemoryError it caught: memory, as above)
        if isinstance(exc.__context__, MemoryError):
            return b"M", b""
        return b"E", _line(str(exc)).encode(errors="replace")
    except BaseException as exc:  # noqa: BLE001 - every way out of user code is one line
        text = f"{flag}={label!r}: {type(exc).__name__}: {_line(str(exc))}"
        if isinstance(exc, SystemExit):
            text = f"{flag}={label!r}: {what} called sys.exit({exc.code!r})"
        return b"E", text[:2000].encode(errors="replace")


def _read_frame(fd: int) -> tuple[bytes, bytes] | None:
    """The next frame from `fd` (blocking); None at the end of the pipe."""
    head = _read_exactly(fd, _HEADER.size)
    if head is None:
        return None
    kind, n = _HEADER.unpack(head)
    payload = _read_exactly(fd, n)
    return None if payload is None else (kind, payload)


def _read_exactly(fd: int, n: int) -> bytes | None:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def _line(text: str) -> str:
    return (text.splitlines() or [""])[0][:2000]


def _preload(names: list) -> None:
    """Import each "module" (or run each "module:function") of `names` before the cap and before user
    code's time starts: the cap is on what user code maps beyond them (torch's CUDA build maps 3 GB of
    address space at import). One that fails is user code's to meet and report."""
    for name in names:
        module, _, function = name.partition(":")
        try:
            __import__(module)
            if function:
                getattr(sys.modules[module], function)()
        except Exception:  # noqa: BLE001
            pass


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


def kill_tree(pid: int, grace_s: float = 5.0) -> int:
    """The reaper `pid` and everything below it, killed, and `pid` reaped: its descendants killed until
    none is left, the reaper given `grace_s` to reap them and exit (no zombie left to init), then killed
    with its process group (where there is no /proc, the group is all that is found)."""
    kill_descendants(pid)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
            if got == pid:
                return status
        except ChildProcessError:
            return 0
        kill_descendants(pid, rounds=1)
        time.sleep(0.01)
    _kill(pid, signal.SIGKILL)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return 0


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
