"""The Plan of the command line's flags (`build_plan`), for `estimate`, `recommend` and `sweep`: checked
(front_end.check_flags), then planned by the trace front end (api.traced_plan) or the analytic one
(api.plan), or by api.recommend where the layout is searched (the analytic front end for every layout, the
trace's check of the data-parallel one)."""

from __future__ import annotations

from .api import plan, recommend as plan_with_layout_search, traced_plan
from .front_end import check_flags, use_trace
from .strategies import NAMES


def build_plan(kw: dict, strategies=(), detect_local=True, comm=True, search=False):
    """The Plan of the flags in `kw`. `search` (recommend): search the parallel layout over the mesh
    flags the user did not give (`kw["given"]`, the set of flag names given; layout.py)."""
    strategies = check_flags(kw, strategies)
    if kw.get("module") or (not search and use_trace(kw)):
        return traced_plan(kw, strategies)
    overrides = {k: kw.get(k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab",
                                         "tie_embeddings")}
    for s in strategies:
        if s not in NAMES:
            raise ValueError(f"--strategy={s!r}: accepted: {', '.join(NAMES)}")
    call = plan_with_layout_search if search else plan
    if search:
        given = kw.get("given") or set()
        mesh = {"tp": kw.get("tp") if "tp" in given else None, "pp": kw.get("pp") if "pp" in given else None,
                "sequence_parallel": True if kw.get("sequence_parallel") else None,
                # every layout judged by the analytic front end; the trace checks the data-parallel one
                "front_end": (kw.get("front_end") or "auto") if kw.get("hf_config") else "analytic"}
    else:
        mesh = {"tp": kw.get("tp") or 1, "pp": kw.get("pp") or 1,
                "sequence_parallel": bool(kw.get("sequence_parallel")), "comm": comm}
    return call(kw.get("model"), params=kw.get("params"), hf_config=kw.get("hf_config"),
                gpus=kw.get("gpus"), gpus_per_node=kw.get("gpus_per_node"), gpu=kw.get("gpu"),
                gpu_mem=kw.get("gpu_mem"), node=kw.get("node"), intra=kw.get("intra"), inter=kw.get("inter"),
                nics_per_node=kw.get("nics_per_node"), inter_gbps=kw.get("inter_gbps"),
                seq_len=kw["seq_len"], micro_batch=kw["micro_batch"], grad_accum=kw["grad_accum"],
                grad_sync=kw.get("grad_sync") or "last", precision=kw["precision"], optimizer=kw["optimizer"], optimizer_impl=kw["optimizer_impl"],
                activation_checkpointing=kw["activation_checkpointing"], attention=kw["attention"],
                attention_kernel=kw.get("attention_kernel") or "flash", cpu_offload=kw["cpu_offload"], framework=kw["framework"], compile=kw.get("compile_", False),
                alloc_conf=kw.get("alloc_conf") or "", torch_version=kw.get("torch_version") or "",
                pp_schedule=kw.get("pp_schedule") or "1f1b", pp_microbatches=kw.get("pp_microbatches"),
                cp=kw.get("cp") or 1, strategies=list(strategies) or None,
                tokens=kw.get("tokens"), checkpoint=kw.get("checkpoint"), storage_gbps=kw.get("storage_gbps"),
                detect_local=detect_local, headroom=kw.get("headroom"), **mesh,
                catalog_dirs=tuple(kw.get("catalog_dirs") or ()), **overrides)
