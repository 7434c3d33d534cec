"""The JSON-lines results file of `distplan validate`: one record per probe, appended as it ends.

A record is `{"id", "inputs" (the probe spec), "prediction", "measurement", "comparison", "verdict",
"status", "device", "torch_version", "date"}`. Each append is one `write` of one complete line, then
flush + fsync, with SIGINT deferred until the line is on disk, so a crash, an OOM or Ctrl-C never loses
the probes before it. Reading tolerates a truncated last line (a process killed mid-write); opening for
append first cuts such a partial line so the next record starts on a fresh line.

Known limitations: one writer at a time (no file locking); a record whose id repeats is kept, and
`latest()` returns the newest per id.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from contextlib import contextmanager

FINAL_STATUSES = ("ok", "oom", "error", "timeout", "crashed")
"""A record with one of these statuses is complete: `--resume` does not run its id again."""


def read_records(path: str) -> list[dict]:
    """All complete records; a truncated or garbled last line is ignored, a garbled middle line too."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path, "rb") as f:
        data = f.read()
    for line in data.split(b"\n"):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records


def latest(records: list[dict]) -> dict[str, dict]:
    """The newest record per id, in first-seen order."""
    out: dict[str, dict] = {}
    for rec in records:
        out[rec.get("id")] = rec
    return out


def done(records: list[dict], spec: dict) -> dict | None:
    """The stored record that makes `spec` done for `--resume`: same id, same inputs, final status."""
    for rec in reversed(records):
        if rec.get("id") == spec.get("id") and rec.get("status") in FINAL_STATUSES \
                and _same_inputs(rec.get("inputs"), spec):
            return rec
    return None


def _same_inputs(a, b) -> bool:
    return json.loads(json.dumps(a, sort_keys=True)) == json.loads(json.dumps(b, sort_keys=True))


@contextmanager
def _sigint_deferred():
    """Hold a Ctrl-C until the block ends, then raise it (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(signal.SIGINT, None)
            else:
                raise KeyboardInterrupt


class ResultsFile:
    """Append-only JSON-lines writer."""

    def __init__(self, path: str):
        self.path = path
        self.appended = 0
        self.repaired_bytes = _cut_partial_line(path)

    def append(self, record: dict) -> None:
        line = (json.dumps(record, sort_keys=False, default=_json_default) + "\n").encode()
        with _sigint_deferred():
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                view = memoryview(line)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                os.fsync(fd)
            finally:
                os.close(fd)
            self.appended += 1


def _cut_partial_line(path: str) -> int:
    """Truncate a trailing line that has no newline (a record cut mid-write). Returns bytes removed."""
    if not os.path.exists(path):
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        return 0
    size = os.path.getsize(path)
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return 0
        # Find the last newline, scanning back in chunks.
        pos, keep = size, 0
        while pos > 0:
            step = min(65536, pos)
            pos -= step
            f.seek(pos)
            chunk = f.read(step)
            i = chunk.rfind(b"\n")
            if i >= 0:
                keep = pos + i + 1
                break
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
        return size - keep


def _json_default(obj):
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)
