"""Record the allocation traces of Hugging Face models on the CPU, for tests/test_alloc_trace.py.

    python benchmarks/alloc_hf.py OUT.json.gz [CASE_PREFIX,...]

Each probe runs the transformers model itself (planner/workload/traced_model.py `HFWorkload`, as `distplan validate
--hf-config` does): Llama (GQA, untied), Qwen2 (tied embeddings) and GPT-2 (gelu_new, dropout) at 8
layers, width 1024, vocabulary 8192 (tests/data/alloc_events_cpu_hf.json.gz); Mixtral (4 experts, top-2,
width 512) and OLMo-2 (q/k norms over the width), which only the trace front end plans
(`python benchmarks/alloc_hf.py tests/data/alloc_events_cpu_hf_traced.json.gz mixtral/,olmo2/`), and Llama and
Mixtral under transformers' full activation checkpointing (`... alloc_events_cpu_hf_ckpt.json.gz
llama-full/,mixtral-full/`), 2 x 256 tokens, AdamW foreach, fp32, rank 0 of 8 on the fake
process group, with `DISTPLAN_ALLOC_EVENTS`, so validate.measure.Tracker writes every storage allocation,
free and collective touch in host order. The config.json of each model is stored with its spec. The tests
(tests/test_hf_reserved.py) replay the recorded events and compare the reserved peak with the trace front
end's: its own written run (planner/module_plan.py `logged_module_events`, from the traced step's
allocation log), and its allocated peak plus the cached-but-free bytes of the analytic front end's replay
(`pair_reserved`). About a minute per probe on 2 cores.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alloc_record import record, selected  # noqa: E402

CONFIGS = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
              "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 4, "vocab_size": 8192, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-05, "hidden_act": "silu", "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 1024,
              "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 2, "vocab_size": 8192, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-06, "hidden_act": "silu", "tie_word_embeddings": True,
              "use_sliding_window": False},
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 1024, "n_layer": 8,
             "n_head": 8, "n_positions": 1024, "vocab_size": 8192, "activation_function": "gelu_new",
             "attn_pdrop": 0.1, "embd_pdrop": 0.1, "resid_pdrop": 0.1, "layer_norm_epsilon": 1e-05},
    # model types the analytic front end does not read: their reserved peak is the trace's own replay only
    "mixtral": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 512,
                "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
                "num_key_value_heads": 4, "vocab_size": 8192, "max_position_embeddings": 2048,
                "num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False,
                "sliding_window": None},
    "olmo2": {"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], "hidden_size": 1024,
              "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 8, "vocab_size": 8192, "max_position_embeddings": 2048,
              "hidden_act": "silu", "rms_norm_eps": 1e-06, "tie_word_embeddings": False},
}
STRATEGIES = ("ddp", "zero2", "zero3", "fsdp")
TRAIN = {"seq_len": 256, "micro_batch": 2, "grad_accum": 1, "grad_sync": "last", "precision": "fp32",
         "optimizer": "adamw", "optimizer_impl": "foreach", "checkpointing": "none", "attention": "sdpa"}


CHECKPOINTED = ("llama", "mixtral")
"""Also recorded with transformers' own full activation checkpointing (ids NAME-full/STRATEGY)."""

CONFIGS["qwen2-vocab"] = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 1024, "intermediate_size": 5376,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 1, "vocab_size": 43392,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-06, "hidden_act": "silu", "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "use_sliding_window": False}
"""Qwen2.5-7B's proportions (tests/data/hf/qwen2.5-7b.json) at 2/7 of its width: width 1024, MLP 5376, 8 heads
of 128 with one KV head, an untied vocabulary of 43,392, trained on 1 x 1024 tokens, so the vocabulary-sized
tensors (logits, embedding and head gradients) weigh against a block as they do at Qwen2.5-7B's 4096 tokens.
Recorded with and without full checkpointing (`... alloc_events_cpu_hf_vocab.json.gz qwen2-vocab`), built on the
device and wrapped (as the other probes), and for FSDP also built on the meta device and wrapped there (`init:
meta`, ids qwen2-vocab-meta*: what `estimate --hf-config` plans), and ZeRO-1 (`qwen2-vocab/zero1`,
`qwen2-vocab-full/zero1`), about 1.5 minutes a probe on 2 cores (fp32: bf16 matmuls on a CPU without bf16
instructions took over 6 minutes a probe).
There the trace's writer and the analytic one had differed by 3-16% in the reserved or the allocated peak."""
VOCAB_TRAIN = {"seq_len": 1024, "micro_batch": 1}


def cases() -> list[dict]:
    def case(name, s, suffix="", **train):
        return {"id": f"{name}{suffix}/{s}", "model_type": name, "strategy": s, "world_size": 8, "gpus_per_node": 8,
                "mode": "fake", "device_type": "cpu", "config": CONFIGS[name], "train": dict(TRAIN, **train),
                "steps": 1, "seed": 0}
    return ([case(name, s) for name in CONFIGS if name != "qwen2-vocab" for s in STRATEGIES]
            + [case(name, s, "-full", checkpointing="full") for name in CHECKPOINTED for s in STRATEGIES]
            + [case("qwen2-vocab", s, suffix, checkpointing=ck, **VOCAB_TRAIN)
               for suffix, ck in (("", "none"), ("-full", "full")) for s in STRATEGIES]
            + [dict(case("qwen2-vocab", s, "-meta" + suffix, checkpointing=ck, **VOCAB_TRAIN), init="meta")
               for suffix, ck in (("", "none"), ("-full", "full")) for s in STRATEGIES if s != "ddp"]
            + [case("qwen2-vocab", "zero1", suffix, checkpointing=ck, **VOCAB_TRAIN)
               for suffix, ck in (("", "none"), ("-full", "full"))])


def main(argv: list[str]) -> int:
    from distplan.validate.runner import run_probe

    def run(case, path, tmp):
        cfg = os.path.join(tmp, f"{case['model_type']}.json")
        with open(cfg, "w") as f:
            json.dump(case["config"], f)
        spec = {k: v for k, v in case.items() if k not in ("config", "model_type")}
        spec["model"] = {"name": f"hf:{case['model_type']}"}
        spec["module"] = {"hf_config": cfg, "micro_batch": case["train"]["micro_batch"],
                          "seq_len": case["train"]["seq_len"],
                          "layers": None}
        m = run_probe(spec, env={"DISTPLAN_ALLOC_EVENTS": path}, timeout_s=900)
        return m, {case["id"]: path}, case

    return record(argv[0], selected(cases(), argv),
                  "CPU runs of validate.probe (--hf-config) with DISTPLAN_ALLOC_EVENTS (benchmarks/alloc_hf.py)", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
