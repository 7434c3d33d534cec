"""Read a Hugging Face `config.json` into ModelSpec keyword arguments (`--hf-config PATH`).

Owns the mapping from the transformers config keys of seven decoder families to the planner's
`ModelSpec` fields. Pure Python (json only): no transformers, no torch, no network, except that
`resolve_hf_config` turns a Hugging Face Hub id (`org/name`, `org/name@revision`) that names no local
file into the path of its config.json, from the local Hugging Face cache or downloaded by
`huggingface_hub.hf_hub_download` (which transformers installs; HF_TOKEN, HF_HOME, HF_HUB_CACHE and
HF_HUB_OFFLINE apply as they do to transformers' `from_pretrained`).

| model_type | layers | hidden | heads | kv heads | MLP width | notes |
|---|---|---|---|---|---|---|
| llama, mistral, qwen2, phi3 | num_hidden_layers | hidden_size | num_attention_heads | num_key_value_heads (default: heads) | intermediate_size | SwiGLU, RMSNorm, RoPE, untied unless tie_word_embeddings |
| gpt2 | n_layer | n_embd | n_head | = heads | n_inner (null: 4 x n_embd) | GELU, LayerNorm, learned positions (n_positions), biases, tied |
| qwen3 | num_hidden_layers | hidden_size | num_attention_heads | num_key_value_heads | intermediate_size | Qwen2 without q/k/v biases, RMSNorm over head_dim on q and k, head_dim (may differ from hidden/heads); `Qwen3Config` defaults for absent keys |
| gemma2 | num_hidden_layers | hidden_size | num_attention_heads | num_key_value_heads | intermediate_size | gated GELU, sandwich RMSNorms, RoPE, head_dim (may differ from hidden/heads), tied, soft-capped attention and logits; `Gemma2Config` defaults for absent keys |

Biases: Qwen2 has q/k/v biases only (transformers `Qwen2Attention`); Llama's optional
`attention_bias` + `mlp_bias` map to `linear_bias` only when both are true. Phi-3's fused qkv_proj and
gate_up_proj have the same parameter count as separate projections.

`read_hf_config(path, implementation=True)` adds the fields by which transformers' forward pass saves
other activations than the reference decoder (`planner.activations` follows the model type's modeling
code then): `hf_model_type`, `activation` (GPT-2 `activation_function`: gelu_new is
`NewGELUActivation`, gelu/gelu_pytorch_tanh one native op), the dropout probabilities (GPT-2
attn_pdrop/resid_pdrop/embd_pdrop, default 0.1; Phi-3 attention_dropout/resid_pdrop, its embd_pdrop
unused by `Phi3Model`; Llama/Mistral/Qwen2 attention_dropout, default 0), `sliding_window` (Mistral,
default 4096; Phi-3; Qwen2 and Qwen3 when use_sliding_window covers every layer) and `rotary_dim` (Phi-3's
partial_rotary_factor). Without it the keys are the architecture only (what the catalog's entries hold).

Known limitations: an explicit `head_dim` that differs from hidden_size / num_attention_heads outside
Gemma-2 and Qwen3, Qwen3 with attention biases, a non-gated activation in a Llama-family config, Gemma-2 with attention biases or bidirectional
attention, and Llama `attention_bias` without `mlp_bias` (or the
reverse) are rejected, because ModelSpec cannot describe them exactly. With implementation=True also
a GPT-2 activation_function other than gelu_new/gelu/gelu_pytorch_tanh and a Qwen2 sliding window on
some layers only.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from .units import LIMITS, short_repr

__all__ = ["read_hf_config", "load_hf_config", "resolve_hf_config", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("gemma2", "gpt2", "llama", "mistral", "phi3", "qwen2", "qwen3")
"""The `model_type` values read_hf_config understands."""

_GATED_ACTS = ("silu", "swish")
_GEMMA_ACTS = ("gelu_pytorch_tanh", "gelu")
"""Gemma-2 `hidden_activation`: transformers' ACT2FN maps both to one `F.gelu` op (tanh or erf), which
saves only its input, as SiLU does: the gated MLP saves what SwiGLU's does."""


def _fail(msg: str) -> ValueError:
    return ValueError(f"--hf-config: {msg}")


MAX_CONFIG_BYTES = 16 * 2**20
"""A config.json is a few KB (the largest, with label maps or per-layer lists, a few hundred KB): a
larger file is refused before it is read."""

