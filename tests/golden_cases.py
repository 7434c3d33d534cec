"""Golden answers of the planner: the configurations, how each is answered, and the recorded data.

RULE: the numbers in tests/data/golden/ are the planner's answers at the commit that wrote them. A change to any
golden number is made only by regenerating with

    .venv/bin/python -m tests.golden_cases --write          (or: python tests/golden_cases.py --write)

in a commit whose message says which bug the change fixes and which probe (benchmarks/results/*.jsonl record, or
a new measurement) shows it. A refactor that is meant to preserve behaviour never regenerates: if
tests/test_golden.py fails, the refactor changed an answer.

What is recorded, per configuration (`case`):
- call "plan": `distplan.planner.plan(**kwargs).to_dict()`, the `estimate --json` contract (every strategy's memory
  components, peak_allocated, peak_reserved, device_total and footprint, fits, peak_phase, collectives with their
  bytes and times, step time, tokens/s, MFU, checkpoint save, notes, and the recommendation); the analytic front end
  and, with `front_end="trace"`, the transformers model traced on fake tensors (needs torch + transformers).
- call "recommend": `distplan.planner.api.recommend(**kwargs).to_dict()` (the layout search).
- call "cli": `distplan estimate ... --json` in-process (click's CliRunner), for `--module` (no API keyword).
- call "record": `predict_probe(record_spec(record))` of every committed probe record in benchmarks/results/*.jsonl,
  keyed by file and line (the pipeline probes' early records hold their spec as "spec" and the torch they ran on
  as "torch": predicted from those, for their most loaded rank as `predict_probe` gives it); call "record_analytic": the same record predicted by the analytic front end from its
  Hugging Face config (as tests/test_analytic_on_hf.py does).
A configuration the planner refuses is recorded as its error: {"error": exception type, "message": first line}.

Everything is compared exactly: ints and strings as they are, floats by repr (the JSON file stores the shortest
repr, which round-trips), the leaf's type too (an int that becomes a float is a change). Left out as not answers:
wall-clock timings (VOLATILE_KEYS: the layout search's `seconds` / `cpu_seconds`, and VOLATILE_TEXT: the same
timings in the search's reason line). The repository root is written
as "<root>" where a path holds it. The environment variables the planner reads (DISTPLAN_CATALOG,
PYTORCH_CUDA_ALLOC_CONF through the CLI, NCCL_* through the device footprint) are cleared while answering, except
where a case sets NCCL ones itself; every case runs from the repository root (records name examples/hf/...).
Caches (`clear_caches`) are cleared at the start of every family; tests/test_golden.py also answers a sample of
cases cold (caches cleared before each) to show no answer depends on what ran before it.

Layout of the data: tests/data/golden/<group>.json.gz, one per group (GROUPS: which families each holds), each
{"format": 1, "cases": [{"id", "family", "call", "kwargs", "answer"}, ...]}.

    python -m tests.golden_cases --write [--group NAME ...]   regenerate (all groups, or those named)
    python -m tests.golden_cases --check [--group NAME ...]   compare without writing; prints the differences
    python -m tests.golden_cases --list                       configurations per family
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import importlib
import inspect
import io
import json
import math
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(ROOT, "tests", "data", "golden")
FORMAT = 1

VOLATILE_KEYS = frozenset({"seconds", "cpu_seconds", "profile_s"})
"""Keys whose values are wall-clock timings of the planner itself (layout.LayoutSearch), not answers."""
VOLATILE_TEXT = ((re.compile(r"in \d+(?:\.\d+)? s \(\d+(?:\.\d+)? s of CPU\)"), "in <s> s (<s> s of CPU)"),)
"""The same timings where prose states them (the layout search's reason line: "... configurations in 0.67 s
(0.67 s of CPU)"): the only thing found to differ run to run (two runs, PYTHONHASHSEED 0 and 123)."""

SCRUBBED_ENV = ("DISTPLAN_CATALOG", "PYTORCH_CUDA_ALLOC_CONF", "COLUMNS")
SCRUBBED_PREFIXES = ("NCCL_",)

TV = "2.13"
"""The torch release the analytic cases follow (explicit: the default is the installed torch's)."""


# -- where the public names live (one line to change if a refactor moves them) ------------------------------

def _load(*candidates: str):
    """The first importable `module:attr` of `candidates`; ImportError naming them all."""
    errors = []
    for c in candidates:
        mod, _, attr = c.partition(":")
        try:
            obj = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{c}: {exc}")
            continue
        if callable(obj) and not inspect.ismodule(obj):  # a package's submodule of that name is not it
            return obj
        errors.append(f"{c}: {obj!r} is not a function")
    raise ImportError("golden_cases: none of these import; point the candidates at the new place:\n  "
                      + "\n  ".join(errors))


def api():
    return {
        "plan": _load("distplan.planner:plan"),
        "clear_caches": _load("distplan.planner:clear_caches"),
        "resolve_model": _load("distplan.planner:resolve_model"),
        "recommend": _load("distplan.planner:recommend", "distplan.planner.api:recommend"),  # the layout search
        "predict_probe": _load("distplan.planner:predict_probe", "distplan.planner.api:predict_probe"),
    }


def _record_spec():
    return _load("distplan.validate:record_spec", "distplan.validate.results:record_spec")


def _cli_main():
    return _load("distplan.planner:cli_main", "distplan.planner.cli:main")


# -- the configurations ---------------------------------------------------------------------------------------

NAMES = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op", "hsdp", "fsdp-no-shard")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adamw-8bit", "adafactor")
CHECKPOINTING = ("none", "selective", "selective-op", "full", "every-2", "every-3", "every-4")
HF_DIR = "tests/data/hf"
HF_CONFIGS = tuple(sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, HF_DIR, "*.json"))))
CATALOG_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-2-7b", "llama-2-13b", "llama-2-34b",
                  "llama-2-70b", "llama-3-8b", "llama-3-70b", "llama-3-405b", "mistral-7b", "mpt-7b", "mpt-30b",
                  "mpt-70b", "phi-3-mini", "qwen2.5-7b")
