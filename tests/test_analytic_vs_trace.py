"""The analytic activation formulas (`planner.activations`, a `ModelSpec` from
`read_hf_config(path, implementation=True)`) against the trace of the real transformers model
(`planner.workload.trace.profile_hf`, saved_tensors_hooks on fake tensors, CPU): per decoder layer and
outside the layers, byte for byte, for every model type the analytic front end reads, in fp32, pure
bf16 and CPU autocast, at two (micro_batch, seq_len) points; plus the config variants that take other
code paths (sliding-window mask, attention dropout with GQA, no dropout, fused qkv with GQA and partial
rotary).

Compared quantities (both exclude parameters):
- per layer: the trace's middle layer segment; analytic `per_block + block_cache` (under autocast the
  layer's 16-bit weight casts, which the trace counts as saved tensors of that layer).
- outside: the trace's total minus layers x that layer, plus the input ids (the trace leaves the batch
  out, `batch_bytes`; the planner counts the ids the embedding's backward keeps) minus the 4-byte
  `total_weight` scalar of nll_loss (not in the formulas; tests/test_activations.py adds it too);
  analytic `total - layers x per layer` (embedding, shared RoPE tables, final norm, head input, loss).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from distplan.planner.activations import activations_in  # noqa: E402
from distplan.planner.config import TrainConfig  # noqa: E402
from distplan.planner.hf_config import read_hf_config  # noqa: E402
from distplan.planner.model import ModelSpec  # noqa: E402
from distplan.planner.workload.trace import profile_hf  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "hf"
MODEL_TYPES = ("llama", "qwen2", "mistral", "phi3", "gpt2", "gemma2", "qwen3")
DTYPES = {"float32": ("fp32", "fp32"), "bfloat16": ("bf16", "lowp"), "autocast-bfloat16": ("bf16-mixed", "autocast")}
# The second point (the same 128 tokens as one sequence) traces the 15 models and regimes again: slow
# tier; the fast tier keeps the first, which takes every code path of the formulas and the trace.
POINTS = ((2, 64), pytest.param((1, 128), marks=pytest.mark.slow))


def _compare(path, micro_batch: int, seq_len: int, dtype: str, attention: str = "sdpa",
             device: str = "cpu") -> tuple[tuple[int, int], tuple[int, int]]:
    """((trace, analytic) per layer, (trace, analytic) outside the layers), both planned for `device`'s
    kernels (tests/test_analytic_vs_trace_cuda.py: "cuda")."""
    spec = ModelSpec(**read_hf_config(path, implementation=True))
    precision, regime = DTYPES[dtype]
    train = TrainConfig(spec, seq_len=seq_len, micro_batch=micro_batch, precision=precision, attention=attention)
    act = activations_in(train, regime, device)
    p = profile_hf(str(path), micro_batch, seq_len, dtype, device=device, attention=attention)
    assert p["kernels_of"] == device
    layers = [s for s in p["segments"] if s["unit"] not in ("root", "loss")]
    assert len(layers) == spec.layers
    mid = layers[len(layers) // 2]["activation_bytes"]
    outside = p["activation_bytes"] - spec.layers * mid + micro_batch * seq_len * 8 - 4
    block = act.per_block + act.block_cache
    return (mid, block), (outside, act.total - spec.layers * block)


@pytest.mark.parametrize("point", POINTS, ids=["b2s64", "b1s128"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_analytic_equals_trace(model_type, dtype, point):
    (t_blk, a_blk), (t_out, a_out) = _compare(EXAMPLES / f"{model_type}-8l.json", *point, dtype)
    print(f"{model_type}/{dtype}/{point}: layer {t_blk} vs {a_blk}, outside {t_out} vs {a_out}")
    assert a_blk == t_blk
    assert a_out == t_out


# Eager attention (`attn_implementation="eager"`): the Llama family's `eager_attention_forward` (fp32 softmax,
# its 16-bit cast, K/V repeated, no mask saved) and GPT-2's own (views of c_attn, dropout on the probabilities,
# the fp32 softmax under CPU autocast). Gemma-2 runs eager in the test above. Llama and GPT-2 (the two
# functions) in the fast tier; the models that share Llama's function, slow.
EAGER_TYPES = ("llama", "gpt2") + tuple(pytest.param(t, marks=pytest.mark.slow)
                                        for t in ("qwen2", "mistral", "phi3", "qwen3"))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("model_type", EAGER_TYPES)
def test_eager_attention_equals_trace(model_type, dtype):
    (t_blk, a_blk), (t_out, a_out) = _compare(EXAMPLES / f"{model_type}-8l.json", 2, 64, dtype, "eager")
    assert a_blk == t_blk
    assert a_out == t_out


@pytest.mark.parametrize("model_type, strategy, precision", [
    ("gpt2", "ddp", "bf16-mixed"),  # its mask passed by position: the trace counted it once per layer (+5.4%)
    ("llama", "zero3", "bf16-mixed"),  # the mask shared by every layer, alive to block 0's backward end
    ("llama", "fsdp", "fp32"),
])
def test_eager_checkpointed_walk_equals_trace(model_type, strategy, precision):
    """Full checkpointing under eager attention: every checkpointed layer keeps the (B, 1, S, S) additive
    mask it was given, one tensor for all of them, until block 0's backward (the walks once spread it over
    the layers, and the trace counted GPT-2's, passed by position, in every layer's input). The analytic
    walk's peak equals the trace's within 0.1% at 512 tokens, where the mask is 1/4 of a block's input
    and every layer's scores dwarf the rest."""
    from distplan.planner.api import predict_probe
    path = str(EXAMPLES / f"{model_type}-8l.json")
    spec = {"id": "x", "strategy": strategy, "world_size": 8, "gpus_per_node": 8, "mode": "fake",
            "device_type": "cpu", "model": {"name": "hf:" + path}, "torch_version": "2.13",
            "train": {"seq_len": 512, "micro_batch": 2, "precision": precision, "checkpointing": "full",
                      "attention": "eager"},
            "module": {"hf_config": path, "micro_batch": 2, "seq_len": 512, "layers": None, "attention": "eager"}}
    trace = predict_probe(dict(spec))["memory"]["peak_allocated"]
    analytic_spec = {k: v for k, v in spec.items() if k != "module"}
    analytic_spec["model"] = read_hf_config(path, implementation=True)
    analytic = predict_probe(analytic_spec)["memory"]["peak_allocated"]
    assert abs(analytic / trace - 1) < 0.001, (analytic, trace)


