"""How far apart the analytic front end's two walks of one training step are: the one-walk rebuild's distance.

    python benchmarks/walks_agree.py [--json]

The analytic front end walks a step twice: `memory.estimate_memory` (the per-phase components and the allocated
peak, a closed form over the blocks that bound the others) and `alloc_trace.allocation_events` (every allocation
and free of the warm-up and measured steps, which `allocator.replay` turns into the reserved peak). The rebuild
makes the first a fold over the second; before it can, both must give the same allocated peak. This prints, per
strategy over a grid (six catalog decoders, fp32 and bf16-mixed, checkpointing none and full, micro-batch 1
and 2, 8 and 16 GPUs on nodes of 8, accumulation 1 and 2, 1,024 tokens), how often the event list's live-bytes
peak (no allocator rounding: a plain sum of what is allocated and not yet freed) equals the walk's peak to the
byte, and the spread of the rest. About 25 s on 2 cores.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections import Counter, defaultdict

from distplan.planner.alloc_trace import allocation_events
from distplan.planner.api import plan

MODELS = ("llama-3-8b", "mistral-7b", "gpt2-medium", "phi-3-mini", "qwen2.5-7b", "llama-2-7b")
GRID = dict(precision=("bf16-mixed", "fp32"), activation_checkpointing=("none", "full"), micro_batch=(1, 2),
            gpus=(8, 16), grad_accum=(1, 2))


def live_peak_bytes(events) -> int:
    """The most bytes allocated and not yet freed at once in `events` (alloc_trace's event tuples)."""
    live: dict = {}
    now = peak = 0
    for ev in events:
        if ev[0] == "alloc" and ev[2] > 0:
            live[ev[1]] = ev[2]
            now += ev[2]
            peak = max(peak, now)
        elif ev[0] == "free":
            now -= live.pop(ev[1], 0)
    return peak


def rows() -> list[dict]:
    """One row per (configuration, strategy) whose events the analytic front end writes."""
    out = []
    for model, *values in itertools.product(MODELS, *GRID.values()):
        kw = dict(zip(GRID, values))
        try:
            p = plan(model, gpus_per_node=8, gpu="h100-sxm", comm=False, seq_len=1024, **kw)
        except ValueError:  # e.g. a micro-batch the model does not take
            continue
        for r in p.results:
            args = r.memory.reserved_replay
            if not args or args[0] in ("events", "pp-stage"):
                continue
            events = allocation_events(*args[:7], args[8])
            out.append({"model": model, **kw, "strategy": r.name, "walk_peak": r.memory.peak_allocated,
                        "events_peak": live_peak_bytes(events)})
    return out


def summary(table: list[dict]) -> list[str]:
    by = defaultdict(list)
    for row in table:
        by[row["strategy"]].append(row)
    lines = [f"{'strategy':14s} {'runs':>5s} {'exact':>6s} {'min':>8s} {'median':>8s} {'max':>8s}  most common differences (bytes)"]
    for name, rs in by.items():
        diffs = sorted((r["events_peak"] - r["walk_peak"]) / r["walk_peak"] for r in rs)
        common = Counter(r["events_peak"] - r["walk_peak"] for r in rs).most_common(3)
        lines.append(f"{name:14s} {len(rs):5d} {sum(r['events_peak'] == r['walk_peak'] for r in rs):6d} "
                     f"{diffs[0]:+8.3%} {diffs[len(diffs) // 2]:+8.3%} {diffs[-1]:+8.3%}  "
                     + ", ".join(f"{d:+,} x{n}" for d, n in common))
    return lines


def main() -> None:
    table = rows()
    if "--json" in sys.argv[1:]:
        print(json.dumps(table))
        return
    print("\n".join(summary(table)))
    exact = sum(r["events_peak"] == r["walk_peak"] for r in table)
    print(f"{exact} of {len(table)} runs: the event list's peak equals the walk's to the byte")


if __name__ == "__main__":
    main()