_SIZE_KEYS = {
    "num_hidden_layers": "layers", "n_layer": "layers", "hidden_size": "hidden", "n_embd": "hidden",
    "num_attention_heads": "heads", "n_head": "heads", "num_key_value_heads": "kv_heads",
    "intermediate_size": "ffn_hidden", "n_inner": "ffn_hidden", "vocab_size": "vocab",
    "max_position_embeddings": "max_positions", "n_positions": "max_positions",
}
"""config.json size keys -> the planner bound (`units.LIMITS`) they are checked against."""


def _bound_text(limit: str) -> str:
    lo, hi, why = LIMITS[limit]
    return f"a positive integer up to {hi:,} ({why})"


def _short_path(path) -> str:
    text = str(path)
    return text if len(text) <= 200 else text[:97] + "..." + text[-100:]


_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95})"
                     r"(?:@(?P<revision>[A-Za-z0-9][A-Za-z0-9._/-]{0,199}))?")
"""A Hub model id as `from_pretrained` takes it (`namespace/name`, each at most 96 characters of letters,
digits, '.', '_', '-'), with an optional `@revision` (a branch, tag or commit)."""


_FILE_NAME = re.compile(r"\.(json|jsonl|ya?ml|txt|py|bin|safetensors|pt|pth|gguf)$", re.IGNORECASE)
"""A name ending as a file does (`dir/config.json`): a path that is missing, never looked up on the Hub."""

HUB_PROBE_S = 3.0
"""Seconds `_hub_unreachable` waits for a TCP connection to the Hub before a download is tried."""

_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def _hub_unreachable() -> str | None:
    """Why the Hub's endpoint (HF_ENDPOINT, else huggingface.co) cannot be reached, found in at most
    HUB_PROBE_S seconds (no name resolution, no route, no answer); None when a TCP connection opens, when
    HF_HUB_OFFLINE is set (the download says so itself, at once) or when a proxy is set (it is the proxy
    that reaches the Hub). `huggingface_hub` would retry for about 26 s, printing each retry."""
    import socket  # lazy, as json above: a cold `estimate` opens no socket
    import threading
    from urllib.parse import urlsplit

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on") or \
            any(os.environ.get(v) for v in _PROXY_VARS):
        return None
    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = url.hostname
    if not host:
        return None
    try:
        port = url.port or (80 if url.scheme == "http" else 443)
    except ValueError:
        return None
    result: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=HUB_PROBE_S).close()
            result.append(None)
        except OSError as e:
            result.append(f"{host}: {' '.join((e.strerror or str(e) or type(e).__name__).split())[:120]}")
        except Exception as e:  # noqa: BLE001 - one line, never a traceback from this thread
            result.append(f"{host}: {type(e).__name__}")

    t = threading.Thread(target=connect, daemon=True, name="distplan-hub-probe")
    t.start()
    t.join(HUB_PROBE_S)
    if not result:
        return f"{host}: no answer in {HUB_PROBE_S:g} s"
    return result[0]


class _Unreachable(Exception):
    """The Hub cannot be reached (`_hub_unreachable` says why)."""


class _quiet_hub:
    """huggingface_hub's retry warnings ("Retrying in 1s [Retry 1/5]") off while it downloads: its
    failure is one line of ours."""

    def __enter__(self):
        import logging

        self.logger = logging.getLogger("huggingface_hub")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)
        return False