GPUS = ("a10", "a100-40gb-pcie", "a100-40gb", "a100-80gb-pcie", "a100-80gb", "b200", "h100-pcie",
        "h100-sxm-96gb-hbm2e", "h100-sxm", "h200", "l4", "l40s", "mi250x", "mi300x", "t4", "v100-16gb", "v100-32gb")
NODES = ("aws-p4d", "aws-p5", "aws-p6-b200", "dgx-a100", "dgx-b200", "dgx-h100", "gcp-a3", "generic-ethernet",
         "hgx-h200", "l40s-8x-pcie")
INTRA = ("nvlink2", "nvlink3", "nvlink4", "nvlink5", "pcie3", "pcie4", "pcie5", "xgmi")
INTER = ("aws-efa-100g", "aws-efa-400g", "eth-100g-roce", "eth-100g-tcp", "eth-200g-roce", "eth-200g-tcp",
         "eth-25g-roce", "eth-25g-tcp", "eth-400g-roce", "eth-400g-tcp", "ib-hdr", "ib-ndr", "ib-xdr")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv")
PP_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
ALLOC_CONFS = ("expandable_segments:True", "expandable_segments:False", "max_split_size_mb:128",
               "max_split_size_mb:512", "garbage_collection_threshold:0.8,max_split_size_mb:256",
               "roundup_power2_divisions:4", "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
               "expandable_segments:True,roundup_power2_divisions:2", "max_non_split_rounding_mb:512",
               "backend:cudaMallocAsync", "release_lock_on_cudamalloc:True,expandable_segments:True",
               "max_split_size_mb:max")


def _case(family: str, call: str, kwargs: dict, cid: str | None = None) -> dict:
    return {"id": cid or f"{family}/" + ",".join(f"{k}={_short(v)}" for k, v in kwargs.items()),
            "family": family, "call": call, "kwargs": kwargs}


def _short(v) -> str:
    if isinstance(v, (list, tuple)):
        return "+".join(map(str, v))
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{x}" for k, x in v.items()) + "}"
    return str(v)


MAX_POSITIONS = (("gpt2", 1024), ("mpt", 2048))
"""Models with learned positions shorter than the default 2048 tokens: their cases run at most that."""


def _fit_positions(kw: dict) -> dict:
    name = str(kw.get("model") or kw.get("hf_config") or "")
    for stem, limit in MAX_POSITIONS:
        if os.path.basename(name).startswith(stem):
            kw["seq_len"] = min(kw.get("seq_len") or limit, limit)
    return kw


def _plan(family: str, **kw) -> dict:
    kw.setdefault("torch_version", TV)
    return _case(family, "plan", _fit_positions(kw))


def _one(s: str, gpus: int = 8) -> dict:
    """One strategy, on one GPU for `single`."""
    return {"strategies": [s], "gpus": 1 if s == "single" else gpus}


def fam_strategy_precision_optimizer() -> list[dict]:
    models = ("llama-3-8b", "gpt2-xl", "phi-3-mini")
    out, i = [], 0
    for s in NAMES:
        for prec in PRECISIONS:
            for opt in OPTIMIZERS:
                out.append(_plan("strategy_precision_optimizer", model=models[i % 3], precision=prec, optimizer=opt,
                                 **_one(s)))
                i += 1
    return out


def fam_optimizer_impl() -> list[dict]:
    out = []
    for impl in ("foreach", "fused", "for-loop"):
        for opt in ("adamw", "sgd-momentum", "adafactor", "adamw-8bit"):
            for prec in ("bf16-mixed", "fp32"):
                out.append(_plan("optimizer_impl", model="llama-2-7b", optimizer=opt, optimizer_impl=impl,
                                 precision=prec, gpus=16))
    return out


def fam_deepspeed() -> list[dict]:
    out = []
    for off in ("none", "optimizer", "params"):
        for prec in ("bf16-mixed", "fp16-mixed", "fp32"):
            for opt in ("adamw", "sgd-momentum"):
                for gpus in (8, 64):
                    out.append(_plan("deepspeed", model="llama-3-8b", framework="deepspeed", cpu_offload=off,
                                     precision=prec, optimizer=opt, gpus=gpus,
                                     strategies=["zero1", "zero2", "zero3"]))
    for s in ("zero1", "zero2", "zero3"):
        for model in ("gpt2-xl", "llama-2-13b", "mpt-30b"):
            for accum, mb in ((1, 1), (4, 2)):
                out.append(_plan("deepspeed", model=model, framework="deepspeed", grad_accum=accum, micro_batch=mb,
                                 activation_checkpointing="full", strategies=[s], gpus=32))
    # the default strategy list under DeepSpeed, and the layouts it refuses
    out.append(_plan("deepspeed", params="7B", framework="deepspeed", gpus=8))
    out.append(_plan("deepspeed", params="70B", framework="deepspeed", gpus=64, cpu_offload="optimizer"))
    out.append(_plan("deepspeed", params="7B", framework="deepspeed", gpus=8, tp=2))
    out.append(_plan("deepspeed", params="7B", framework="deepspeed", gpus=8, pp=2))
    return out


