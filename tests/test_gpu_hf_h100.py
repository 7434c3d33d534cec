"""The H100 runs of Hugging Face models (tests/data/gpu/, the protocol in its README) re-predicted with the
CUDA target of the trace front end (issue 60), run by run as `distplan validate` probes on the fake process
group (benchmarks/h100_hf_repredict.py builds each spec).

Issue 60's bar: every peak allocated within 2%, every reserved peak within 10%, the single-GPU step time's
median within 10%. The step time meets it; the peaks do not yet, so each is asserted where the planner is
now (`REACHED_*`, tight: a change that moves a prediction away from the GPU fails) and the issue's bar is
kept as a strict xfail (it fails the day it passes: then tighten `REACHED_*`).

Where the gap is (2026-12-06): at the peak (the start of the backward, the loss's), the GPU holds one more
tensor the size of the logits in their dtype than the trace (fp32 runs: 4 bytes per token x vocab, bf16 runs:
2) in every run but Llama-2-7B's (a 32k vocabulary at 1,024 tokens, where the gap is 0.4-0.6%). No rule of
PyTorch's source found yet explains it; see the commit message.
"""

from __future__ import annotations

import os
import statistics
import sys

import pytest

from distplan.planner.accuracy import PEAK_ALLOCATED, PEAK_RESERVED
from distplan.planner.api import predict_probe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import h100_hf_repredict as H  # noqa: E402

pytestmark = pytest.mark.slow

ISSUE_ALLOCATED_BAR = 0.02
ISSUE_RESERVED_BAR = 0.10
ISSUE_STEP_MEDIAN_BAR = 0.10
REACHED_ALLOCATED = 0.135
"""Largest |error| of a peak allocated now: 13.3% (Qwen2.5-0.5B, zero3 on 64 ranks, checkpointed)."""
REACHED_RESERVED = 0.20
"""Largest |error| of a reserved peak now: 19.7% (Qwen2.5-0.5B, single, bf16-mixed, checkpointed)."""


@pytest.fixture(scope="module")
def rows():
    cwd = os.getcwd()
    os.chdir(ROOT)  # the specs name their configs relative to the repository
    try:
        return H.repredict("cuda")
    finally:
        os.chdir(cwd)


def _errors(rows, key: str) -> dict[str, float]:
    return {H._id(r["run"]): r[key] / r["run"][key] - 1 for r in rows}


def test_the_runs_are_the_h100_measurements():
    runs = H.runs()
    assert len(runs) == 18
    assert {r["gpu"] for r in runs} == {"NVIDIA H100 80GB HBM3"}
    assert {r["torch"] for r in runs} == {"2.11.0+cu130"}
    for r in runs:
        assert os.path.exists(os.path.join(ROOT, H.run_spec(r)["module"]["hf_config"])), r["model"]


def test_peak_allocated_where_it_is_now(rows):
    errors = _errors(rows, "peak_allocated")
    bad = {k: f"{e:+.2%}" for k, e in errors.items() if abs(e) > REACHED_ALLOCATED}
    assert not bad, bad
    # every one under: the side where "fits" meets an OOM (issue 60)
    assert all(e < 0 for e in errors.values()), errors


def test_reserved_peak_where_it_is_now(rows):
    errors = _errors(rows, "peak_reserved")
    bad = {k: f"{e:+.2%}" for k, e in errors.items() if abs(e) > REACHED_RESERVED}
    assert not bad, bad


def test_the_printed_bands_are_these_runs(rows):
    """accuracy.py's trace-hf bands (printed under a traced Hugging Face model's memory table and in the JSON's
    error_band) are these runs' |errors|: median and max to 0.1%, and how many were predicted low."""
    for key, band in (("peak_allocated", PEAK_ALLOCATED["trace-hf"]), ("peak_reserved", PEAK_RESERVED["trace-hf"])):
        errors = list(_errors(rows, key).values())
        assert abs(statistics.median(abs(e) for e in errors) - band["median"]) < 0.001, (key, errors)
        assert abs(max(abs(e) for e in errors) - band["max"]) < 0.001, (key, errors)
        low = sum(e < 0 for e in errors)
        assert f"predicted low in {low} of {len(errors)}" == band["bias"], (key, low)


def test_single_gpu_step_time_median(rows):
    single = [r for r in rows if r["run"]["world"] == 1]
    assert len(single) == 7 and all(r["step_s"] for r in single)
    median = statistics.median(abs(r["step_s"] / r["run"]["step_s"] - 1) for r in single)
    assert median <= ISSUE_STEP_MEDIAN_BAR, f"{median:.2%}"


@pytest.mark.xfail(strict=True, reason="issue 60: peak allocated 0.4-13.3% under (see the module docstring)")
def test_issue_bar_peak_allocated(rows):
    assert all(abs(e) <= ISSUE_ALLOCATED_BAR for e in _errors(rows, "peak_allocated").values())


@pytest.mark.xfail(strict=True, reason="issue 60: reserved peaks 0-19.7% under")
def test_issue_bar_reserved(rows):
    assert all(abs(e) <= ISSUE_RESERVED_BAR for e in _errors(rows, "peak_reserved").values())


def test_the_cpu_target_is_not_what_the_gpu_ran(rows):
    """The same fp32 runs planned with the CPU target (`--device cpu`: the CPU's SDPA, which keeps no
    attention probabilities where CUDA runs the math kernel for fp32 grouped-query attention) are 25-27%
    under; the CUDA target 5-8%."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for r in rows:
            run = r["run"]
            if run["world"] == 1 and run["precision"] == "fp32":
                cpu = predict_probe(H.run_spec(run, "cpu"))["memory"]["peak_allocated"] / run["peak_allocated"] - 1
                cuda = r["peak_allocated"] / run["peak_allocated"] - 1
                assert cpu < -0.2 and abs(cuda) < abs(cpu) / 3, (H._id(run), cpu, cuda)
    finally:
        os.chdir(cwd)
