"""Record the allocation traces of the committed H100 probes' CPU re-runs, for tests/test_allocator.py and
tests/test_alloc_trace.py.

    python benchmarks/alloc_h100.py OUT.json.gz [ID_PREFIX,...]

Every probe of benchmarks/results/h100-torch2.11-2026-11-23.jsonl whose measurement is `ok` runs again on
the CPU (the fake process group for the fake-PG probes, one process for `single`), same model, strategy,
world size and training settings (validate.results.record_spec), with `DISTPLAN_ALLOC_EVENTS`: rank 0's
validate.measure.Tracker writes every storage allocation, free and collective touch in host order, each
allocation with the stream a GPU would make it on (measure.StreamTags: FSDP's `device_handle.stream(...)`
contexts, and in backward the stream of the node's forward op, as CUDA autograd runs it). The tests replay
them through the allocator model against the H100's `max_memory_reserved`. About 10 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alloc_record import record, selected  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "h100-torch2.11-2026-11-23.jsonl")


def cases() -> list[dict]:
    from distplan.validate.results import record_spec
    with open(RESULTS) as f:
        recs = [r for r in map(json.loads, f) if r["measurement"].get("status") == "ok"]
    specs = [dict(record_spec(r), device_type="cpu") for r in recs]
    for s in specs:
        if s.get("mode") == "gpu":  # a single-GPU probe: one CPU process
            s["mode"] = "cpu"
    return specs


def main(argv: list[str]) -> int:
    from distplan.validate.runner import run_probe

    def run(spec, path, tmp):
        m = run_probe(spec, env={"DISTPLAN_ALLOC_EVENTS": path}, timeout_s=900)
        return m, {spec["id"]: path}, spec

    return record(argv[0], selected(cases(), argv), "CPU re-runs (the fake process group for the fake-PG probes; "
                  "torch 2.13) of every H100 probe in benchmarks/results/h100-torch2.11-2026-11-23.jsonl: "
                  "storage allocations (each with its stream tag: measure.StreamTags), frees and collective "
                  "touches in host order, recorded by validate.measure.Tracker (DISTPLAN_ALLOC_EVENTS; "
                  "benchmarks/alloc_h100.py); keys renumbered", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