def resolve_hf_config(value):
    """`value` itself when it names a local file or folder, or is no Hub id; a Hub id `org/name[@revision]`
    that names nothing local: the path of the repository's config.json in the local Hugging Face cache
    (a cached copy is used as it is, without asking the Hub for a newer one), fetched there first when it
    is missing (`huggingface_hub.hf_hub_download`). A failure is one
    ValueError line naming --hf-config and what to do (a gated or private repository, offline, ...)."""
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        return value
    try:
        if Path(value).expanduser().exists():
            return value
    except (OSError, ValueError):
        return value  # load_hf_config says why it cannot be read
    m = _HUB_ID.fullmatch(value.strip())
    if m is None or _FILE_NAME.search(m["repo"]):
        return value  # a path: load_hf_config says it is not found
    repo, revision = m["repo"], m["revision"]
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise _fail(f"file '{_short_path(value)}' not found; as a Hugging Face Hub id it needs huggingface_hub "
                    f"(pip install huggingface_hub, or 'distplan[hf]')") from None
    try:
        from huggingface_hub import errors as hub_errors
    except ImportError:  # huggingface_hub < 0.20 kept them in utils
        from huggingface_hub import utils as hub_errors
    gated, missing_repo, missing_revision, missing_entry, offline = (
        getattr(hub_errors, n, ()) for n in ("GatedRepoError", "RepositoryNotFoundError", "RevisionNotFoundError",
                                             "EntryNotFoundError", "LocalEntryNotFoundError"))
    at = f"{repo}@{revision}" if revision else repo
    try:
        try:  # the cached copy first: no network where the model was used before
            path = hf_hub_download(repo, "config.json", revision=revision, local_files_only=True)
        except offline:
            why = _hub_unreachable()  # seconds at most, where the download would retry for half a minute
            if why:
                raise _Unreachable(why) from None
            with _quiet_hub():
                path = hf_hub_download(repo, "config.json", revision=revision)
    except _Unreachable as e:
        raise _fail(f"'{at}' is neither a local path nor in the Hugging Face cache, and the Hub cannot be "
                    f"reached ({e}); accepted: a config.json path, or a Hub id once online") from None
    except gated:
        raise _fail(f"'{at}' is a gated repository: accept its terms on huggingface.co/{repo} and set "
                    f"HF_TOKEN (or run `hf auth login`)") from None
    except offline:  # before missing_entry: a subclass of it
        raise _fail(f"'{at}' is neither a local path nor in the Hugging Face cache, and the Hub cannot be "
                    f"reached (HF_HUB_OFFLINE set, or no network); accepted: a config.json path, or a Hub "
                    f"id once online") from None
    except missing_repo:
        raise _fail(f"'{at}' is neither a local path nor a Hugging Face Hub repository (a private one needs "
                    f"HF_TOKEN)") from None
    except missing_revision:
        raise _fail(f"'{at}': repository {repo} has no revision '{revision}'") from None
    except missing_entry:
        raise _fail(f"'{at}': the repository has no config.json") from None
    except Exception as e:  # network and HTTP errors of the installed huggingface_hub / its HTTP client
        first = " ".join(str(e).split())[:200]
        raise _fail(f"cannot fetch the config.json of '{at}' from the Hugging Face Hub: "
                    f"{type(e).__name__}{': ' + first if first else ''}") from None
    return str(path)


def _file_kind(p: Path) -> str:
    """What a path that exists but is no regular file is, in words (`/dev/zero`, a FIFO, `/dev/stdin` on
    a pipe or a terminal)."""
    mode = p.stat().st_mode
    for test, words in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "not a regular file"


