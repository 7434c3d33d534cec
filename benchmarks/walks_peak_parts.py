"""Where the analytic front end's two walks part at one configuration: the walk's components at its peak beside
the event list's live tensors at the events' peak, each tensor named by the line of the writer that allocated it.

    python benchmarks/walks_peak_parts.py MODEL STRATEGY [--precision P] [--checkpointing C] [--micro-batch N]
                                          [--gpus N] [--grad-accum N] [--seq-len N]

`benchmarks/walks_agree.py` counts the runs whose two peaks differ; this shows one of them. The walk
(`memory.estimate_memory`) gives bytes per component at its peak instant; the event list
(`alloc_trace.allocation_events`, written by `train_step_trace.TrainStepWalk`) gives every allocation. Grouping
the live tensors at the events' peak by the writer's call site (function and line, innermost first) and
comparing the sums with the components names the tensor one walk counts and the other does not. About 5 s.
"""

from __future__ import annotations

import argparse
import traceback
from collections import Counter

from distplan.planner import alloc_trace, trace_events
from distplan.planner.api import plan


def _site(depth: int = 6) -> str:
    """The planner frames of the caller's stack, innermost first: 'function:line < ...'."""
    frames = traceback.extract_stack(limit=depth + 2)[:-2]
    return " < ".join(f"{f.name}:{f.lineno}" for f in reversed(frames) if "planner" in f.filename)


def labelled_events(args: tuple) -> tuple[list, dict]:
    """The events of `reserved_replay` arguments `args`, and key -> the call site that allocated it."""
    labels: dict = {}
    cls = trace_events._Events
    plain_a, plain_put = cls.a, cls.put

    def a(self, size, stream=0):
        key = plain_a(self, size, stream)
        labels[key] = _site()
        return key

    def put(self, template, count, x):
        base = plain_put(self, template, count, x)
        site = "compiled block: " + _site()
        for i in range(1, count + 1):
            labels.setdefault(base + i, site)
        return base

    cls.a, cls.put = a, put
    try:
        events = alloc_trace.allocation_events(*args[:7], args[8])
    finally:
        cls.a, cls.put = plain_a, plain_put
    return events, labels


def live_at_peak(events: list) -> tuple[int, int, dict]:
    """(peak live bytes, index of the event that reaches it, key -> bytes live then)."""
    live: dict = {}
    now = peak = at = 0
    snapshot: dict = {}
    for i, ev in enumerate(events):
        if ev[0] == "alloc" and ev[2] > 0:
            live[ev[1]] = ev[2]
            now += ev[2]
            if now > peak:
                peak, at, snapshot = now, i, dict(live)
        elif ev[0] == "free":
            now -= live.pop(ev[1], 0)
    return peak, at, snapshot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("strategy")
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--checkpointing", default="none")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=1024)
    a = ap.parse_args()
    try:
        p = plan(a.model, gpus=a.gpus, gpus_per_node=8, gpu="h100-sxm", comm=False, seq_len=a.seq_len,
                 precision=a.precision, activation_checkpointing=a.checkpointing, micro_batch=a.micro_batch,
                 grad_accum=a.grad_accum, strategies=[a.strategy])
    except ValueError as exc:  # the planner's one-line message naming the input (exit 2, as argparse's)
        ap.error(str(exc))
    mem = p.results[0].memory
    print(f"walk: peak {mem.peak_allocated:,} bytes ({mem.peak_phase}); cuBLAS workspace {mem.workspace:,}")
    for name, b in mem.components.items():
        print(f"  {name:14s} {b:>16,}")
    args = mem.reserved_replay
    if not args or args[0] in ("events", "pp-stage"):
        raise SystemExit("no analytic event list for this configuration (a pipeline stage or a traced module)")
    events, labels = labelled_events(args)
    peak, at, snapshot = live_at_peak(events)
    print(f"events: peak {peak:,} bytes at event {at:,} of {len(events):,}; "
          f"events - walk = {peak - mem.peak_allocated:+,}")
    by_site, count = Counter(), Counter()
    for key, b in snapshot.items():
        by_site[labels.get(key, "?")] += b
        count[labels.get(key, "?")] += 1
    for site, b in by_site.most_common():
        print(f"  {b:>16,} x{count[site]:<4d} {site}")


if __name__ == "__main__":
    main()