def fam_cpu_offload() -> list[dict]:
    out = []
    for s in NAMES:
        for off in ("optimizer", "params"):
            for prec in ("bf16-mixed", "fp32"):
                for accum in (1, 2):
                    out.append(_plan("cpu_offload", model="llama-3-8b" if accum == 1 else "mistral-7b",
                                     cpu_offload=off, precision=prec, grad_accum=accum, **_one(s)))
    out.append(_plan("cpu_offload", params="70B", cpu_offload="params", gpus=16, node="dgx-h100"))
    out.append(_plan("cpu_offload", params="70B", cpu_offload="optimizer", gpus=16, node="dgx-a100"))
    return out


def fam_models() -> list[dict]:
    out = []
    for p in ("1M", "125M", "350M", "1.3B", "3B", "7B", "13B", "30B", "70B", "175B", "405B", "1T", "2.5e9", 7_000_000_000):
        out.append(_plan("models", params=p, gpus=64, strategies=["ddp", "zero3", "fsdp"]))
    out.append(_plan("models", gpus=8))  # no model given: 7B assumed
    for m in CATALOG_MODELS:
        out.append(_plan("models", model=m, gpus=16))
        out.append(_plan("models", model=m, gpus=64, seq_len=4096, activation_checkpointing="full",
                         strategies=["zero3", "hsdp"]))
    for h in HF_CONFIGS:
        out.append(_plan("models", hf_config=f"{HF_DIR}/{h}", gpus=8))
        out.append(_plan("models", hf_config=f"{HF_DIR}/{h}", front_end="analytic", gpus=16, seq_len=1024,
                         micro_batch=2, precision="fp32", strategies=["ddp", "zero2", "fsdp-grad-op"]))
    for ov in ({"layers": 8}, {"hidden": 2048, "heads": 16}, {"kv_heads": 4}, {"ffn_hidden": 8192},
               {"vocab": 256000}, {"tie_embeddings": True}, {"tie_embeddings": False},
               {"layers": 40, "hidden": 5120, "heads": 40, "kv_heads": 8, "ffn_hidden": 13824}):
        out.append(_plan("models", model="llama-3-8b", gpus=8, strategies=["ddp", "zero3"], **ov))
    out.append(_plan("models", hf_config=f"{HF_DIR}/gpt2.json", gpus=8, layers=4, strategies=["zero3"]))
    return out


def fam_tp_sp() -> list[dict]:
    out = []
    for model, gpus in (("llama-3-8b", 16), ("llama-3-70b", 64), ("qwen2.5-7b", 8)):
        for tp in (2, 4, 8):
            for sp in (False, True):
                out.append(_plan("tp_sp", model=model, gpus=gpus, tp=tp, sequence_parallel=sp,
                                 strategies=["ddp", "zero2", "zero3", "fsdp"] if gpus > tp else None))
    for tp in (2, 4):
        for ac in ("full", "selective", "every-2"):
            out.append(_plan("tp_sp", model="llama-3-8b", gpus=16, tp=tp, sequence_parallel=True,
                             activation_checkpointing=ac, precision="bf16-mixed", strategies=["zero3"]))
    for h in ("llama-3-8b.json", "qwen3-8b.json", "mistral-7b.json"):
        out.append(_plan("tp_sp", hf_config=f"{HF_DIR}/{h}", gpus=16, tp=2, strategies=["zero3", "ddp"]))
    return out


def fam_pp() -> list[dict]:
    out = []
    for sched in PP_SCHEDULES:
        for pp in (2, 4):
            for mbs in (None, 8):
                out.append(_plan("pp", model="llama-3-8b", gpus=16, pp=pp, pp_schedule=sched, pp_microbatches=mbs,
                                 strategies=list(PP_STRATEGIES)))
    for sched in PP_SCHEDULES:
        out.append(_plan("pp", model="llama-3-70b", gpus=64, pp=4, tp=4, pp_schedule=sched, pp_microbatches=16,
                         activation_checkpointing="full", strategies=["zero3", "ddp"]))
        out.append(_plan("pp", model="llama-2-7b", gpus=8, pp=8, pp_schedule=sched, strategies=["single"]))
    out.append(_plan("pp", model="llama-3-8b", gpus=16, pp=2))  # the default strategy list under PP
    out.append(_plan("pp", model="llama-3-8b", gpus=16, pp=2, strategies=["fsdp"]))  # refused
    return out


