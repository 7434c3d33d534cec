"""Record the allocation traces of pipeline-parallel stages on the CPU, for tests/test_alloc_trace.py.

    python benchmarks/alloc_pp.py OUT.json.gz [CASE_PREFIX,...]

Each probe (validate/pp_probe.py: the reference decoder at 8 layers, width 1024, 1 x 512 tokens per
micro-batch, 4 micro-batches, AdamW foreach, fp32, gloo, one process per stage and replica) runs with
`DISTPLAN_ALLOC_EVENTS`, so every rank's validate.measure.Tracker writes its storage allocations, frees
and collective touches in host order; the traces of replica 0 of every stage are kept. Cases: GPipe and
1F1B on 2 and 4 stages, checkpointing full, DDP over 2 replicas per stage (1F1B). The test replays them
and the planner's stage trace (planner/alloc_trace.py `stage_allocation_events`) through the same
allocator model. About a minute per probe on 2 cores.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import tempfile

MODEL = {"layers": 8, "hidden": 1024, "heads": 8, "kv_heads": 4, "ffn_hidden": 2816, "vocab": 8192,
         "max_positions": 512, "mlp": "swiglu", "norm": "rmsnorm", "position": "rope", "tie_embeddings": False,
         "linear_bias": False, "qkv_bias": False, "source": "distplan replay check: Llama-style, 8 layers",
         "name": "llama-8l"}


def spec_for(pp: int, schedule: str, strategy: str = "single", dp: int = 1, checkpointing: str = "none",
             microbatches: int = 4) -> dict:
    pid = f"pp{pp}/{schedule}/{strategy}-dp{dp}/{checkpointing}/m{microbatches}"
    return {"id": pid, "model": MODEL, "pp": pp, "dp": dp, "strategy": strategy, "schedule": schedule,
            "microbatches": microbatches,
            "train": {"seq_len": 512, "micro_batch": 1, "optimizer": "adamw", "optimizer_impl": "foreach",
                      "checkpointing": checkpointing, "attention": "sdpa"},
            "steps": 1, "warmup_steps": 1, "seed": 0}


def cases() -> list[dict]:
    # (GPipe under DDP is not among them: the probe's stage fails in its first forward there)
    return [spec_for(2, "gpipe"), spec_for(2, "1f1b"), spec_for(2, "1f1b", checkpointing="full"),
            spec_for(4, "1f1b"), spec_for(2, "1f1b", "ddp", 2), spec_for(2, "gpipe", checkpointing="full"),
            spec_for(4, "gpipe")]


def compact(events: list) -> list:
    """The same events with storage keys renumbered 1, 2, ... in order of first use (a smaller file)."""
    ids: dict = {}
    return [[e[0], ids.setdefault(e[1], len(ids) + 1), *e[2:]] for e in events]


def main(argv: list[str]) -> int:
    from distplan.validate.pp_probe import probe_cmd
    from distplan.validate.runner import run_probe
    out = argv[0]
    prefixes = argv[1].split(",") if len(argv) > 1 else [""]
    doc = {"source": "CPU runs of validate.pp_probe with DISTPLAN_ALLOC_EVENTS (benchmarks/alloc_pp.py)",
           "specs": {}, "events": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in cases():
            if not any(spec["id"].startswith(p) for p in prefixes):
                continue
            world = spec["pp"] * spec["dp"]
            path = os.path.join(tmp, "events.json")
            m = run_probe(dict(spec, mode="cpu", world_size=world), probe_cmd(world),
                          env={"DISTPLAN_ALLOC_EVENTS": path}, timeout_s=900)
            print(spec["id"], m.get("status"), m.get("error", ""), flush=True)
            if m.get("status") != "ok":
                continue
            doc["specs"][spec["id"]] = spec
            for stage in range(spec["pp"]):
                with open(f"{path}.{stage * spec['dp']}") as f:
                    doc["events"][f"{spec['id']}/stage{stage}"] = compact(json.load(f))
    with gzip.open(out, "wt") as f:
        json.dump(doc, f, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
