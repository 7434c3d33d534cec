"""Read a Hugging Face `config.json` into ModelSpec keyword arguments (`--hf-config PATH`).

Owns the mapping from the transformers config keys of five decoder families to the planner's
`ModelSpec` fields. Pure Python (json only): no transformers, no torch, no network.

| model_type | layers | hidden | heads | kv heads | MLP width | notes |
|---|---|---|---|---|---|---|
| llama, mistral, qwen2, phi3 | num_hidden_layers | hidden_size | num_attention_heads | num_key_value_heads (default: heads) | intermediate_size | SwiGLU, RMSNorm, RoPE, untied unless tie_word_embeddings |
| gpt2 | n_layer | n_embd | n_head | = heads | n_inner (null: 4 x n_embd) | GELU, LayerNorm, learned positions (n_positions), biases, tied |

Biases: Qwen2 has q/k/v biases only (transformers `Qwen2Attention`); Llama's optional
`attention_bias` + `mlp_bias` map to `linear_bias` only when both are true. Phi-3's fused qkv_proj and
gate_up_proj have the same parameter count as separate projections.

Known limitations: an explicit `head_dim` that differs from hidden_size / num_attention_heads, a
non-gated activation in a Llama-family config, and Llama `attention_bias` without `mlp_bias` (or the
reverse) are rejected, because ModelSpec cannot describe them exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_hf_config", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "phi3", "qwen2")
"""The `model_type` values read_hf_config understands."""

_GATED_ACTS = ("silu", "swish")


def _fail(msg: str) -> ValueError:
    return ValueError(f"--hf-config: {msg}")


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """ModelSpec keyword arguments from a Hugging Face config.json (a file, or a folder holding one).

    Returns name, layers, hidden, heads, kv_heads, ffn_hidden, vocab, max_positions, mlp, norm,
    position, tie_embeddings, linear_bias, qkv_bias, source. Raises ValueError with a one-line message
    for a missing file, invalid JSON, an unsupported model_type, or a missing or invalid key.
    """
    p = Path(path).expanduser()
    shown = str(path)
    if p.is_dir():
        p = p / "config.json"
        shown = str(p)
    if not p.is_file():
        raise _fail(f"file '{shown}' not found")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise _fail(f"'{p}' is not valid JSON (line {e.lineno} column {e.colno}: {e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _fail(f"cannot read '{p}': {e}") from None
    if not isinstance(cfg, dict):
        raise _fail(f"'{p}' must hold a JSON object, not {type(cfg).__name__}")

    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _fail(f"model_type {model_type!r} in '{p}' is not supported; accepted: "
                    f"{', '.join(SUPPORTED_MODEL_TYPES)}")

    def get_int(key: str, default: Any = ...) -> int:
        if key not in cfg or cfg[key] is None:
            if default is ...:
                raise _fail(f"'{p}' (model_type {model_type}) lacks key '{key}'")
            return default
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise _fail(f"'{p}' key '{key}' is {v!r}; accepted: a positive integer")
        return v

    def get_bool(key: str, default: bool) -> bool:
        v = cfg.get(key, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise _fail(f"'{p}' key '{key}' is {v!r}; accepted: true or false")
        return v

    if model_type == "gpt2":
        hidden = get_int("n_embd")
        heads = get_int("n_head")
        out = dict(
            layers=get_int("n_layer"), hidden=hidden, heads=heads, kv_heads=heads,
            ffn_hidden=get_int("n_inner", 4 * hidden), vocab=get_int("vocab_size"),
            max_positions=get_int("n_positions"), mlp="gelu", norm="layernorm", position="learned",
            # GPT2Config inherits PretrainedConfig's tie_word_embeddings=True
            tie_embeddings=get_bool("tie_word_embeddings", True), linear_bias=True, qkv_bias=False,
        )
    else:
        hidden = get_int("hidden_size")
        heads = get_int("num_attention_heads")
        act = cfg.get("hidden_act", "silu")
        if act not in _GATED_ACTS:
            raise _fail(f"'{p}' key 'hidden_act' is {act!r}; accepted for {model_type}: "
                        f"{', '.join(_GATED_ACTS)} (a gated SwiGLU MLP)")
        head_dim = cfg.get("head_dim")
        if head_dim is not None and hidden % heads == 0 and head_dim != hidden // heads:
            raise _fail(f"'{p}' key 'head_dim' is {head_dim!r} but hidden_size/num_attention_heads is "
                        f"{hidden // heads}; the planner needs head_dim = hidden/heads")
        linear_bias = qkv_bias = False
        if model_type == "qwen2":
            qkv_bias = True  # Qwen2Attention: q/k/v_proj bias=True, o_proj bias=False
        elif model_type == "llama":
            attn_b, mlp_b = get_bool("attention_bias", False), get_bool("mlp_bias", False)
            if attn_b != mlp_b:
                raise _fail(f"'{p}' has attention_bias={str(attn_b).lower()} and "
                            f"mlp_bias={str(mlp_b).lower()}; the planner supports both or neither")
            linear_bias = attn_b
        out = dict(
            layers=get_int("num_hidden_layers"), hidden=hidden, heads=heads,
            kv_heads=get_int("num_key_value_heads", heads), ffn_hidden=get_int("intermediate_size"),
            vocab=get_int("vocab_size"), max_positions=get_int("max_position_embeddings", 2048),
            mlp="swiglu", norm="rmsnorm", position="rope",
            # LlamaConfig, MistralConfig, Qwen2Config, Phi3Config all default to untied
            tie_embeddings=get_bool("tie_word_embeddings", False),
            linear_bias=linear_bias, qkv_bias=qkv_bias,
        )
    if out["hidden"] % out["heads"]:
        raise _fail(f"'{p}': {out['heads']} heads do not divide hidden size {out['hidden']}")
    if out["heads"] % out["kv_heads"]:
        raise _fail(f"'{p}': {out['kv_heads']} key/value heads do not divide {out['heads']} heads")
    return {"name": f"hf:{path}", **out,
            "source": f"{p} (Hugging Face config.json, model_type {model_type})"}
