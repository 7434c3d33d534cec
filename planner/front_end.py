"""Which front end plans a run: the analytic one (the decoder formulas, pure Python) or the trace (the
transformers model run on fake tensors: module_plan.py), and the flags' checks before either runs.

Below both `api` and `cli`: `api.plan(front_end=...)` and the command line choose alike.
"""

from __future__ import annotations

import importlib.util

from .hf_config import SUPPORTED_MODEL_TYPES, load_hf_config
from .strategies import NAMES
from .units import check_count, short_repr

FRONT_ENDS = ("auto", "analytic", "trace")

DEVICES = ("cuda", "cpu")
"""The targets a plan follows (`--device`): "cuda", what PyTorch runs on a catalog GPU (NVIDIA's, and AMD's
through ROCm, which PyTorch also names "cuda"): CUDA's kernels, autocast lists (workload/cuda_autocast.py),
optimizer defaults, library workspaces and caching allocator; "cpu", the same step on the CPU, as the CPU
probes of `distplan validate` run it (the CPU's kernels and autocast lists, no caching allocator)."""
BACKEND = {"cuda": "nccl", "cpu": "gloo"}
"""The process-group backend each target's collectives run on (the device footprint follows it)."""


def planned_device(kw: dict) -> str:
    """The target of a plan: `--device` where given, else the GPU's: every catalog GPU runs PyTorch's
    "cuda" device, so "cuda". A ValueError naming the flag for any other value."""
    device = kw.get("device") or "cuda"
    if device not in DEVICES:
        raise ValueError(f"--device={short_repr(device)}: accepted values are {', '.join(DEVICES)}")
    return device


def default_optimizer_impl(device: str) -> str:
    """PyTorch's default implementation of Adam/AdamW/SGD on the target: foreach where every parameter is on a
    device with foreach kernels ("cuda"), else the for-loop (torch/optim/optimizer.py
    `_default_to_fused_or_foreach`; torch/utils/_foreach_utils.py `_get_foreach_kernels_supported_devices`)."""
    return "foreach" if device == "cuda" else "for-loop"


def target_line(device: str) -> str:
    """The plan's header line naming its target."""
    if device == "cpu":
        return ("target: cpu (--device): the CPU's kernels and autocast lists, as the CPU probes run the step; "
                "(the reserved peak still replays CUDA's caching allocator)")
    return ("target: cuda (--device): CUDA's kernels, autocast lists, optimizer defaults, library workspaces "
            "and caching allocator")


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


def unread_model_type(hf_config) -> str | None:
    """The config's model_type where the analytic front end does not read it (hf_config.SUPPORTED_MODEL_TYPES),
    else None: what decides whether a traced model's layout can be searched (api.recommend)."""
    model_type = load_hf_config(hf_config)[0].get("model_type")
    return None if model_type in SUPPORTED_MODEL_TYPES else str(model_type)


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
    if planned_device(kw) != "cuda" and not (kw.get("module") or use_trace(kw)):
        raise ValueError(f"--device={kw['device']}: the analytic front end plans CUDA's kernels only; the CPU "
                         f"target is planned by the trace front end (--hf-config with --front-end trace, or --module)")
    if not kw.get("optimizer_impl"):  # (a caller's kw without it: api.plan's default)
        kw["optimizer_impl"] = default_optimizer_impl(planned_device(kw))
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
