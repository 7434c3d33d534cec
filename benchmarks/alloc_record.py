"""The recording loop the allocation-trace scripts share (benchmarks/alloc_accum.py, alloc_ckpt.py,
alloc_depth.py, alloc_pp.py): run each probe with `DISTPLAN_ALLOC_EVENTS` (validate.measure.Tracker then
writes every storage allocation, free and collective touch in host order) and write the specs and their
events, gzipped, for tests/test_alloc_trace.py."""

from __future__ import annotations

import gzip
import json
import os
import tempfile


def compact(events: list) -> list:
    """The same events with storage keys renumbered 1, 2, ... in order of first use (a smaller file)."""
    ids: dict = {}
    return [[e[0], ids.setdefault(e[1], len(ids) + 1), *e[2:]] for e in events]


def selected(specs: list[dict], argv: list[str]) -> list[dict]:
    """The specs whose id starts with one of the comma-separated prefixes of argv[1] (all without it)."""
    prefixes = argv[1].split(",") if len(argv) > 1 else [""]
    return [s for s in specs if any(s["id"].startswith(p) for p in prefixes)]


def record(out: str, specs: list[dict], source: str, run, compacted: bool = True) -> int:
    """Write {source, specs, events} to `out` (gzipped JSON). `run(spec, path, tmp)` runs one probe with
    DISTPLAN_ALLOC_EVENTS=path (`tmp`: a scratch folder) and returns (the measurement, {event key: the
    file its events are in}, the spec to store). `compacted`: storage keys renumbered (`compact`)."""
    doc = {"source": source, "specs": {}, "events": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "events.json")
        for spec in specs:
            m, files, stored = run(spec, path, tmp)
            print(spec["id"], m.get("status"), m.get("error", ""), flush=True)
            if m.get("status") != "ok":
                continue
            doc["specs"][spec["id"]] = stored
            for key, name in files.items():
                with open(name) as f:
                    events = json.load(f)
                doc["events"][key] = compact(events) if compacted else events
    with gzip.open(out, "wt") as f:
        json.dump(doc, f, separators=(",", ":"))
    return 0
