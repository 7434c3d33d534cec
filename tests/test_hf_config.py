"""read_hf_config: sample config.json files (trimmed copies of the official Hugging Face configs,
tests/data/hf/) map onto the expected ModelSpec arguments; bad input gives one-line ValueErrors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distplan.planner.hf_config import SUPPORTED_MODEL_TYPES, read_hf_config

DATA = Path(__file__).parent / "data" / "hf"

ARCH_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "max_positions", "mlp",
             "norm", "position", "tie_embeddings", "linear_bias", "qkv_bias")

EXPECTED = {
    "gpt2": dict(layers=12, hidden=768, heads=12, kv_heads=12, ffn_hidden=3072, vocab=50257,
                 max_positions=1024, mlp="gelu", norm="layernorm", position="learned",
                 tie_embeddings=True, linear_bias=True, qkv_bias=False),
    "llama-2-7b": dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, vocab=32000,
                       max_positions=4096, mlp="swiglu", norm="rmsnorm", position="rope",
                       tie_embeddings=False, linear_bias=False, qkv_bias=False),
    "llama-3-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256,
                       max_positions=8192, mlp="swiglu", norm="rmsnorm", position="rope",
                       tie_embeddings=False, linear_bias=False, qkv_bias=False),
    "mistral-7b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=32000,
                       max_positions=32768, mlp="swiglu", norm="rmsnorm", position="rope",
                       tie_embeddings=False, linear_bias=False, qkv_bias=False),
    "qwen2.5-7b": dict(layers=28, hidden=3584, heads=28, kv_heads=4, ffn_hidden=18944, vocab=152064,
                       max_positions=131072, mlp="swiglu", norm="rmsnorm", position="rope",
                       tie_embeddings=False, linear_bias=False, qkv_bias=True),
    "phi-3-mini": dict(layers=32, hidden=3072, heads=32, kv_heads=32, ffn_hidden=8192, vocab=32064,
                       max_positions=4096, mlp="swiglu", norm="rmsnorm", position="rope",
                       tie_embeddings=False, linear_bias=False, qkv_bias=False),
}


@pytest.mark.parametrize("stem", sorted(EXPECTED))
def test_sample_configs_round_trip(stem):
    path = DATA / f"{stem}.json"
    got = read_hf_config(path)
    assert set(got) == {"name", "source", *ARCH_KEYS}
    assert {k: got[k] for k in ARCH_KEYS} == EXPECTED[stem]
    assert got["name"] == f"hf:{path}"
    assert str(path) in got["source"] and "model_type" in got["source"]


@pytest.mark.parametrize("stem", sorted(EXPECTED))
def test_sample_configs_match_catalog(stem):
    """The catalog's model entries were transcribed from the same configs: they must agree."""
    from distplan.catalog import load_catalog

    entry = load_catalog().model(stem)
    assert read_hf_config(DATA / f"{stem}.json") | {"name": 0, "source": 0} == \
        entry.arch | {"name": 0, "source": 0}


def test_param_counts_of_samples():
    """Published counts (HF `sum(p.numel())`) through ModelSpec."""
    model = pytest.importorskip("distplan.planner.model")
    published = {"gpt2": 124_439_808, "llama-2-7b": 6_738_415_616, "llama-3-8b": 8_030_261_248,
                 "mistral-7b": 7_241_732_096, "qwen2.5-7b": 7_615_616_512,
                 "phi-3-mini": 3_821_079_552,
                 # the small real models the GPU plan probes at full depth (.ci/gpu-issues)
                 "llama-3.2-1b": 1_235_814_400, "qwen2.5-0.5b": 494_032_768, "gpt2-medium": 354_823_168,
                 "gemma-2-2b": 2_614_341_888, "qwen3-0.6b": 596_049_920}
    for stem, n in published.items():
        spec = model.ModelSpec(**read_hf_config(DATA / f"{stem}.json"))
        assert spec.param_count() == n, stem


def test_directory_is_accepted(tmp_path):
    (tmp_path / "config.json").write_text((DATA / "llama-2-7b.json").read_text())
    assert read_hf_config(tmp_path)["layers"] == 32