def fam_cp() -> list[dict]:
    out = []
    for cp in (2, 4, 8):
        for seq in (8192, 32768):
            out.append(_plan("cp", model="llama-3-8b", gpus=16, cp=cp, seq_len=seq,
                             strategies=["ddp", "zero2", "zero3", "fsdp", "hsdp"]))
    out.append(_plan("cp", model="llama-3-70b", gpus=64, cp=2, tp=4, seq_len=16384, strategies=["zero3"]))
    out.append(_plan("cp", model="llama-3-8b", gpus=16, cp=2, pp=2, seq_len=8192, strategies=["zero3", "ddp"]))
    out.append(_plan("cp", model="llama-3-8b", gpus=16, cp=2, seq_len=8192, activation_checkpointing="full",
                     strategies=["zero3"]))
    out.append(_plan("cp", model="llama-3-8b", gpus=16, cp=2, seq_len=8192, attention="eager", strategies=["zero3"]))
    out.append(_plan("cp", model="llama-3-8b", gpus=16, cp=2, seq_len=8192, strategies=["single"]))
    return out


def fam_grad_accum() -> list[dict]:
    out = []
    for s in NAMES:
        for accum in (1, 2, 4, 8):
            for sync in ("last", "every"):
                out.append(_plan("grad_accum", model="mistral-7b", grad_accum=accum, grad_sync=sync,
                                 precision="bf16-mixed" if accum != 4 else "fp32", **_one(s, 16)))
    return out


def fam_activation_checkpointing() -> list[dict]:
    out = []
    models = ("llama-3-8b", "gpt2-medium", "phi-3-mini")
    for i, s in enumerate(NAMES):
        for ac in CHECKPOINTING:
            out.append(_plan("activation_checkpointing", model=models[i % 3], activation_checkpointing=ac,
                             micro_batch=2, **_one(s)))
    for h in HF_CONFIGS:
        for ac in CHECKPOINTING:
            out.append(_plan("activation_checkpointing", hf_config=f"{HF_DIR}/{h}", activation_checkpointing=ac,
                             gpus=8, strategies=["zero3", "fsdp"]))
    return out


def fam_alloc_conf() -> list[dict]:
    out = []
    for conf in ALLOC_CONFS:
        out.append(_plan("alloc_conf", model="llama-3-8b", gpus=8, alloc_conf=conf,
                         strategies=["ddp", "zero2", "zero3", "fsdp"]))
        out.append(_plan("alloc_conf", model="gpt2-xl", gpus=1, alloc_conf=conf, micro_batch=4,
                         strategies=["single"]))
    for conf in ("expandable_segments:True", "max_split_size_mb:256"):
        out.append(_plan("alloc_conf", model="llama-3-8b", gpus=16, tp=2, alloc_conf=conf, strategies=["zero3"]))
        out.append(_plan("alloc_conf", model="llama-3-8b", gpus=16, pp=2, alloc_conf=conf, strategies=["zero3"]))
        out.append(_plan("alloc_conf", model="llama-3-8b", gpus=16, grad_accum=4, alloc_conf=conf,
                         activation_checkpointing="full", strategies=["fsdp", "zero3"]))
    for bad in ("expandable_segments:yes", "max_split_size_mb:10", "no_such_key:1", "garbage_collection_threshold:2"):
        out.append(_plan("alloc_conf", model="llama-3-8b", gpus=8, alloc_conf=bad))
    return out


def fam_checkpoint_save() -> list[dict]:
    out = []
    for mode in ("full", "full-offload", "sharded"):
        for storage in (None, 0.5, 20.0):
            for s in NAMES:
                if storage == 0.5 and s in ("zero1", "fsdp-no-shard", "hsdp"):
                    continue
                out.append(_plan("checkpoint_save", model="llama-3-8b", checkpoint=mode, storage_gbps=storage,
                                 **_one(s, 16)))
    out.append(_plan("checkpoint_save", model="llama-3-70b", gpus=64, checkpoint="sharded", tp=4, pp=2))
    out.append(_plan("checkpoint_save", model="llama-3-8b", gpus=8, storage_gbps=2.0))  # refused
    return out


def fam_shapes() -> list[dict]:
    out = []
    i = 0
    for mb in (1, 2, 4, 8, 16):
        for seq in (512, 2048, 8192, 32768):
            out.append(_plan("shapes", model="llama-3-8b", micro_batch=mb, seq_len=seq,
                             **_one(NAMES[1 + i % 8], 16)))
            i += 1
    for gpus in (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096):
        out.append(_plan("shapes", model="llama-3-70b", gpus=gpus,
                         strategies=None if gpus == 1 else ["ddp", "zero3", "hsdp"]))
    for node in NODES:
        out.append(_plan("shapes", model="llama-3-8b", node=node, gpus=16, strategies=["zero3", "hsdp", "ddp"]))
    for g in GPUS:
        out.append(_plan("shapes", model="llama-2-7b", gpu=g, gpus=8, strategies=["zero3", "ddp"]))
    for intra in INTRA:
        out.append(_plan("shapes", model="llama-3-8b", gpus=8, intra=intra, strategies=["zero3", "ddp"]))
    for inter in INTER:
        out.append(_plan("shapes", model="llama-3-8b", gpus=32, inter=inter, strategies=["zero3", "hsdp", "ddp"]))
    for mem in (24, "40GB", "80GiB", "141G", 192):
        out.append(_plan("shapes", model="llama-3-8b", gpus=8, gpu_mem=mem, strategies=["zero3", "fsdp"]))
    for nics in (1, 2, 4):
        out.append(_plan("shapes", model="llama-3-8b", gpus=32, nics_per_node=nics, strategies=["zero3", "ddp"]))
    for gbps in (100.0, 400.0, 3200.0):
        out.append(_plan("shapes", model="llama-3-8b", gpus=32, inter_gbps=gbps, strategies=["zero3", "ddp"]))
    for gpn in (2, 4):
        out.append(_plan("shapes", model="llama-3-8b", gpus=16, gpus_per_node=gpn, strategies=["hsdp", "zero3"]))
    return out


