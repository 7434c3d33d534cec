"""The committed GPU validation run (benchmarks/results/h100-*.jsonl: `distplan validate --matrix` on an
H100, real allocations measured with torch.cuda.max_memory_allocated) re-predicted with the planner as
it is now, so CI notices when a model change moves away from what the GPU measured.

Goal from the validation issue: peak |error| median <= 2%, max <= 5%, asserted for every probe. A test
that launches a real GPU probe runs only where CUDA is present.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys

import pytest

from distplan.planner.accuracy import PEAK_RESERVED
from distplan.planner.api import predict_probe
from distplan.validate.results import record_spec
from distplan.validate.compare import compare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(f for f in glob.glob(os.path.join(ROOT, "benchmarks", "results", "h100-*.jsonl"))
               if "modules" not in f)
MODULE_FILES = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "h100-*-modules.jsonl")))


def _records(files=None):
    out = []
    for path in FILES if files is None else files:
        with open(path) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out


@pytest.fixture(scope="module")
def repredicted():
    recs = _records()
    if not recs:
        pytest.skip("no committed GPU results")
    rows = []
    for r in recs:
        spec = record_spec(r)
        rows.append((r, compare(predict_probe(spec), r["measurement"])))
    return rows


def test_results_are_real_gpu_runs(repredicted):
    assert len(repredicted) >= 54
    for r, _ in repredicted:
        assert r["status"] == "ok", r["id"]
        assert "H100" in r["device"] and r["measurement"]["memory"]["source"] == "torch.cuda.max_memory_allocated"
        assert r["inputs"]["gpu_name"] == r["device"]  # the prediction sized the workspaces for this GPU


def test_collectives_exact(repredicted):
    bad = [r["id"] for r, c in repredicted if not c["collectives"]["exact"]]
    assert not bad, bad


def test_peak_error_median_and_max(repredicted):
    errors = {r["id"]: abs(c["peak"]["error"]) for r, c in repredicted}
    assert statistics.median(errors.values()) <= 0.02, statistics.median(errors.values())
    over = {k: round(100 * e, 2) for k, e in errors.items() if e > 0.05}
    assert not over, over


def test_workspaces_are_most_of_what_the_tracker_misses(repredicted):
    """max_memory_allocated minus the tracker's peak: the cuBLAS workspaces the prediction adds, plus
    the caching allocator's rounding (blocks handed out whole), which is never negative."""
    for r, _ in repredicted:
        m = r["measurement"]["memory"]
        untracked = m["peak_allocated"] - m["tracker_peak_allocated"]
        ws = predict_probe(record_spec(r))["memory"]["workspace"]
        assert ws - 2**20 <= untracked <= ws + 16 * 2**20, (r["id"], untracked, ws)


@pytest.fixture(scope="module")
def modules_repredicted():
    recs = _records(MODULE_FILES)
    if not recs:
        pytest.skip("no committed --module GPU results")
    return [(r, None if r["status"] != "ok" else compare(predict_probe(record_spec(r)), r["measurement"]))
            for r in recs]


def _bn_under_fsdp2_mixed(r) -> bool:
    """BatchNorm under FSDP2 with bf16 mixed precision: it fails inside PyTorch (`Expected running_mean to
    have type BFloat16`), and the plan says so instead of planning it (module_plan.fsdp2_batchnorm_failure).
    (FSDP1 wraps BatchNorm modules apart in fp32, `MixedPrecision._module_classes_to_ignore`: traced so, and
    judged with the rest.)"""
    return ("cifar_resnet" in r["inputs"]["module"]["factory"] and r["inputs"]["train"]["precision"] != "fp32"
            and r["inputs"]["strategy"] in ("zero2", "zero3"))