def _write(tmp_path, cfg) -> Path:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


def _base(stem="llama-2-7b") -> dict:
    return json.loads((DATA / f"{stem}.json").read_text())


def test_defaults(tmp_path):
    cfg = _base()
    del cfg["num_key_value_heads"], cfg["tie_word_embeddings"]
    got = read_hf_config(_write(tmp_path, cfg))
    assert got["kv_heads"] == got["heads"] == 32 and got["tie_embeddings"] is False
    cfg = _base("gpt2")
    cfg["n_inner"] = 1000
    assert read_hf_config(_write(tmp_path, cfg))["ffn_hidden"] == 1000
    cfg = _base("qwen2.5-7b")
    cfg["tie_word_embeddings"] = True  # the small Qwen2.5 models tie
    assert read_hf_config(_write(tmp_path, cfg))["tie_embeddings"] is True


def test_llama_biases(tmp_path):
    cfg = _base()
    cfg["attention_bias"] = cfg["mlp_bias"] = True
    assert read_hf_config(_write(tmp_path, cfg))["linear_bias"] is True
    cfg["mlp_bias"] = False
    with pytest.raises(ValueError, match="attention_bias=true and mlp_bias=false"):
        read_hf_config(_write(tmp_path, cfg))


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg.startswith("--hf-config: ")
    return msg


def test_missing_file(tmp_path):
    with pytest.raises(ValueError) as e:
        read_hf_config(tmp_path / "nope.json")
    assert _one_line(e) == f"--hf-config: file '{tmp_path / 'nope.json'}' not found"
    with pytest.raises(ValueError, match="config.json' not found"):
        read_hf_config(tmp_path)  # a folder without config.json


def test_invalid_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"model_type": "llama",,}')
    with pytest.raises(ValueError) as e:
        read_hf_config(p)
    assert "is not valid JSON (line 1" in _one_line(e)
    p.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        read_hf_config(p)


def test_unknown_model_type(tmp_path):
    cfg = _base()
    cfg["model_type"] = "bert"
    with pytest.raises(ValueError) as e:
        read_hf_config(_write(tmp_path, cfg))
    msg = _one_line(e)
    assert "'bert'" in msg and ", ".join(SUPPORTED_MODEL_TYPES) in msg
    del cfg["model_type"]
    with pytest.raises(ValueError, match="model_type None"):
        read_hf_config(_write(tmp_path, cfg))


@pytest.mark.parametrize("stem,key", [("llama-2-7b", "hidden_size"), ("llama-2-7b", "vocab_size"),
                                      ("gpt2", "n_layer"), ("gpt2", "n_positions")])
def test_missing_key(tmp_path, stem, key):
    cfg = _base(stem)
    del cfg[key]
    with pytest.raises(ValueError) as e:
        read_hf_config(_write(tmp_path, cfg))
    assert f"lacks key '{key}'" in _one_line(e)


def test_invalid_values(tmp_path):
    cfg = _base()
    cfg["num_hidden_layers"] = "32"
    with pytest.raises(ValueError, match="'num_hidden_layers' is '32'; accepted: a positive integer"):
        read_hf_config(_write(tmp_path, cfg))
    cfg = _base()
    cfg["hidden_act"] = "gelu"
    with pytest.raises(ValueError, match="hidden_act"):
        read_hf_config(_write(tmp_path, cfg))
    cfg = _base()
    cfg["head_dim"] = 256
    with pytest.raises(ValueError, match="head_dim"):
        read_hf_config(_write(tmp_path, cfg))
    cfg = _base()
    cfg["num_key_value_heads"] = 5
    with pytest.raises(ValueError, match="do not divide"):
        read_hf_config(_write(tmp_path, cfg))


