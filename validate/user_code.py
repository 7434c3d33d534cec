"""User code run before any probe (`validate --module`'s factory, import, forward and backward on fake
tensors: `planner.workload.trace.check_factory`) in a forked child under the session's `--timeout`, so a
factory that never returns, or ends the process (`os._exit(3)`), is one line naming --module instead of a
hang or a silent exit of distplan.

Known limitations: the child is killed alone (a process user code starts in a new session outlives it,
as with the probes: `validate/guard.py`); no memory cap is set on it (the trace runs on fake tensors); the
in-process prediction after it (`probe_specs._check_fits`, `runner.default_predict`) runs the same code
again, trusted once it has returned here. POSIX only: where there is no fork, the check runs in-process.
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import sys
import time


def run_bounded(fn, timeout_s: float | None, flag: str, label: str, preload: tuple = ("torch",)) -> None:
    """Run `fn()` in a forked child and wait at most `timeout_s` seconds. Raise ValueError (one line) with
    `fn`'s own ValueError message when it raises, or naming `flag`=`label` when it ends the process, is
    killed, or has not returned in time (then it is killed). The modules `preload` are imported here first
    (torch: seconds), so the time limit is the user code's."""
    if not hasattr(os, "fork") or not timeout_s:
        fn()
        return
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # fn says what is missing
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # nothing buffered here is written twice by the child
        except (OSError, ValueError):
            pass
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: fn's verdict through the pipe, then out without the parent's exit handlers
        status = 0
        try:
            os.close(r)
            try:
                fn()
                msg = b""
            except BaseException as e:  # noqa: BLE001 - every way out of user code is one line
                text = (str(e).splitlines() or [""])[0] if isinstance(e, ValueError) else \
                    f"{flag}={label!r}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
                msg, status = text[:2000].encode(errors="replace") or b"?", 1
            view = memoryview(msg)
            while view:
                view = view[os.write(w, view):]
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
        finally:
            os._exit(status)
    os.close(w)
    try:
        chunks = _read_until(r, time.monotonic() + timeout_s)
    except BaseException:  # Ctrl-C while waiting: the child goes too
        _kill(pid)
        raise
    finally:
        os.close(r)
    if chunks is None:
        _kill(pid)
        raise ValueError(f"{flag}={label!r}: the factory, its import or the model's forward and backward on fake "
                         f"tensors did not return in {timeout_s:g} s (--timeout); accepted: a factory that "
                         f"builds the model and returns it")
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 0 and not chunks:
        return
    if code == 1 and chunks:
        raise ValueError(b"".join(chunks).decode(errors="replace"))
    how = f"signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exit code {code}"
    raise ValueError(f"{flag}={label!r}: the factory, its import or the model ended the process ({how}) "
                     f"before returning; accepted: a factory that builds the model and returns it")


def _read_until(fd: int, deadline: float) -> list[bytes] | None:
    """Everything the child writes until it closes the pipe; None at the deadline."""
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return chunks
        chunks.append(chunk)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
