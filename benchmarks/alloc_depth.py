"""Record the allocation traces of the reference decoder at depth on the CPU, for tests/test_alloc_trace.py.

    python benchmarks/alloc_depth.py OUT.json.gz [STRATEGY,...]

Each probe (16 layers, width 1024, 2 x 512 tokens, AdamW; fp32 and bf16-mixed, checkpointing none and full;
`single` as one process, the others as rank 0 of 8 on the fake process group) runs with
`DISTPLAN_ALLOC_EVENTS`, so validate.measure.Tracker writes every storage allocation, free and collective
touch in host order. The test replays them and the planner's own trace (planner/alloc_trace.py) through the
same allocator model: a check of the trace writer at a depth the committed GPU probes (4 layers) do not
reach. About 3 minutes per probe on 2 cores (bf16 on the CPU is slow).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alloc_record import record  # noqa: E402

MODEL = {"layers": 16, "hidden": 1024, "heads": 8, "kv_heads": 4, "ffn_hidden": 2816, "vocab": 8192,
         "max_positions": 512, "mlp": "swiglu", "norm": "rmsnorm", "position": "rope", "tie_embeddings": False,
         "linear_bias": False, "qkv_bias": False, "source": "distplan depth check: Llama-style, 16 layers",
         "name": "llama-16l"}
STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op")


def spec_for(strategy: str, precision: str, checkpointing: str) -> dict:
    world = 1 if strategy == "single" else 8
    return {"id": f"{strategy}/{precision}/{checkpointing}", "strategy": strategy, "world_size": world,
            "gpus_per_node": world, "mode": "fake" if world > 1 else "cpu", "model": MODEL,
            "train": {"seq_len": 512, "micro_batch": 2, "grad_accum": 1, "precision": precision,
                      "optimizer": "adamw", "optimizer_impl": "foreach", "checkpointing": checkpointing,
                      "attention": "sdpa"},
            "steps": 1, "seed": 0, "device_type": "cpu"}


def main(argv: list[str]) -> int:
    from distplan.validate.runner import run_probe

    strategies = argv[1].split(",") if len(argv) > 1 else STRATEGIES
    specs = [spec_for(s, prec, ck) for s in strategies for prec in ("fp32", "bf16-mixed") for ck in ("none", "full")]

    def run(spec, path, tmp):
        m = run_probe(spec, env={"DISTPLAN_ALLOC_EVENTS": path}, timeout_s=900)
        return m, {spec["id"]: path}, spec

    return record(argv[0], specs, "CPU runs of validate.probe with DISTPLAN_ALLOC_EVENTS (benchmarks/alloc_depth.py)",
                  run, compacted=False)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
