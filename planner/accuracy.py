"""The error the project has measured for the numbers a plan predicts, printed next to them (issue 61 item 4):
a predicted step time is as good as its comparison with measured runs, and a user reads it with that band.

The figures are the repository's own measurements (README "Accuracy", docs/validation.md, where each table
names its records under benchmarks/results/):
- step time (and tokens/s, MFU, time to train, which follow from it): 26 published training runs
  (torchtitan, llm-foundry, fms-fsdp; A100/H100 clusters of 8-128 GPUs, tests/test_published_runs.py):
  |error| median 15.1%, max 37.8%, every run but four predicted faster than published;
- peak allocated memory, analytic front end: 78 H100 probes of the reference decoder, 9 strategies
  (torch 2.11): median 0.63%, max 3.70%;
- peak allocated memory, trace front end on Hugging Face models on a GPU: 18 runs of three published configs
  on one H100 (tests/data/gpu/, re-predicted by tests/test_gpu_hf_h100.py with the CUDA target): predicted
  low in every run, median 6.9%, max 13.3%;
- peak allocated memory, `--module` models (CNN, ResNet) on an H100: 52 probes, median 0.11%, max 1.33%;
- reserved peak (`torch.cuda.max_memory_reserved`, what decides "fits"), the same probes: analytic 1.09% /
  6.42% (tests/test_alloc_trace.py), Hugging Face models by the trace 10.1% / 19.7%, low in 16 of 18
  (tests/test_gpu_hf_h100.py), `--module` 0.0% / 24.6%, the CIFAR ResNet under bf16-mixed 23-25% high
  (tests/test_gpu_results.py).
"""

from __future__ import annotations

STEP_TIME = {"median": 0.151, "max": 0.378, "bias": "predicted faster than measured in 22 of 26",
             "measured_against": "26 published training runs (torchtitan, llm-foundry, fms-fsdp), A100/H100, "
                                 "8-128 GPUs"}
PEAK_ALLOCATED = {
    "analytic": {"median": 0.0063, "max": 0.037, "bias": None,
                 "measured_against": "78 H100 probes of the reference decoder, 9 strategies"},
    "trace-hf": {"median": 0.069, "max": 0.1328, "bias": "predicted low in 18 of 18",
                 "measured_against": "18 H100 runs of three published Hugging Face configs"},
    "trace-module": {"median": 0.0011, "max": 0.0133, "bias": None,
                     "measured_against": "52 H100 probes of a CNN and a ResNet"},
}

CPU_TARGET = "-cpu"
"""The suffix of a band key for a plan of the CPU target (`--device cpu`: what the CPU probes run)."""
PEAK_ALLOCATED.update({
    # the transformers matrix on the CPU (docs/validation.md "Measured accuracy";
    # benchmarks/results/cpu-torch2.13-2026-11-23-hf.jsonl, re-predicted by tests/test_hf_results.py). The
    # analytic front end plans the CUDA target only (front_end.py).
    "trace-hf" + CPU_TARGET: {"median": 0.0, "max": 0.0078, "bias": None,
                              "measured_against": "90 CPU probes of 8-layer transformers models (gloo, fake "
                                                  "process group)"},
})

PEAK_RESERVED = {
    "analytic": {"median": 0.0109, "max": 0.0642, "bias": None,
                 "measured_against": PEAK_ALLOCATED["analytic"]["measured_against"]},
    "trace-hf": {"median": 0.101, "max": 0.1966, "bias": "predicted low in 16 of 18",
                 "measured_against": PEAK_ALLOCATED["trace-hf"]["measured_against"]},
    "trace-module": {"median": 0.0, "max": 0.2464, "bias": "a ResNet under bf16-mixed 23-25% high",
                     "measured_against": PEAK_ALLOCATED["trace-module"]["measured_against"]},
}


def band_key(front_end: str, device: str = "cuda") -> str:
    """The key of the bands measured for a plan of `front_end` ("analytic", "trace-hf" or "trace-module") for
    `device`'s target ("cuda" or "cpu")."""
    return front_end + (CPU_TARGET if device == "cpu" else "")


def error_band(front_end: str) -> dict:
    """{"step_time": ..., "peak_allocated": ..., "peak_reserved": ...}: the measured |error| band (fractions)
    of a plan whose band key (`band_key`) is `front_end`; None for a number not measured so: the CPU target's
    reserved peak (the CPU has no caching allocator) and a `--module` model's peak on the CPU. The step time
    is the GPU's on either target."""
    def band(table):
        got = table.get(front_end)
        return dict(got) if got else None
    return {"step_time": dict(STEP_TIME), "peak_allocated": band(PEAK_ALLOCATED),
            "peak_reserved": band(PEAK_RESERVED)}


def band_words(band: dict | None) -> str:
    """'±15% median, 38% max (predicted faster ...)', or 'not measured'."""
    if band is None:
        return "not measured"
    bias = f" ({band['bias']})" if band["bias"] else ""
    return f"±{100 * band['median']:.2g}% median, {100 * band['max']:.2g}% max{bias}"


def time_line(front_end: str | dict) -> str:
    """The line printed under a time table; `front_end` as error_band's, or a band it returned."""
    b = front_end["step_time"] if isinstance(front_end, dict) else STEP_TIME
    return f"measured error of step time, throughput and MFU: {band_words(b)}, against {b['measured_against']}"


def memory_line(front_end: str | dict) -> str:
    """The line printed under a memory table; `front_end` as error_band's, or a band it returned."""
    band = front_end if isinstance(front_end, dict) else error_band(front_end)
    b, r = band["peak_allocated"], band["peak_reserved"]
    if b is None:
        return "measured error of the peak: not measured for this front end on the CPU target"
    reserved = (f"of the reserved peak: {band_words(r)}" if r is not None
                else "the reserved peak not judged (the CPU has no caching allocator)")
    return f"measured error of the peak: {band_words(b)}; {reserved}; against {b['measured_against']}"
