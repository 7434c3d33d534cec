"""Record the allocation traces of checkpoint saves on the CPU, for tests/test_alloc_trace.py.

    python benchmarks/alloc_ckpt.py OUT.json.gz [CASE_PREFIX,...]

Each probe (the reference decoder at 8 layers, width 1024, 2 x 512 tokens, AdamW foreach, fp32) trains
as benchmarks/alloc_accum.py's do, then saves model and optimizer state after the measured step
(validate/checkpoint.py) with `DISTPLAN_ALLOC_EVENTS`, so rank 0's trace runs from construction
through the save. `full` state dicts as rank 0 of 8 on the fake process group; `sharded` (DCP, which
does not run on the fake process group) on 2 gloo ranks. The test replays them and the planner's trace
(planner/alloc_trace.py `allocation_events` + `checkpoint_events`) through the same allocator model.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alloc_accum import spec_for  # noqa: E402
from alloc_record import record, selected  # noqa: E402


def cases() -> list[dict]:
    out = []
    for s, mode in (("ddp", "full"), ("zero2", "full"), ("zero3", "full"), ("fsdp", "full"),
                    ("fsdp-grad-op", "full"), ("ddp", "sharded"), ("zero3", "sharded"), ("fsdp", "sharded")):
        spec = spec_for(s)
        spec["id"] = f"{s}/fp32/{mode}"
        if mode == "sharded":  # gloo ranks: DCP needs every rank's plan
            spec.update(world_size=2, gpus_per_node=2, mode="cpu")
        spec["checkpoint"] = {"mode": mode}
        out.append(spec)
    return out


def main(argv: list[str]) -> int:
    from distplan.validate.runner import run_probe

    def run(spec, path, tmp):
        m = run_probe(dict(spec, checkpoint=dict(spec["checkpoint"], dir=tmp)),
                      env={"DISTPLAN_ALLOC_EVENTS": path}, timeout_s=900)
        return m, {spec["id"]: path}, spec

    return record(argv[0], selected(cases(), argv), "CPU runs of validate.probe with a checkpoint save and "
                  "DISTPLAN_ALLOC_EVENTS (benchmarks/alloc_ckpt.py)", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
