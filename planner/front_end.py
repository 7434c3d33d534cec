"""Which front end plans a run: the analytic one (the decoder formulas, pure Python) or the trace (the
transformers model run on fake tensors: module_plan.py), and the flags' checks before either runs.

Below both `api` and `cli`: `api.plan(front_end=...)` and the command line choose alike.
"""

from __future__ import annotations

import importlib.util

from .hf_config import load_hf_config
from .strategies import NAMES
from .units import check_count, short_repr

FRONT_ENDS = ("auto", "analytic", "trace")


def analytic_only(kw: dict) -> str | None:
    """The first flag in `kw` that only the analytic front end models (the parallel layouts and the
    checkpoint save), as the user wrote it; None when there is none."""
    if (kw.get("tp") or 1) > 1 or kw.get("sequence_parallel"):
        return f"--tp={kw.get('tp') or 1}"
    for flag in ("pp", "cp"):
        if (kw.get(flag) or 1) > 1:
            return f"--{flag}={kw[flag]}"
    if kw.get("checkpoint") or kw.get("storage_gbps") is not None:
        return f"--checkpoint={kw.get('checkpoint')}"
    if (kw.get("attention_kernel") or "flash") != "flash":
        return f"--attention-kernel={kw['attention_kernel']}"
    return None


def use_trace(kw: dict) -> bool:
    """Whether --hf-config is planned by the trace (`--front-end`; 'auto': when torch and transformers
    are installed, found without importing them, and no flag asks for what only the analytic front end
    models: --tp, --pp, --cp, --checkpoint)."""
    fe = kw.get("front_end") or "auto"
    if not kw.get("hf_config") or fe == "analytic" or (fe == "auto" and analytic_only(kw)):
        return False
    have = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
    if fe == "trace" and not have:
        raise ValueError("--front-end=trace: needs torch and transformers (pip install 'distplan[hf]'); "
                         "or use --front-end analytic")
    return have


def check_flags(kw: dict, strategies=()) -> list[str]:
    """The strategy names of `strategies` (repeatable or comma-separated flags), once the flags in `kw` are
    checked: every count bounded, every strategy a registry name, the --hf-config readable; before any
    work, on either front end."""
    # repeatable or comma-separated, as validate takes them (`--strategy zero3,fsdp`)
    strategies = [x.strip() for s in strategies for x in s.split(",")]
    for flag in ("gpus", "gpus_per_node", "nics_per_node", "seq_len", "micro_batch", "grad_accum", "tp", "pp",
                 "pp_microbatches", "cp",
                 "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab"):
        if kw.get(flag) is not None:  # each bounded to what exists (units.LIMITS), before any work
            check_count(flag, kw[flag])
    for s in strategies:  # a name is echoed cut to 60 characters, on the trace path too
        if s not in NAMES:
            raise ValueError(f"--strategy={short_repr(s)}: accepted: {', '.join(NAMES)}")
    if kw.get("hf_config") is not None:  # its sizes too, before the trace imports torch
        load_hf_config(kw["hf_config"])
    return strategies


def check_traceable(kw: dict) -> None:
    """A one-line ValueError when `kw` asks the trace front end for what only the analytic one models."""
    flag = analytic_only(kw)
    if flag:
        what = {"--tp": "tensor parallelism", "--pp": "pipeline parallelism", "--cp": "context parallelism",
                "--checkpoint": "the checkpoint save",
                "--attention-kernel": "an attention kernel other than the traced model's"}[flag.split("=")[0]]
        raise ValueError(f"{flag}: {what} is modelled by the analytic front end only; with --hf-config drop "
                         f"--front-end trace (auto picks the analytic front end for it; --module: not supported)")
