"""Record the allocation traces of pipeline-parallel stages on the CPU, for tests/test_alloc_trace.py.

    python benchmarks/alloc_pp.py OUT.json.gz [CASE_PREFIX,...]

Each probe (validate/pp_probe.py: the reference decoder at 8 layers, width 1024, 1 x 512 tokens per
micro-batch, 4 micro-batches, AdamW foreach, fp32, gloo, one process per stage and replica) runs with
`DISTPLAN_ALLOC_EVENTS`, so every rank's validate.measure.Tracker writes its storage allocations, frees
and collective touches in host order; the traces of replica 0 of every stage are kept. Cases: GPipe and
1F1B on 2 and 4 stages, checkpointing full, DDP over 2 replicas per stage (1F1B); FSDP2 (zero2, zero3) over 2
replicas per stage (GPipe and 1F1B on 2 stages, checkpointing full, 1F1B on 4). Each file its cases:

    python benchmarks/alloc_pp.py tests/data/alloc_events_cpu_pp.json.gz \
        pp2/gpipe/single,pp2/1f1b/single,pp4/1f1b/single,pp4/gpipe/single,pp2/1f1b/ddp
    python benchmarks/alloc_pp.py tests/data/alloc_events_cpu_pp_fsdp.json.gz \
        pp2/1f1b/zero,pp2/gpipe/zero,pp4/1f1b/zero

The test replays them
and the planner's stage trace (planner/alloc_trace.py `stage_allocation_events`) through the same
allocator model. About a minute per probe on 2 cores.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alloc_record import record, selected  # noqa: E402

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
            spec_for(4, "gpipe"),
            # FSDP2 stages (zero2, zero3 over 2 replicas per stage; tests/data/alloc_events_cpu_pp_fsdp.json.gz)
            spec_for(2, "1f1b", "zero3", 2), spec_for(2, "gpipe", "zero3", 2), spec_for(2, "1f1b", "zero2", 2),
            spec_for(2, "1f1b", "zero3", 2, checkpointing="full"), spec_for(2, "gpipe", "zero2", 2, checkpointing="full"),
            spec_for(4, "1f1b", "zero3", 2)]


def main(argv: list[str]) -> int:
    from distplan.validate.pp_probe import probe_cmd
    from distplan.validate.runner import run_probe

    def run(spec, path, tmp):  # every rank writes PATH.<rank>: the first replica of each stage is kept
        world = spec["pp"] * spec["dp"]
        m = run_probe(dict(spec, mode="cpu", world_size=world), probe_cmd(world),
                      env={"DISTPLAN_ALLOC_EVENTS": path}, timeout_s=900)
        # the stored spec names the torch it ran on: the planner's stage trace follows that release
        return (m, {f"{spec['id']}/stage{k}": f"{path}.{k * spec['dp']}" for k in range(spec["pp"])},
                dict(spec, torch_version=m.get("torch_version", "")))

    return record(argv[0], selected(cases(), argv),
                  "CPU runs of validate.pp_probe with DISTPLAN_ALLOC_EVENTS (benchmarks/alloc_pp.py)", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