def fam_misc() -> list[dict]:
    out = []
    for att in ("sdpa", "eager"):
        for kern in ("flash", "flash-triton"):
            for comp in (False, True):
                out.append(_plan("misc", model="llama-3-8b", gpus=8, attention=att, attention_kernel=kern,
                                 compile=comp, strategies=["ddp", "zero3"]))
    for tv in ("2.11", "2.13", "2.14", "2.15", "2.16.0.dev20261101"):
        for s in ("zero2", "zero3", "fsdp"):
            out.append(_plan("misc", model="gpt2-medium", gpus=8, torch_version=tv, grad_accum=2,
                             precision="bf16-mixed", strategies=[s]))
        out.append(_plan("misc", model="llama-3-8b", gpus=16, torch_version=tv, pp=2, strategies=["zero3"]))
    for tokens in (1e9, "2T", 15e12):
        out.append(_plan("misc", model="llama-3-8b", gpus=64, tokens=tokens, strategies=["zero3", "ddp"]))
    out.append(_plan("misc", model="llama-3-8b", gpus=8, comm=False, strategies=["zero3", "ddp"]))
    out.append(_plan("misc", model="llama-3-8b", gpus=8, strategies="zero3"))
    return out


def fam_recommend() -> list[dict]:
    out = []
    for kw in (dict(model="llama-3-8b", gpus=8), dict(model="llama-3-8b", gpus=64, seq_len=8192),
               dict(model="llama-3-70b", gpus=64, node="dgx-h100"), dict(model="llama-3-70b", gpus=16, tp=8),
               dict(model="llama-3-405b", gpus=256, node="dgx-h100", seq_len=8192),
               dict(model="llama-2-13b", gpus=8, gpu="a100-40gb", micro_batch=4),
               dict(params="175B", gpus=128, node="aws-p5", pp=4),
               dict(model="gpt2-xl", gpus=4, gpu="l4"), dict(model="mistral-7b", gpus=16, node="generic-ethernet"),
               dict(model="llama-3-8b", gpus=16, tp=2, pp=1), dict(model="llama-3-70b", gpus=32, sequence_parallel=True),
               dict(model="llama-3-8b", gpus=8, strategies=["zero3", "fsdp"]),
               dict(model="phi-3-mini", gpus=2, gpu="t4", precision="fp16-mixed")):
        kw.setdefault("torch_version", TV)
        out.append(_case("recommend", "recommend", _fit_positions(kw)))
    return out


def fam_errors() -> list[dict]:
    bad = (dict(model="no-such-model"), dict(params="7B", gpus=12, gpus_per_node=8), dict(params="7B", tp=3),
           dict(params="7B", gpus=8, pp=3), dict(params="7B", pp=1, pp_microbatches=4),
           dict(params="7B", pp=2, pp_schedule="wavy"), dict(params="7B", cp=2, seq_len=2047),
           dict(params="7B", sequence_parallel=True), dict(params="7B", precision="fp8"),
           dict(params="7B", optimizer="lion"), dict(params="7B", activation_checkpointing="every-5"),
           dict(params="7B", strategies=["zero4"]), dict(params="7B", gpu="h900"), dict(params="7B", node="dgx-z"),
           dict(params="7B", intra="ib-ndr"), dict(params="7B", inter="nvlink4"), dict(params="7B", gpu_mem="1KB"),
           dict(params="1e15"), dict(params="7B", checkpoint="incremental"), dict(params="7B", seq_len=0),
           dict(params="7B", micro_batch=-1), dict(params="7B", torch_version="two"),
           dict(params="7B", heads=7), dict(params="7B", front_end="trace"), dict(params="7B", grad_sync="never"),
           dict(params="7B", cpu_offload="disk"), dict(params="7B", framework="jax"),
           dict(params="7B", pp=2, cpu_offload="params", gpus=8),
           dict(hf_config=f"{HF_DIR}/mixtral-8x7b.json", front_end="analytic"), dict(params="7B", inter_gbps=0.0))
    return [_plan("errors", **kw) for kw in bad]


NCCL_ENVS = ({"NCCL_BUFFSIZE": "8388608"}, {"NCCL_NVLS_ENABLE": "0"}, {"NCCL_MAX_NCHANNELS": "8"},
             {"NCCL_MIN_NCHANNELS": "32", "NCCL_P2P_READ_ENABLE": "1"}, {"NCCL_CUMEM_ENABLE": "0"},
             {"NCCL_RUNTIME_CONNECT": "0", "NCCL_LL128_BUFFSIZE": "0"})


def fam_nccl_env() -> list[dict]:
    out = []
    for env in NCCL_ENVS:
        c = _plan("nccl_env", model="llama-3-8b", gpus=16, strategies=["ddp", "zero3", "hsdp"])
        c["env"] = env
        c["id"] += "," + _short(env)
        out.append(c)
    return out


# -- the trace front end and --module (torch + transformers; slow) --------------------------------------------

TRACE_CONFIGS = ("examples/hf/llama-8l.json", "examples/hf/gpt2-8l.json", "examples/hf/qwen2-8l.json",
                 "examples/hf/mixtral-4l.json", "examples/hf/phi3-8l.json")


