"""Record allocation traces of gradient accumulation and tensor parallelism on the CPU, for
tests/test_alloc_trace.py.

    python benchmarks/alloc_accum.py OUT.json.gz [CASE_PREFIX,...]

Each probe (the reference decoder at 8 layers, width 1024, 2 x 512 tokens, AdamW foreach; rank 0 of 8
on the fake process group, or `single` as one process) runs with `DISTPLAN_ALLOC_EVENTS`, so
validate.measure.Tracker writes every storage allocation, free and collective touch in host order
(benchmarks/alloc_depth.py does the same for one micro-step). Cases:

- accumulation: grad_accum 2 under each strategy (but hsdp, which is FSDP1 within one node), `grad_sync` last (no_sync /
  set_requires_gradient_sync(False) until the last micro-step) and every; fp32, and bf16-mixed for the
  FSDP families (their accumulators change dtype under mixed precision);
- tensor parallelism: tp 2 on a (4, 2) mesh, with and without sequence parallelism, under single
  (dp 1, so tp 2 of 2 ranks), zero2 and zero3, fp32 (torchtitan's plan, validate/probe.py).

The test replays these and the planner's own trace (planner/alloc_trace.py) through the same allocator
model. About a minute per probe on 2 cores.
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


def spec_for(strategy: str, precision: str = "fp32", accum: int = 1, sync: str = "last", tp: int = 1,
             sp: bool = False, checkpointing: str = "none") -> dict:
    world = (tp if strategy == "single" else 8) if tp > 1 else (1 if strategy == "single" else 8)
    pid = f"{strategy}/{precision}/{checkpointing}/accum{accum}-{sync}/tp{tp}{'-sp' if sp else ''}"
    spec = {"id": pid, "strategy": strategy, "world_size": world, "gpus_per_node": world,
            "mode": "fake" if world > 1 else "cpu", "model": MODEL,
            "train": {"seq_len": 512, "micro_batch": 2, "grad_accum": accum, "grad_sync": sync,
                      "precision": precision, "optimizer": "adamw", "optimizer_impl": "foreach",
                      "checkpointing": checkpointing, "attention": "sdpa"},
            "steps": 1, "seed": 0, "device_type": "cpu"}
    if tp > 1:
        spec.update(tp=tp, sequence_parallel=sp)
    return spec


def cases() -> list[dict]:
    out = []
    for s in ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op", "fsdp-no-shard"):
        for sync in (("last",) if s == "single" else ("last", "every")):
            out.append(spec_for(s, accum=2, sync=sync))
    for s in ("zero2", "zero3", "fsdp"):
        for sync in ("last", "every"):
            out.append(spec_for(s, "bf16-mixed", accum=2, sync=sync))
    for s in ("single", "zero2", "zero3"):
        for sp in (False, True):
            out.append(spec_for(s, tp=2, sp=sp))
    return out


def main(argv: list[str]) -> int:
    from distplan.validate.runner import run_probe

    def run(spec, path, tmp):
        m = run_probe(spec, env={"DISTPLAN_ALLOC_EVENTS": path}, timeout_s=900)
        return m, {spec["id"]: path}, spec

    return record(argv[0], selected(cases(), argv),
                  "CPU runs of validate.probe with DISTPLAN_ALLOC_EVENTS (benchmarks/alloc_accum.py)", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