VARIANTS = {
    # seq_len >= sliding_window: transformers materializes the mask, repeats K/V, SDPA keeps a float mask
    "mistral-window": ("mistral", dict(sliding_window=64), "bfloat16"),
    # attention dropout sends CPU SDPA to its math composite (fp32 upcast), GQA repeated inside it
    "llama-attn-dropout": ("llama", dict(attention_dropout=0.1), "bfloat16"),
    # no dropout at all, one-op GELU: GPT-2 on the flash kernel with q/k/v views of c_attn's output
    "gpt2-no-dropout": ("gpt2", dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, activation_function="gelu"),
                        "autocast-bfloat16"),
    # fused qkv with GQA, half the head rotated, residual dropout
    "phi3-gqa-partial": ("phi3", dict(num_key_value_heads=2, partial_rotary_factor=0.5, resid_pdrop=0.1), "float32"),
    # Qwen2 with a sliding window on every layer and attention dropout
    "qwen2-window-dropout": ("qwen2", dict(use_sliding_window=True, max_window_layers=0, sliding_window=64,
                                           attention_dropout=0.1), "float32"),
    # Gemma-2 without soft-capping, MHA (repeat_kv returns k itself), head_dim = hidden / heads, attention
    # dropout on the cast probabilities
    "gemma2-mha-nocap-dropout": ("gemma2", dict(num_key_value_heads=4, head_dim=64, attn_logit_softcapping=None,
                                                final_logit_softcapping=None, attention_dropout=0.1), "bfloat16"),
    # Gemma-2 with a head wider than hidden / heads (as gemma-2-9b: 16 x 256 > 3584) in fp32
    "gemma2-wide-heads": ("gemma2", dict(head_dim=96, query_pre_attn_scalar=96), "float32"),
    # Qwen3 with heads wider than hidden / heads (as Qwen3-0.6B: 16 x 128 at width 1024), untied, under autocast
    "qwen3-wide-heads-untied": ("qwen3", dict(head_dim=128, tie_word_embeddings=False), "autocast-bfloat16"),
    # Qwen3 with a sliding window on every layer, MHA and attention dropout (CPU SDPA's math composite)
    "qwen3-window-mha-dropout": ("qwen3", dict(use_sliding_window=True, max_window_layers=0, sliding_window=64,
                                               num_key_value_heads=4, attention_dropout=0.1), "bfloat16"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants(tmp_path, variant):
    base, changes, dtype = VARIANTS[variant]
    cfg = json.loads((EXAMPLES / f"{base}-8l.json").read_text()) | changes
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    (t_blk, a_blk), (t_out, a_out) = _compare(path, 2, 64, dtype)
    assert a_blk == t_blk
    assert a_out == t_out


def test_reference_fields_by_default():
    """Without `implementation` the keys are the architecture only (the catalog's), and the new
    ModelSpec fields default to the reference decoder."""
    kw = read_hf_config(EXAMPLES / "gpt2-8l.json")
    assert "hf_model_type" not in kw
    spec = ModelSpec(**kw)
    assert (spec.hf_model_type, spec.activation, spec.attn_dropout, spec.resid_dropout, spec.embed_dropout,
            spec.sliding_window, spec.rotary_dim) == ("", "", 0.0, 0.0, 0.0, 0, 0)


def test_implementation_fields_of_published_configs():
    data = Path(__file__).parent / "data" / "hf"
    got = {stem: read_hf_config(data / f"{stem}.json", implementation=True)
           for stem in ("gpt2", "llama-3-8b", "mistral-7b", "qwen2.5-7b", "phi-3-mini")}
    assert {k: got["gpt2"][k] for k in ("hf_model_type", "activation", "attn_dropout", "resid_dropout",
                                        "embed_dropout")} == dict(hf_model_type="gpt2", activation="gelu_new",
                                                                  attn_dropout=0.1, resid_dropout=0.1,
                                                                  embed_dropout=0.1)
    assert got["mistral-7b"]["sliding_window"] == 4096  # Mistral-7B-v0.1: the mask from 4096 tokens on
    assert got["qwen2.5-7b"]["sliding_window"] == 0  # use_sliding_window false
    assert got["llama-3-8b"]["attn_dropout"] == 0.0 and got["phi-3-mini"]["rotary_dim"] == 0
    for kw in got.values():
        ModelSpec(**kw)  # every field valid


def test_unsupported_implementation_configs(tmp_path):
    cfg = json.loads((EXAMPLES / "gpt2-8l.json").read_text()) | {"activation_function": "relu"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    read_hf_config(tmp_path)  # the architecture alone does not need it
    with pytest.raises(ValueError, match="activation_function"):
        read_hf_config(tmp_path, implementation=True)
    cfg = json.loads((EXAMPLES / "qwen2-8l.json").read_text()) | {"use_sliding_window": True, "max_window_layers": 4,
                                                                  "sliding_window": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="some layers only"):
        read_hf_config(tmp_path, implementation=True)


@pytest.mark.parametrize("name, strategy, tokens", [
    ("qwen2.5-0.5b", "zero2", 256),  # tied, h = 896 > 2 x 256: -2.96% before
    ("gpt2-medium", "zero2", 256),  # tied, learned positions: -0.95% before
    ("gemma-2-2b", "zero2", 512),  # soft-capped logits (the tanh's output gone too): -1.66% before
    ("llama-2-7b", "fsdp-grad-op", 128),  # untied: the head's gradient in .grad, FSDP1's in the input buffer
])
def test_peak_at_the_lm_heads_backward(name, strategy, tokens):
    """Published configs at full width in fp32 with few tokens per micro-batch, where the peak is the LM head's
    backward (its V x h weight gradient beside the logits' gradient): the analytic walk's peak equals the
    trace's (`predict_probe` of the transformers model on fake tensors) within 0.1%."""
    from distplan.planner.api import predict_probe
    path = str(Path(__file__).resolve().parent / "data" / "hf" / f"{name}.json")
    spec = {"id": "x", "strategy": strategy, "world_size": 8, "gpus_per_node": 8, "mode": "fake",
            "device_type": "cpu", "model": {"name": "hf:" + path}, "torch_version": "2.13",
            "train": {"seq_len": tokens, "micro_batch": 1, "precision": "fp32", "checkpointing": "none"},
            "module": {"hf_config": path, "micro_batch": 1, "seq_len": tokens, "layers": None}}
    trace = predict_probe(dict(spec))["memory"]["peak_allocated"]
    analytic_spec = {k: v for k, v in spec.items() if k != "module"}
    analytic_spec["model"] = read_hf_config(path, implementation=True)
    analytic = predict_probe(analytic_spec)["memory"]["peak_allocated"]
    assert abs(analytic / trace - 1) < 0.001, (analytic, trace)