def fam_trace() -> list[dict]:
    out = []
    for cfg in TRACE_CONFIGS:
        base = dict(hf_config=cfg, front_end="trace", seq_len=128, micro_batch=2, gpus=8, gpu="h100-sxm",
                    torch_version=TV)
        settings = [dict(precision="fp32"), dict(precision="bf16-mixed"), dict(precision="fp32", gpus=2),
                    dict(precision="fp32", gpus=16, strategies=["hsdp", "zero3", "ddp"]),
                    dict(precision="fp32", optimizer="sgd-momentum"), dict(precision="fp32", optimizer="adafactor",
                                                                          strategies=["zero3", "ddp"]),
                    dict(precision="fp32", grad_accum=2, grad_sync="last"),
                    dict(precision="fp32", grad_accum=2, grad_sync="every", strategies=["zero2", "zero3", "fsdp"]),
                    dict(precision="fp32", cpu_offload="params", strategies=["zero3", "fsdp"]),
                    dict(precision="fp32", alloc_conf="expandable_segments:True", strategies=["ddp", "zero3"]),
                    dict(precision="fp32", torch_version="2.15", strategies=["zero3", "zero2"]),
                    dict(precision="fp32", gpus=1), dict(precision="fp32", activation_checkpointing="full"),
                    dict(precision="bf16-mixed", activation_checkpointing="full"),
                    dict(precision="fp32", activation_checkpointing="every-2",
                         strategies=["ddp", "zero3", "fsdp"]),
                    dict(precision="bf16-mixed", gpu="a100-80gb", optimizer="adam", strategies=["zero3", "fsdp"])]
        for s in settings:
            out.append(_plan("trace", **dict(base, **s)))
    # another batch shape (another trace) of one config, and bf16 weights
    out.append(_plan("trace", hf_config=TRACE_CONFIGS[0], front_end="trace", seq_len=64, micro_batch=4, gpus=8,
                     precision="bf16", torch_version=TV))
    return out


MODULE = "examples.mnist_cnn:make_model"


def fam_module() -> list[dict]:
    out = []
    for args in (["--input-shape", "128,1,28,28", "--gpus", "8", "--precision", "fp32", "--optimizer", "adam"],
                 ["--input-shape", "128,1,28,28", "--gpus", "8", "--precision", "bf16-mixed"],
                 ["--input-shape", "32,1,28,28", "--gpus", "2", "--precision", "fp32", "--grad-accum", "2"],
                 ["--input-shape", "4096,1,28,28", "--gpus", "2", "--strategy", "ddp,zero3",
                  "--alloc-conf", "expandable_segments:True"],
                 ["--input-shape", "64,1,28,28", "--gpus", "1", "--precision", "fp32",
                  "--activation-checkpointing", "full"]):
        argv = ["estimate", "--module", MODULE, "--gpu", "h100-sxm", "--torch-version", TV, *args, "--json"]
        out.append(_case("module", "cli", {"argv": argv}, "module/" + " ".join(args)))
    return out


# -- committed probe records (benchmarks/results) --------------------------------------------------------------

RESULTS_GLOB = "benchmarks/results/*.jsonl"
ANALYTIC_TYPES = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "gemma2"}


def _results():
    for path in sorted(glob.glob(os.path.join(ROOT, RESULTS_GLOB))):
        rel = os.path.relpath(path, ROOT)
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield rel, n, json.loads(line)


def fam_records() -> list[dict]:
    return [_case("records", "record", {"file": rel, "line": n}, f"records/{rel}:{n}:{r.get('id')}")
            for rel, n, r in _results()]


def fam_records_analytic() -> list[dict]:
    out = []
    for rel, n, r in _results():
        hf = ((r.get("inputs") or {}).get("module") or {}).get("hf_config")
        if not hf or r.get("status") != "ok" or int(r["inputs"].get("pp", 1)) > 1:
            continue
        with open(os.path.join(ROOT, hf)) as g:
            if json.load(g).get("model_type") not in ANALYTIC_TYPES:
                continue
        out.append(_case("records_analytic", "record_analytic", {"file": rel, "line": n},
                         f"records_analytic/{rel}:{n}:{r.get('id')}"))
    return out


# -- the groups (one data file each) and the families they hold ------------------------------------------------

FAMILIES = {
    "strategy_precision_optimizer": fam_strategy_precision_optimizer, "optimizer_impl": fam_optimizer_impl,
    "deepspeed": fam_deepspeed, "cpu_offload": fam_cpu_offload, "models": fam_models, "tp_sp": fam_tp_sp,
    "pp": fam_pp, "cp": fam_cp, "grad_accum": fam_grad_accum, "activation_checkpointing": fam_activation_checkpointing,
    "alloc_conf": fam_alloc_conf, "checkpoint_save": fam_checkpoint_save, "shapes": fam_shapes, "misc": fam_misc,
    "recommend": fam_recommend, "errors": fam_errors, "nccl_env": fam_nccl_env,
    "trace": fam_trace, "module": fam_module, "records": fam_records, "records_analytic": fam_records_analytic,
}
GROUPS = {
    "analytic": ("strategy_precision_optimizer", "optimizer_impl", "deepspeed", "cpu_offload", "models", "tp_sp",
                 "pp", "cp", "grad_accum", "activation_checkpointing", "alloc_conf", "checkpoint_save", "shapes",
                 "misc", "recommend", "errors", "nccl_env"),
    "trace": ("trace", "module"),
    "records": ("records", "records_analytic"),
}