def load_hf_config(path: str | Path) -> tuple[dict, Path]:
    """(the JSON object of a config.json, its path as messages name it), checked to be a readable JSON
    object of at most MAX_CONFIG_BYTES whose size keys (num_hidden_layers, hidden_size, ... of any
    model_type) are within `units.LIMITS`; else a one-line ValueError naming --hf-config. Work and
    memory are bounded by the file-size cap whatever the file holds."""
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip() or "\0" in str(path):
        raise ValueError(f"--hf-config={short_repr(path)}: accepted: the path of a config.json, or of a "
                         f"folder holding one")
    try:
        p = Path(path).expanduser()
        shown = _short_path(path)
        if p.is_dir():
            p = p / "config.json"
            shown = _short_path(p)
        is_file = p.is_file()
        kind = None if is_file or not p.exists() else _file_kind(p)
    except (OSError, ValueError) as e:  # a name too long for the file system, ...
        raise _fail(f"cannot read '{_short_path(path)}': {type(e).__name__}") from None
    if kind:  # never opened: a device or a pipe may never end, or never answer
        raise _fail(f"'{shown}' is {kind}, not a file; accepted: the path of a config.json (a regular file of "
                    f"at most {MAX_CONFIG_BYTES // 2**20} MiB), or of a folder holding one")
    if not is_file:
        raise _fail(f"file '{shown}' not found")
    try:
        with open(p, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise _fail(f"'{shown}' is over {MAX_CONFIG_BYTES // 2**20} MiB; accepted: a Hugging Face "
                        f"config.json (a few KB)")
        cfg = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as e:
        raise _fail(f"'{shown}' is not valid JSON (line {e.lineno} column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise _fail(f"'{shown}' nests too deeply to be a config.json; accepted: a JSON object of "
                    f"settings") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _fail(f"cannot read '{shown}': {' '.join(str(e).split())[:200]}") from None
    if not isinstance(cfg, dict):
        raise _fail(f"'{shown}' must hold a JSON object, not {type(cfg).__name__}")
    p = Path(_short_path(p))  # messages name the file, a hostile path cut to 200 characters
    for key, limit in _SIZE_KEYS.items():  # before the model_type: a traced model_type is bounded too
        v = cfg.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and not 0 < v <= LIMITS[limit][1]:
            raise _fail(f"'{p}' key '{key}' is {short_repr(v)}; accepted: {_bound_text(limit)}")
    return cfg, p


def read_hf_config(path: str | Path, implementation: bool = False) -> dict[str, Any]:
    """ModelSpec keyword arguments from a Hugging Face config.json (a file, or a folder holding one).

    Returns name, layers, hidden, heads, kv_heads, ffn_hidden, vocab, max_positions, mlp, norm,
    position, tie_embeddings, linear_bias, qkv_bias, source; with `implementation` also hf_model_type,
    activation, attn_dropout, resid_dropout, embed_dropout, sliding_window, rotary_dim (module
    docstring). Raises ValueError with a one-line message for a missing file, invalid JSON, an
    unsupported model_type, or a missing or invalid key.
    """
    cfg, p = load_hf_config(path)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _fail(f"model_type {short_repr(model_type)} in '{p}' is not supported; accepted: "
                    f"{', '.join(SUPPORTED_MODEL_TYPES)}")

    def get_int(key: str, default: Any = ...) -> int:
        if key not in cfg or cfg[key] is None:
            if default is ...:
                raise _fail(f"'{p}' (model_type {model_type}) lacks key '{key}'")
            return default
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or (
                key in _SIZE_KEYS and v > LIMITS[_SIZE_KEYS[key]][1]):
            accepted = _bound_text(_SIZE_KEYS[key]) if key in _SIZE_KEYS else "a positive integer"
            raise _fail(f"'{p}' key '{key}' is {short_repr(v)}; accepted: {accepted}")
        return v

    def get_bool(key: str, default: bool) -> bool:
        v = cfg.get(key, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise _fail(f"'{p}' key '{key}' is {short_repr(v)}; accepted: true or false")
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
    elif model_type == "gemma2":
        out = _gemma2(cfg, p, get_int, get_bool)
    elif model_type == "qwen3":
        out = _qwen3(cfg, p, get_int, get_bool)
    else:
        hidden = get_int("hidden_size")
        heads = get_int("num_attention_heads")
        act = cfg.get("hidden_act", "silu")
        if act not in _GATED_ACTS:
            raise _fail(f"'{p}' key 'hidden_act' is {short_repr(act)}; accepted for {model_type}: "
                        f"{', '.join(_GATED_ACTS)} (a gated SwiGLU MLP)")
        head_dim = cfg.get("head_dim")
        if head_dim is not None and hidden % heads == 0 and head_dim != hidden // heads:
            raise _fail(f"'{p}' key 'head_dim' is {short_repr(head_dim)} but hidden_size/num_attention_heads is "
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
    if implementation:
        out.update(_implementation(cfg, model_type, out, p, get_int, get_bool))
    if out["hidden"] % out["heads"] and not out.get("head_dim_override"):
        raise _fail(f"'{p}': {out['heads']} heads do not divide hidden size {out['hidden']}")
    if out["heads"] % out["kv_heads"]:
        raise _fail(f"'{p}': {out['kv_heads']} key/value heads do not divide {out['heads']} heads")
    return {"name": f"hf:{path}", **out,
            "source": f"{p} (Hugging Face config.json, model_type {model_type})"}


def _explicit_heads(model_type: str, p: Path, get_int, get_bool, hidden: int, heads: int,
                    head_dim: int) -> tuple[int, int, int]:
    """(hidden_size, num_attention_heads, head_dim) of a config with an explicit head_dim (the defaults are
    its config class's). Attention biases are refused: Gemma-2's and Qwen3's `attention_bias` puts one on
    q/k/v and o_proj alike, which ModelSpec (q/k/v only, or every Linear) cannot describe."""
    if get_bool("attention_bias", False):
        raise _fail(f"'{p}' has attention_bias=true; the planner supports {model_type} without attention biases")
    hidden, heads = get_int("hidden_size", hidden), get_int("num_attention_heads", heads)
    head_dim = get_int("head_dim", head_dim)
    if head_dim > LIMITS["hidden"][1]:
        raise _fail(f"'{p}' key 'head_dim' is {short_repr(head_dim)}; accepted: {_bound_text('hidden')}")
    return hidden, heads, head_dim


def _gemma2(cfg: dict, p: Path, get_int, get_bool) -> dict[str, Any]:
    """Gemma-2 (transformers `Gemma2Config` defaults, configuration_gemma2.py): a gated GELU MLP, RMSNorm
    with sandwich norms, RoPE, tied embeddings, an explicit head_dim, eager attention with logit
    soft-capping (`Gemma2PreTrainedModel._supports_sdpa = False`), final logit soft-capping."""
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in _GEMMA_ACTS:
        raise _fail(f"'{p}' key 'hidden_activation' is {short_repr(act)}; accepted for gemma2: "
                    f"{', '.join(_GEMMA_ACTS)} (one GELU op in the gated MLP)")
    if get_bool("use_bidirectional_attention", False):
        raise _fail(f"'{p}' has use_bidirectional_attention=true; the planner supports causal attention only")
    hidden, heads, head_dim = _explicit_heads("gemma2", p, get_int, get_bool, 2304, 8, 256)

    def cap(key: str, default: float) -> float:
        v = cfg.get(key, default)
        if v is None:
            return 0.0
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise _fail(f"'{p}' key '{key}' is {short_repr(v)}; accepted: a positive number or null")
        return float(v)

    return dict(
        layers=get_int("num_hidden_layers", 26), hidden=hidden, heads=heads,
        kv_heads=get_int("num_key_value_heads", 4), ffn_hidden=get_int("intermediate_size", 9216),
        vocab=get_int("vocab_size", 256000), max_positions=get_int("max_position_embeddings", 8192),
        mlp="swiglu", norm="rmsnorm", position="rope", tie_embeddings=get_bool("tie_word_embeddings", True),
        linear_bias=False, qkv_bias=False, sandwich_norms=True,
        head_dim_override=0 if head_dim * heads == hidden else head_dim,
        attn_softcap=cap("attn_logit_softcapping", 50.0), final_softcap=cap("final_logit_softcapping", 30.0),
    )


def _qwen3(cfg: dict, p: Path, get_int, get_bool) -> dict[str, Any]:
    """Qwen3 (transformers `Qwen3Config` defaults, configuration_qwen3.py): Qwen2's decoder without the q/k/v
    biases, with an RMSNorm over head_dim on q and on k (`Qwen3Attention.q_norm`/`k_norm`) and an explicit
    head_dim (default 128, which may differ from hidden_size / num_attention_heads: Qwen3-0.6B has 16 heads
    of 128 at width 1024)."""
    act = cfg.get("hidden_act", "silu")
    if act not in _GATED_ACTS:
        raise _fail(f"'{p}' key 'hidden_act' is {short_repr(act)}; accepted for qwen3: "
                    f"{', '.join(_GATED_ACTS)} (a gated SwiGLU MLP)")
    hidden, heads, head_dim = _explicit_heads("qwen3", p, get_int, get_bool, 4096, 32, 128)
    return dict(
        layers=get_int("num_hidden_layers", 32), hidden=hidden, heads=heads,
        kv_heads=get_int("num_key_value_heads", heads), ffn_hidden=get_int("intermediate_size", 22016),
        vocab=get_int("vocab_size", 151936), max_positions=get_int("max_position_embeddings", 32768),
        mlp="swiglu", norm="rmsnorm", position="rope", tie_embeddings=get_bool("tie_word_embeddings", False),
        linear_bias=False, qkv_bias=False, qk_norm=True,
        head_dim_override=0 if head_dim * heads == hidden else head_dim,
    )


_GPT2_ACTS = {"gelu_new": "gelu_new", "gelu": "", "gelu_pytorch_tanh": ""}
"""GPT-2 activation_function -> ModelSpec.activation: transformers' `ACT2FN` maps gelu_new to
`NewGELUActivation` (activations.py; the tanh formula in Python ops), gelu to `GELUActivation`
(`F.gelu`) and gelu_pytorch_tanh to `F.gelu(approximate="tanh")`: one op that saves its input."""


def _implementation(cfg: dict, model_type: str, arch: dict, p: Path, get_int, get_bool) -> dict[str, Any]:
    """The ModelSpec fields that say how transformers' `model_type` forward differs from the reference
    decoder (the defaults of every config class as in transformers' configuration_<type>.py)."""

    def prob(key: str, default: float) -> float:
        v = cfg.get(key, default)
        if v is None:
            v = default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
            raise _fail(f"'{p}' key '{key}' is {short_repr(v)}; accepted: a probability in [0, 1)")
        return float(v)

    out: dict[str, Any] = {"hf_model_type": model_type, "activation": "", "attn_dropout": 0.0,
                           "resid_dropout": 0.0, "embed_dropout": 0.0, "sliding_window": 0,
                           "rotary_dim": 0}
    if model_type == "gpt2":
        act = cfg.get("activation_function", "gelu_new")  # GPT2Config default
        if not isinstance(act, str) or act not in _GPT2_ACTS:
            raise _fail(f"'{p}' key 'activation_function' is {short_repr(act)}; accepted for gpt2: "
                        f"{', '.join(_GPT2_ACTS)}")
        # GPT2Attention.attn_dropout (SDPA's dropout_p), .resid_dropout, GPT2MLP.dropout, GPT2Model.drop
        out.update(activation=_GPT2_ACTS[act], attn_dropout=prob("attn_pdrop", 0.1),
                   resid_dropout=prob("resid_pdrop", 0.1), embed_dropout=prob("embd_pdrop", 0.1))
        return out
    out["attn_dropout"] = prob("attention_dropout", 0.0)
    if model_type == "gemma2":
        # eager attention computes every score whatever the window (the sliding layers only mask more):
        # the window changes no saved tensor and no FLOP, so it is not carried
        return out
    if model_type == "phi3":
        # Phi3DecoderLayer.resid_attn_dropout/resid_mlp_dropout; Phi3Model has no embedding dropout.
        out["resid_dropout"] = prob("resid_pdrop", 0.0)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        factor = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0) if isinstance(rope, dict) else 1.0)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise _fail(f"'{p}' key 'partial_rotary_factor' is {short_repr(factor)}; accepted: a number in (0, 1]")
        head_dim = arch["hidden"] // arch["heads"]
        dim = int(head_dim * factor)  # Phi3RotaryEmbedding: int(head_dim * partial_rotary_factor)
        out["rotary_dim"] = 0 if dim == head_dim else dim
        out["sliding_window"] = get_int("sliding_window", 0)  # Phi3Config default None
    elif model_type == "mistral":
        # MistralConfig: sliding_window defaults to 4096; null means full attention
        out["sliding_window"] = 4096 if "sliding_window" not in cfg else get_int("sliding_window", 0)
    elif model_type in ("qwen2", "qwen3"):
        # Qwen2Config.__post_init__ (and Qwen3Config's, the same): sliding_window only with use_sliding_window, then on the layers
        # from max_window_layers (default 28) on, unless layer_types names each layer's kind.
        window = 4096 if "sliding_window" not in cfg else get_int("sliding_window", 0)
        if get_bool("use_sliding_window", False) and window:
            types = cfg.get("layer_types")
            if types is None:
                first = cfg.get("max_window_layers", 28)
                if isinstance(first, bool) or not isinstance(first, int) or first < 0:
                    raise _fail(f"'{p}' key 'max_window_layers' is {short_repr(first)}; accepted: an integer >= 0")
                types = ["sliding_attention" if i >= first else "full_attention" for i in range(arch["layers"])]
            if not isinstance(types, list):
                raise _fail(f"'{p}' key 'layer_types' is {short_repr(types)}; accepted: a list of layer kinds")
            if not all(isinstance(t, str) for t in types):
                raise _fail(f"'{p}' key 'layer_types' holds {short_repr([t for t in types if not isinstance(t, str)][0])}; "
                            f"accepted: layer kinds such as 'full_attention'")
            kinds = set(types)
            if kinds == {"sliding_attention"}:
                out["sliding_window"] = window
            elif kinds != {"full_attention"}:
                raise _fail(f"'{p}' has a sliding window on some layers only (layer_types / "
                            f"max_window_layers); the planner needs every layer alike")
    return out
