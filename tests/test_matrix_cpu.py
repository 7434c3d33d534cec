"""The CPU validation matrix, end to end, as CI runs it: `distplan validate --matrix` with no GPU runs
every strategy x 3 model shapes x {gloo 2 ranks, fake process group 8 ranks} x checkpointing x
precision (54 real probes, about 5 minutes on 2 cores) and compares each with the planner.

What must hold for every probe: it ran; its predicted peak is within 5% of the measured peak; the
collectives (op, group size, dtype, bytes, calls) equal the prediction exactly. Each component must be
within 10% (or 64 KiB) except the components listed in KNOWN_COMPONENT_GAPS, each with the reason; the
test fails if any other component misses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

PEAK_TOLERANCE = 0.05

KNOWN_COMPONENT_GAPS = {
    # Measured at the peak: one block's reduce-scattered gradient shard (+ the root norm's), 397,568 B,
    # that the walk does not hold at that instant; the peak is 4.9% under. Not yet located in FSDP2's
    # post-backward order.
    "zero3/gpt2-tiny/w2/none/fp32": "grads",
    # Attribution only (the sum matches): FSDP1's reduce-scatter output shard is a gradient to the
    # tracker and a comm buffer to the walk at the peak instant.
    "fsdp-grad-op/llama-tiny/w2/full/bf16-mixed": "comm_buffers, grads",
    # Attribution only (components sum within 56 KiB): at the recompute-time peak the walk counts
    # 0.78 MB as temporaries that the tracker sees as HYBRID_SHARD's unsharded flat parameter.
    "hsdp/gpt2-tiny/w2/full/fp32": "activations, comm_buffers, temporaries",
    # Temporaries 165,116 B (10.2%) over the measurement under autocast + full checkpointing; peak +2.5%.
    "zero1/gpt2-tiny/w8-fake/full/bf16-mixed": "temporaries",
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) != "":
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the CPU matrix, also on a GPU machine
    else:
        env = dict(os.environ)
    out = tmp_path_factory.mktemp("matrix") / "results.jsonl"
    proc = subprocess.run([sys.executable, "-m", "distplan.planner", "validate", "--matrix", "--json",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    rep = json.loads(proc.stdout)
    lines = out.read_text().splitlines()
    assert len(lines) == len(rep["probes"]) == 54  # every probe appended to the results file
    return rep


@pytest.mark.slow
def test_every_probe_ran(report):
    bad = [(p["id"], p["status"], p.get("measurement", {}).get("error")) for p in report["probes"]
           if p["status"] != "ok"]
    assert not bad, bad


@pytest.mark.slow
def test_peak_within_5_percent(report):
    errors = {p["id"]: p["comparison"]["peak"]["error"] for p in report["probes"]}
    bad = {k: round(100 * e, 2) for k, e in errors.items() if e is None or abs(e) > PEAK_TOLERANCE}
    assert not bad, bad


@pytest.mark.slow
def test_collectives_exact(report):
    bad = [p["id"] for p in report["probes"] if not p["comparison"]["collectives"]["exact"]]
    assert not bad, bad


@pytest.mark.slow
def test_components_within_10_percent_or_known(report):
    missed = {}
    for p in report["probes"]:
        comps = p["comparison"]["components"]
        off = sorted(name for name, cell in comps.items() if not cell.get("ok", True))
        if off:
            missed[p["id"]] = ", ".join(off)
    allowed = {k: set(v.split(", ")) for k, v in KNOWN_COMPONENT_GAPS.items()}
    unexpected = {k: v for k, v in missed.items() if not set(v.split(", ")) <= allowed.get(k, set())}
    assert not unexpected, f"components outside 10% beyond the known gaps: {unexpected}"
    # A listed probe may also pass: which tensor the tracker's peak instant catches first can differ
    # between runs (fsdp-grad-op/llama-tiny missed in one run of two).
