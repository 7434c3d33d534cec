"""The JSON-lines results file of `distplan validate`: one record per probe, appended as it ends.

A record is `{"id", "inputs" (the probe spec), "prediction", "measurement", "comparison", "verdict",
"status", "device", "torch_version", "date"}`. Each append is one `write` of one complete line, then
flush + fsync, with SIGINT deferred until the line is on disk, so a crash, an OOM or Ctrl-C never loses
the probes before it. Reading tolerates a truncated last line (a process killed mid-write); opening for
append first cuts such a partial line so the next record starts on a fresh line.

Every line written starts with the schema key, `{"schema": "distplan-validate/1", "id": ...`, so a file
is recognisably ours: each complete line a record carrying that key, or (files written before
2026-12-06, as in benchmarks/results/) every key of a record (`LEGACY_KEYS`). A last line cut mid-write
is cut only when it starts with the schema key, or with `{"id": ` after at least one record of ours.
Anything else (a foreign JSON-lines file, a lone broken line) is refused with one line before anything
runs and never modified (`check_results_path`). A write that fails (disk full) raises `ResultsWriteError`,
one line, after removing the part of its line that reached the file.

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


SCHEMA = "distplan-validate/1"
"""The value of the `schema` key every record written carries, first on its line."""

LEGACY_KEYS = frozenset({"id", "inputs", "prediction", "measurement", "comparison", "verdict", "status", "device",
                         "torch_version", "date"})
"""The keys of every record written before the schema key (2026-12-06): a file of such records is ours."""

_SCHEMA_HEAD = b'{"schema": "' + SCHEMA.encode() + b'", '
_LEGACY_HEAD = b'{"id": '


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


def record_spec(rec: dict) -> dict:
    """The probe spec of a record, to predict it again: its inputs with the torch it ran on (records
    before 2026-11-26 name it only in `torch_version` beside the inputs), so the prediction follows that
    release whatever torch is installed where it is re-predicted."""
    spec = dict(rec["inputs"])
    if not spec.get("torch_version"):
        version = rec.get("torch_version") or (rec.get("measurement") or {}).get("torch_version")
        if version:
            spec["torch_version"] = version
    return spec


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


DEFERRED_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


@contextmanager
def deferred_signals(signals=DEFERRED_SIGNALS):
    """Hold Ctrl-C (and SIGTERM, SIGHUP) until the block ends, then deliver the first one to its previous
    handler (SIGINT with the default handler: KeyboardInterrupt). Main thread only; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {}
    try:
        for sig in signals:
            previous[sig] = signal.getsignal(sig)
            signal.signal(sig, lambda signum, frame: received.append(signum))
    except (ValueError, OSError):
        for sig, h in previous.items():
            signal.signal(sig, h)
        yield
        return
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
        if received:
            sig = received[0]
            h = previous.get(sig)
            if callable(h):
                h(sig, None)
            elif sig == signal.SIGINT and h is not signal.SIG_IGN:
                raise KeyboardInterrupt
            elif h == signal.SIG_DFL:
                os.kill(os.getpid(), sig)


_sigint_deferred = deferred_signals


class NotResultsFile(ValueError):
    """--out names a file that is not a distplan validate results file: it is left untouched."""