def test_modules_on_gpu_peaks_within_2_percent(modules_repredicted):
    """`validate --module` on the H100 (MNIST CNN, CIFAR ResNet; batch 32 and 128; fp32 and bf16-mixed):
    the plan's peak, with the cuDNN workspaces measured on that GPU added at the instant each
    convolution runs, against `torch.cuda.max_memory_allocated`: every probe within 2% (measured
    max 1.75%), collectives exact. Without the workspaces these peaks were 4-20% under."""
    assert len(modules_repredicted) >= 54
    checked = 0
    for r, c in modules_repredicted:
        assert "H100" in r["device"] and r["inputs"]["module"].get("kernel_workspaces"), r["id"]
        if _bn_under_fsdp2_mixed(r):
            continue
        assert r["status"] == "ok", r["id"]
        assert abs(c["peak"]["error"]) <= 0.02, (r["id"], c["peak"]["error"])
        assert c["collectives"]["exact"], r["id"]
        checked += 1
    assert checked >= 48


def test_modules_on_gpu_tensors_match_the_tracker(modules_repredicted):
    """The planned tensors (peak less workspaces) against the tracker's peak: within 3% everywhere,
    within 0.2% for fp32 except FSDP1's grad-op at batch 128 (+2.7%: its unsharded units' lifetime on
    the GPU's streams)."""
    for r, c in modules_repredicted:
        if _bn_under_fsdp2_mixed(r):
            continue
        p = predict_probe(record_spec(r))["memory"]
        tensors = p["peak_allocated"] - p["workspace"]
        tracked = r["measurement"]["memory"]["tracker_peak_allocated"]
        assert abs(tensors - tracked) <= 0.03 * tracked, (r["id"], tensors, tracked)


def test_modules_batchnorm_under_fsdp2_fails_as_the_plan_says(modules_repredicted):
    """BatchNorm + FSDP2 + bf16-mixed: the H100 probes failed inside PyTorch, and the plan gives the reason
    rather than a number (`estimate` leaves zero2 and zero3 out with it). If PyTorch changes, this says so."""
    from distplan.planner.module_plan import ModuleDesc, fsdp2_batchnorm_failure
    gap = [r for r, _ in modules_repredicted if _bn_under_fsdp2_mixed(r)]
    assert len(gap) == 2
    for r in gap:
        assert r["status"] == "error" and "running_mean" in r["measurement"]["error"], r["id"]
    assert "running_mean" in fsdp2_batchnorm_failure(ModuleDesc("m", (), (), 0, 0, 0, 1, batchnorm=True), "bf16-mixed")
    assert fsdp2_batchnorm_failure(ModuleDesc("m", (), (), 0, 0, 0, 1, batchnorm=True), "fp32") is None