def test_gemma2_published_config():
    """google/gemma-2-9b's config.json: head_dim 256 over 16 heads at hidden 3584 (q is 4096 wide), sandwich
    norms, tied head, soft-capping; 9,241,705,984 parameters as transformers' Gemma2ForCausalLM counts them
    (`sum(p.numel())`, built on the meta device)."""
    model = pytest.importorskip("distplan.planner.model")
    kw = read_hf_config(DATA / "gemma-2-9b.json")
    spec = model.ModelSpec(**kw)
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, spec.q_dim) == (42, 3584, 16, 8, 256, 4096)
    assert spec.sandwich_norms and spec.tie_embeddings and spec.mlp == "swiglu"
    assert (spec.attn_softcap, spec.final_softcap) == (50.0, 30.0)
    assert spec.param_count() == 9_241_705_984
    impl = model.ModelSpec(**read_hf_config(DATA / "gemma-2-9b.json", implementation=True))
    assert impl.hf_model_type == "gemma2" and impl.param_count() == spec.param_count()


def test_gemma2_defaults_and_refusals(tmp_path):
    """Absent keys take `Gemma2Config`'s defaults (gemma-2-2b's shape); what ModelSpec cannot describe is
    refused in one line naming the key."""
    model = pytest.importorskip("distplan.planner.model")
    spec = model.ModelSpec(**read_hf_config(_write(tmp_path, {"model_type": "gemma2"})))
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, spec.vocab) == (26, 2304, 8, 4, 256, 256000)
    assert spec.param_count() == 2_614_341_888  # transformers' Gemma2ForCausalLM with the defaults
    nocap = read_hf_config(_write(tmp_path, {"model_type": "gemma2", "attn_logit_softcapping": None,
                                             "final_logit_softcapping": None}))
    assert (nocap["attn_softcap"], nocap["final_softcap"]) == (0.0, 0.0)
    for bad, key in (({"hidden_activation": "relu"}, "hidden_activation"), ({"attention_bias": True}, "attention_bias"),
                     ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
                     ({"final_logit_softcapping": -1}, "final_logit_softcapping"), ({"head_dim": 0}, "head_dim")):
        with pytest.raises(ValueError) as e:
            read_hf_config(_write(tmp_path, {"model_type": "gemma2", **bad}))
        assert key in _one_line(e)


def test_qwen3_published_configs():
    """Qwen/Qwen3-8B and Qwen/Qwen3-0.6B config.json: q/k norms over head_dim, no biases; the 0.6B's 16
    heads of 128 make q 2048 wide at width 1024, and its head is tied. Parameter counts as transformers'
    Qwen3ForCausalLM counts them (`sum(p.numel())`, built on the meta device, transformers 5.24)."""
    model = pytest.importorskip("distplan.planner.model")
    big = model.ModelSpec(**read_hf_config(DATA / "qwen3-8b.json", implementation=True))
    assert (big.layers, big.hidden, big.heads, big.kv_heads, big.head_dim, big.q_dim) == (36, 4096, 32, 8, 128, 4096)
    assert big.qk_norm and not (big.qkv_bias or big.linear_bias or big.tie_embeddings)
    assert (big.hf_model_type, big.sliding_window) == ("qwen3", 0)
    assert big.param_count() == 8_190_735_360
    small = model.ModelSpec(**read_hf_config(DATA / "qwen3-0.6b.json"))
    assert (small.head_dim, small.q_dim, small.kv_dim, small.tie_embeddings) == (128, 2048, 1024, True)
    assert small.param_count() == 596_049_920


def test_qwen3_defaults_and_refusals(tmp_path):
    """Absent keys take `Qwen3Config`'s defaults; attention biases (on q/k/v and o_proj alike, which
    ModelSpec cannot describe) and a non-gated activation are refused in one line naming the key."""
    model = pytest.importorskip("distplan.planner.model")
    spec = model.ModelSpec(**read_hf_config(_write(tmp_path, {"model_type": "qwen3"})))
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, spec.vocab) == (32, 4096, 32, 32, 128, 151936)
    assert spec.param_count() == 12_049_461_248  # transformers' Qwen3ForCausalLM with the defaults
    for bad, key in (({"hidden_act": "gelu"}, "hidden_act"), ({"attention_bias": True}, "attention_bias"),
                     ({"head_dim": 0}, "head_dim")):
        with pytest.raises(ValueError) as e:
            read_hf_config(_write(tmp_path, {"model_type": "qwen3", **bad}))
        assert key in _one_line(e)