def cases(family: str) -> list[dict]:
    out = FAMILIES[family]()
    ids = [c["id"] for c in out]
    assert len(ids) == len(set(ids)), f"{family}: repeated case ids"
    return out


# -- answering -------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def environment(extra: dict | None = None):
    """The repository root as cwd, the planner's environment variables cleared (and `extra` set)."""
    saved = {k: v for k, v in os.environ.items() if k in SCRUBBED_ENV or k.startswith(SCRUBBED_PREFIXES)}
    for k in saved:
        del os.environ[k]
    os.environ.update(extra or {})
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(cwd)
        for k in extra or {}:
            os.environ.pop(k, None)
        os.environ.update(saved)


def _record(rel: str, line: int) -> dict:
    with open(os.path.join(ROOT, rel)) as f:
        for n, text in enumerate(f, 1):
            if n == line:
                return json.loads(text)
    raise KeyError(f"{rel}:{line}: no such line")


def _raw_answer(case: dict, A: dict):
    call, kw = case["call"], dict(case["kwargs"])
    if call == "plan":
        return A["plan"](**kw).to_dict()
    if call == "recommend":
        return A["recommend"](**kw).to_dict()
    if call == "cli":
        from click.testing import CliRunner
        res = CliRunner().invoke(_cli_main(), kw["argv"], catch_exceptions=False)
        if res.exit_code != 0:
            return {"error": f"exit {res.exit_code}", "message": (res.output.strip().splitlines() or [""])[-1]}
        return json.loads(res.output)
    rec = _record(kw["file"], kw["line"])
    if "inputs" in rec:
        spec = _record_spec()(rec)
    else:  # the pipeline probes' first records (cpu-torch2.13-2026-11-2[34]-pp*.jsonl): {"spec", "torch", ...}
        spec = dict(rec["spec"])
        if not spec.get("torch_version") and rec.get("torch"):
            spec["torch_version"] = rec["torch"]
    if call == "record":
        return A["predict_probe"](spec)
    if call == "record_analytic":
        spec.pop("module")
        model, _ = A["resolve_model"](hf_config=rec["inputs"]["module"]["hf_config"])
        d = model.to_dict()
        if rec["inputs"]["module"].get("layers"):  # `validate --layers N` cut the published config to N blocks
            d["layers"] = int(rec["inputs"]["module"]["layers"])
        spec["model"] = d
        return A["predict_probe"](spec)
    raise ValueError(f"unknown call {call!r}")


def answer(case: dict, A: dict | None = None):
    """The case's answer in its stored form (JSON round-tripped, volatile keys dropped, the root written
    "<root>"); a refused configuration as {"error", "message"}."""
    A = A or api()
    with environment(case.get("env")):
        try:
            raw = _raw_answer(case, A)
        except ValueError as exc:  # the planner's refusals (one line naming the flag)
            raw = {"error": type(exc).__name__, "message": (str(exc).splitlines() or [""])[0]}
    return normalize(raw)


def normalize(obj):
    def clean(x):
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items() if k not in VOLATILE_KEYS}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, str):
            x = x.replace(ROOT, "<root>")
            for pattern, repl in VOLATILE_TEXT:
                x = pattern.sub(repl, x)
            return x
        if isinstance(x, float) and not math.isfinite(x):
            return {"__float__": repr(x)}  # JSON has no inf / nan; compared by repr
        if x is None or isinstance(x, (bool, int, float)):
            return x
        return {"__repr__": repr(x)}
    return json.loads(json.dumps(clean(obj)))


def answer_family(family: str, A: dict | None = None, progress=None) -> list[dict]:
    """Every case of `family` answered in order, after clearing the planner's caches."""
    A = A or api()
    A["clear_caches"]()
    out = []
    for c in cases(family):
        out.append(dict(c, answer=answer(c, A)))
        if progress:
            progress(c)
    return out


# -- comparing ------------------------------------------------------------------------------------------------

def flatten(obj, prefix: str = "") -> dict:
    """{path: (type name, value)} of every leaf; floats by repr."""
    out = {}
    if isinstance(obj, dict):
        if not obj:
            out[prefix or "."] = ("dict", "{}")
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, list):
        out[f"{prefix}#len"] = ("int", len(obj))
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}[{i}]"))
    else:
        out[prefix or "."] = (type(obj).__name__, repr(obj) if isinstance(obj, float) else obj)
    return out


def differences(old, new, limit: int = 8) -> list[str]:
    """The first `limit` leaves that differ, as 'path: old -> new'."""
    a, b = flatten(old), flatten(new)
    diffs = []
    for k in list(a) + [k for k in b if k not in a]:
        x, y = a.get(k, ("missing", "-")), b.get(k, ("missing", "-"))
        if x != y:
            diffs.append(f"{k}: {_show(x)} -> {_show(y)}")
    if len(diffs) > limit:
        diffs = diffs[:limit] + [f"... and {len(diffs) - limit} more"]
    return diffs


def _show(leaf) -> str:
    t, v = leaf
    s = v if t == "float" else repr(v)
    s = s if len(s) <= 160 else s[:157] + "..."
    return s if t in ("float", "int", "str", "missing") else f"{s} ({t})"