def check_results_path(path: str) -> None:
    """Raise ValueError (one line) unless `path` can be a results file: not empty, not a directory, in
    a directory that exists (or can be made) and can be written, and, if it exists, a JSON-lines file of
    records with an "id" and a "status" (a last line cut mid-write is allowed: `ResultsFile` cuts it).
    Reads, never writes."""
    if not path or not str(path).strip():
        raise ValueError("--out: empty path; give a file name such as distplan-results.jsonl")
    if os.path.isdir(path):
        raise ValueError(f"--out={path}: is a directory; give a file name inside it")
    d = os.path.dirname(os.path.abspath(path))
    probe = d
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ValueError(f"--out={path}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"--out={path}: cannot write in {probe}")
    if os.path.exists(path):
        if not os.path.isfile(path):
            raise ValueError(f"--out={path}: not a regular file")
        if not os.access(path, os.R_OK | os.W_OK):
            raise ValueError(f"--out={path}: cannot read and write it")
        why = _not_ours(path)
        if why:
            raise NotResultsFile(f"--out={path}: not a distplan validate results file ({why}); left untouched, "
                                 f"give another --out")


def _is_record(obj) -> bool:
    """A complete record of ours: the schema key, or every key of a record written before it."""
    if not isinstance(obj, dict) or "id" not in obj or "status" not in obj:
        return False
    return obj.get("schema") == SCHEMA or (LEGACY_KEYS <= obj.keys() and isinstance(obj.get("inputs"), dict))


def _cut_record(tail: bytes, after_records: bool) -> bool:
    """A last line that is one of our records cut mid-write: it starts with the schema key, or (after
    at least one complete record of ours) with the start of a record, the schema key's or a legacy one's."""
    t = tail.strip()
    if t.startswith(_SCHEMA_HEAD):
        return True
    if not after_records or not t:
        return False
    return any(t.startswith(h) or h.startswith(t) for h in (_SCHEMA_HEAD, _LEGACY_HEAD))


_WHAT = "not a distplan validate record (the schema key, or every key of an older record)"


def _not_ours(path: str) -> str | None:
    """Why the existing file at `path` is not one of our results files, or None if it is."""
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        return None
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    records = 0
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ok = _is_record(json.loads(line))
        except ValueError:
            ok = False
        if not ok:
            return f"line {i} is {_WHAT}"
        records += 1
    if tail.strip():
        try:
            ok = _is_record(json.loads(tail))
        except ValueError:  # a record cut mid-write starts as every record does
            ok = _cut_record(tail, records > 0)
        if not ok:
            return f"line {len(lines) + 1} is {_WHAT}" + ("" if records else ", and no record of ours precedes it")
    return None


class ResultsWriteError(Exception):
    """A record could not be appended (disk full, quota, I/O error): one line; the records before it
    are intact."""


class ResultsFile:
    """Append-only JSON-lines writer."""

    def __init__(self, path: str):
        check_results_path(path)
        self.path = path
        self.appended = 0
        self.repaired_bytes = _cut_partial_line(path)

    def append(self, record: dict) -> None:
        """Append `record` as one line (the schema key first). A failed write raises ResultsWriteError
        (one line) after cutting what reached the file of this line, when no other writer followed it."""
        record = {"schema": SCHEMA, **{k: v for k, v in record.items() if k != "schema"}}
        line = (json.dumps(record, sort_keys=False, default=_json_default) + "\n").encode()
        with deferred_signals():
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as e:
                raise self._write_error(record, e) from None
            start = None
            try:
                start = os.fstat(fd).st_size
                view = memoryview(line)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                os.fsync(fd)
            except OSError as e:
                if start is not None:
                    _undo_partial(fd, start, line)
                raise self._write_error(record, e) from None
            finally:
                os.close(fd)
            self.appended += 1

    def _write_error(self, record: dict, e: OSError) -> ResultsWriteError:
        why = e.strerror or str(e) or type(e).__name__
        kept = f"the {self.appended} record{'s' if self.appended != 1 else ''} written before it are intact"
        return ResultsWriteError(f"--out={self.path}: cannot append the record of probe "
                                          f"{str(record.get('id'))[:80]!r}: {why}; {kept}; free space (or fix "
                                          f"the cause) and run again with --resume")


def _undo_partial(fd: int, start: int, line: bytes) -> None:
    """Cut the part of a failed `line` that reached the file at `start`, when that part is all that
    follows it (no other writer appended after it)."""
    try:
        size = os.fstat(fd).st_size
        if start < size <= start + len(line) and os.pread(fd, size - start, start) == line[:size - start]:
            os.ftruncate(fd, start)
    except OSError:
        pass  # the next ResultsFile cuts it (a partial line of ours)


def _cut_partial_line(path: str) -> int:
    """Repair the end of a results file (`check_results_path` has accepted it): a last line without its
    newline that is a complete record gets the newline; one cut mid-write is removed. Returns bytes
    removed."""
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
        f.seek(keep)
        tail = f.read()
        try:
            complete = _is_record(json.loads(tail))
        except ValueError:
            complete = False
        if complete:
            f.seek(0, os.SEEK_END)
            f.write(b"\n")
            removed = 0
        else:
            if not _cut_record(tail, keep > 0):  # not ours: never cut (check_results_path)
                raise NotResultsFile(f"{path}: its last line is not a record cut mid-write; left untouched")
            f.truncate(keep)
            removed = size - keep
        f.flush()
        os.fsync(f.fileno())
        return removed


def _json_default(obj):
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)