def test_modules_on_gpu_reserved_from_the_traced_steps_allocations(modules_repredicted):
    """`max_memory_reserved` of the `--module` probes on the H100 (MNIST CNN, CIFAR ResNet; batch 32 and 128;
    fp32 and bf16-mixed) under single, ddp and zero1, against the reserved peak of the traced step's own
    allocations replayed through the allocator model (module_plan.logged_module_events, the measured cuDNN
    workspaces taken and given back at each convolution). Re-predicted 2026-12-02: 18 probes, median 1.7%;
    15 within 5.9%; the CIFAR ResNet under bf16-mixed 23-25% over (the stated gap, the safe side: with its
    measured workspaces each one block, the 36 MiB of one convolution's forward opens segments the GPU run
    did not; without the workspaces the same replay reads 143 MB against 145 measured). The 10% margin these
    probes had before read 1-27% under (measured reserved / allocated: 1.11-1.50). FSDP2 (zero2, zero3: the
    units' all-gathers, copy-outs, reshards and reduce-scatters written where the trace marked their hooks,
    alloc_trace.logged_fsdp2_events) and FSDP1 (fsdp, fsdp-grad-op, hsdp, fsdp-no-shard: its flat
    parameters', alloc_trace.logged_fsdp1_events), re-predicted 2026-12-02: FSDP2 10 probes, median 0.3%,
    max 1.8%; FSDP1 24 probes, median 0.0%, max 1.7% (the margin read 7-30% under; measured reserved /
    allocated 1.18-1.56)."""
    judged = {}
    for r, c in modules_repredicted:
        if r["status"] != "ok":
            continue
        pred = predict_probe(record_spec(r))["memory"]
        assert "peak_reserved" in pred, r["id"]  # written, not the margin
        batch = r["inputs"]["module"]["input_shape"][0]  # (the ids of batch 32 and 128 are the same)
        judged[f"{r['id']}/b{batch}"] = pred["peak_reserved"] / r["measurement"]["memory"]["peak_reserved"] - 1
    assert len(judged) == 52
    # the band printed for --module plans (accuracy.PEAK_RESERVED)
    every = [abs(e) for e in judged.values()]
    band = PEAK_RESERVED["trace-module"]
    assert round(statistics.median(every), 4) == band["median"] and round(max(every), 4) == band["max"]
    gap = {k: e for k, e in judged.items() if "cifar_resnet" in k and "bf16-mixed" in k
           and k.startswith(("single/", "ddp/", "zero1/"))}
    rest = [abs(e) for k, e in judged.items() if k not in gap]
    assert len(gap) == 3 and all(0.15 <= e <= 0.30 for e in gap.values()), gap
    assert statistics.median(rest) <= 0.02 and max(rest) <= 0.06, judged
    fsdp2 = [abs(e) for k, e in judged.items() if k.startswith(("zero2/", "zero3/"))]
    assert len(fsdp2) == 10 and statistics.median(fsdp2) <= 0.01 and max(fsdp2) <= 0.03, judged
    fsdp1 = [abs(e) for k, e in judged.items() if k.startswith(("fsdp/", "fsdp-grad-op/", "hsdp/", "fsdp-no-shard/"))]
    assert len(fsdp1) == 24 and statistics.median(fsdp1) <= 0.01 and max(fsdp1) <= 0.03, judged


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_live_gpu_probe(tmp_path):
    """One real probe on this machine's GPU (NCCL, torchrun), compared with the planner."""
    out = tmp_path / "r.jsonl"
    proc = subprocess.run([sys.executable, "-m", "distplan.planner", "validate", "--strategy", "ddp", "--json",
                           "--out", str(out), "--nproc", "1"], capture_output=True, text=True, timeout=600)
    rep = json.loads(proc.stdout)
    probe = rep["probes"][0]
    assert probe["status"] == "ok", probe
    assert abs(probe["comparison"]["peak"]["error"]) <= 0.05, probe["comparison"]["peak"]
    assert probe["comparison"]["collectives"]["exact"]


def test_step_time_predicted_where_measured(repredicted):
    """Step time of the GPU probes (the per-kernel model, planner/kernels.py). These probes are tiny (4
    layers of width 512, 512 tokens): host-bound, so their time is the host floor, the ATen ops the step
    dispatches (kernels.host_ops, optimizer_host_ops: the reference decoder's own counts, exact without
    checkpointing) x the catalog's host time per op. That per-op time (16.7 us) is the geometric mean of
    these same six probes (catalog/loader.py GPU.host_op_s), so this is a check of the op counts' shape
    across models, precisions and checkpointing, not an independent validation: each within 20%, the
    median within 10%. The fake-PG records of this file were not timed (probes before 2026-11-23)."""
    errors = []
    for r, _ in repredicted:
        p = predict_probe(record_spec(r))
        pred = p["step_time_s"]
        assert pred is not None and pred > 0, r["id"]
        assert p["step_time_bound"] == "host", r["id"]
        if r["inputs"]["mode"] == "gpu":
            errors.append(pred / r["measurement"]["step_time_s"] - 1)
            assert abs(errors[-1]) <= 0.20, (r["id"], errors[-1])
        else:
            assert r["measurement"].get("step_time_s") is None, r["id"]
    assert len(errors) == 6 and sorted(map(abs, errors))[len(errors) // 2] <= 0.10, errors