"""Record the allocation traces of a tied-embedding transformers model under mixed precision on the CPU, for
tests/test_alloc_trace.py (`test_tied_model_trace_against_recorded_traces`).

    python benchmarks/alloc_tied.py OUT.json.gz [CASE_PREFIX,...]

A Qwen2 whose LM head is tied to its embedding (vocabulary 32,768, width 512, 4 layers, GQA 8/2 heads)
and Qwen2.5-0.5B itself (its published config: 24 layers, width 896, vocabulary 151,936, tied), 2 x 128
tokens, bf16-mixed (CPU autocast for DDP; FSDP1/FSDP2 bf16 parameters, fp32 reduce), AdamW foreach, rank 0
of 8 on the fake process group, every probe with `DISTPLAN_ALLOC_EVENTS` (validate.measure.Tracker writes
every storage allocation, free and collective touch in host order): the vocabulary outweighs a block, so
what happens to the embedding-sized tensors (the LM head's own weight at construction, the tied gradients
at the embedding's backward) moves the reserved peak. About 25 seconds for the four small probes on 2
cores, a few minutes for the real size.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alloc_record import record, selected  # noqa: E402

CONFIG = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 512,
          "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
          "vocab_size": 32768, "max_position_embeddings": 2048, "rms_norm_eps": 1e-06, "hidden_act": "silu",
          "tie_word_embeddings": True, "use_sliding_window": False}
TRAIN = {"seq_len": 128, "micro_batch": 2, "grad_accum": 1, "grad_sync": "last", "precision": "bf16-mixed",
         "optimizer": "adamw", "optimizer_impl": "foreach", "checkpointing": "none", "attention": "sdpa"}
STRATEGIES = ("ddp", "zero2", "zero3", "fsdp")


REAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "hf", "qwen2.5-0.5b.json")
"""Qwen2.5-0.5B's published config.json (24 layers, width 896, vocabulary 151,936, tied): the real size."""


def cases() -> list[dict]:
    with open(REAL) as f:
        real = json.load(f)
    return ([{"id": f"qwen2-tied/{s}", "strategy": s, "world_size": 8, "gpus_per_node": 8, "mode": "fake",
              "device_type": "cpu", "config": CONFIG, "train": TRAIN, "steps": 1, "seed": 0} for s in STRATEGIES]
            + [{"id": f"qwen2.5-0.5b/{s}", "strategy": s, "world_size": 8, "gpus_per_node": 8, "mode": "fake",
                "device_type": "cpu", "config": real, "train": TRAIN, "steps": 1, "seed": 0} for s in STRATEGIES])


def main(argv: list[str]) -> int:
    from distplan.validate.runner import run_probe

    def run(case, path, tmp):
        cfg = os.path.join(tmp, case["id"].split("/")[0] + ".json")
        with open(cfg, "w") as f:
            json.dump(case["config"], f)
        spec = {k: v for k, v in case.items() if k != "config"}
        spec["model"] = {"name": "hf:" + case["id"].split("/")[0]}
        spec["module"] = {"hf_config": cfg, "micro_batch": TRAIN["micro_batch"], "seq_len": TRAIN["seq_len"],
                          "layers": None}
        m = run_probe(spec, env={"DISTPLAN_ALLOC_EVENTS": path}, timeout_s=900)
        return m, {case["id"]: path}, dict(case, torch_version=m.get("torch_version"))

    return record(argv[0], selected(cases(), argv),
                  "CPU runs of validate.probe (--hf-config) with DISTPLAN_ALLOC_EVENTS (benchmarks/alloc_tied.py)", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