def report(stored: dict, got_answer, limit: int = 8) -> str | None:
    """None when `got_answer` is the stored one; else the configuration and its first differing keys."""
    if stored["answer"] == got_answer and not differences(stored["answer"], got_answer, 1):
        return None
    lines = [f"{stored['id']}", f"  {stored['call']}({json.dumps(stored['kwargs'], sort_keys=True)})"
             + (f" env={stored['env']}" if stored.get("env") else "")]
    lines += ["  " + d for d in differences(stored["answer"], got_answer, limit)]
    return "\n".join(lines)


# -- the data files ------------------------------------------------------------------------------------------

def data_path(group: str) -> str:
    return os.path.join(DATA_DIR, f"{group}.json.gz")


def load(group: str) -> list[dict]:
    with gzip.open(data_path(group), "rt", encoding="utf-8") as f:
        d = json.load(f)
    assert d["format"] == FORMAT, f"{data_path(group)}: format {d['format']}, expected {FORMAT}"
    return d["cases"]


def write(group: str, rows: list[dict]) -> str:
    os.makedirs(DATA_DIR, exist_ok=True)
    path = data_path(group)
    text = json.dumps({"format": FORMAT, "cases": rows}, separators=(",", ":"), allow_nan=False)
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9, mtime=0) as g:  # mtime 0: byte-reproducible
        g.write(text.encode("utf-8"))
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return path


def group_of(family: str) -> str:
    return next(g for g, fams in GROUPS.items() if family in fams)


def stored_by_family(group: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {f: [] for f in GROUPS[group]}
    for row in load(group):
        out.setdefault(row["family"], []).append(row)
    return out


PARTS = {"trace": 3, "records": 4}
"""Families answered in that many parts (contiguous runs of cases: one model's traces, one results file, stay
together), so that `pytest -n 2` spreads the slow ones over both workers."""


def parts(family: str) -> list[int]:
    return list(range(PARTS.get(family, 1)))


def check_family(family: str, stored: list[dict], A: dict | None = None, limit_cases: int = 10,
                 part: int = 0, keep=None) -> list[str]:
    """Reports of the cases of `family` whose answer differs from `stored` (configuration changes included);
    with `part` k of PARTS[family], only the k-th contiguous run of them; with `keep`, only the cases whose
    index i in `stored` has keep(i) true (the fast tier's sample, tests/test_golden.py)."""
    A = A or api()
    now = cases(family)
    problems = []
    want_ids, now_ids = [c["id"] for c in stored], [c["id"] for c in now]
    if want_ids != now_ids:
        gone, new = sorted(set(want_ids) - set(now_ids)), sorted(set(now_ids) - set(want_ids))
        problems.append(f"{family}: the configurations changed (regenerate with --write): "
                        f"{len(gone)} gone {gone[:3]}, {len(new)} new {new[:3]}")
    n = PARTS.get(family, 1)
    stored = stored[part * len(stored) // n:(part + 1) * len(stored) // n]
    if keep is not None:
        stored = [row for i, row in enumerate(stored) if keep(i)]
    by_id = {c["id"]: c for c in now}
    A["clear_caches"]()
    for row in stored:
        c = by_id.get(row["id"])
        if c is None:
            continue
        if {k: c.get(k) for k in ("call", "kwargs", "env")} != {k: row.get(k) for k in ("call", "kwargs", "env")}:
            problems.append(f"{row['id']}: its configuration changed (regenerate with --write)")
            continue
        r = report(row, answer(c, A))
        if r:
            problems.append(r)
            if len(problems) >= limit_cases:
                problems.append(f"(stopped after {limit_cases} differing configurations of {family})")
                break
    return problems


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="regenerate the data files")
    ap.add_argument("--check", action="store_true", help="compare with the data files")
    ap.add_argument("--list", action="store_true", help="configurations per family")
    ap.add_argument("--group", action="append", choices=sorted(GROUPS), help="only these groups (repeatable)")
    args = ap.parse_args(argv)
    groups = args.group or list(GROUPS)
    if args.list or not (args.write or args.check):
        total = 0
        for g in groups:
            for f in GROUPS[g]:
                n = len(cases(f))
                total += n
                print(f"{g:9s} {f:30s} {n:5d}")
        print(f"{'':9s} {'total':30s} {total:5d}")
        return 0
    A = api()
    rc = 0
    for g in groups:
        if args.write:
            rows = []
            for f in GROUPS[g]:
                t0, c0 = time.perf_counter(), time.process_time()
                got = answer_family(f, A)
                errs = sum(1 for r in got if isinstance(r["answer"], dict) and "error" in r["answer"])
                print(f"{g}/{f}: {len(got)} configurations ({errs} refused) in {time.perf_counter() - t0:.1f} s "
                      f"({time.process_time() - c0:.1f} s CPU)", flush=True)
                rows += got
            path = write(g, rows)
            print(f"wrote {os.path.relpath(path, ROOT)}: {len(rows)} configurations, {os.path.getsize(path):,} bytes")
        else:
            for f, stored in stored_by_family(g).items():
                t0 = time.perf_counter()
                problems = check_family(f, stored, A)
                print(f"{g}/{f}: {len(stored)} configurations, {len(problems)} differing "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
                for p in problems:
                    print(p)
                rc |= bool(problems)
    return rc


if __name__ == "__main__":
    if __package__ in (None, ""):  # python tests/golden_cases.py
        sys.path.insert(0, ROOT)
    sys.exit(main())
