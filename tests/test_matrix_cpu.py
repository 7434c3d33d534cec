"""The CPU validation matrix, end to end, as CI runs it: `distplan validate --matrix` with no GPU runs
every strategy x 3 model shapes x {gloo 2 ranks, fake process group 8 ranks} x checkpointing x
precision (54 real probes), plus 4 tensor-parallel probes (tp 2, 8 layers), 5 context-parallel probes
(cp 2-8, ring attention, 8 layers; one with tp 2) and 3 pipeline-parallel probes (2 stages of 4 layers,
1F1B and GPipe, one with DDP over 2 replicas), 19 minutes on 2 cores, and compares each with the planner.

What must hold for every probe: it ran; its predicted peak is within 5% of the measured peak; the
collectives (op, group size, dtype, bytes, calls) equal the prediction exactly. In the single-process
probes (fake process group, `single`) each component must be within 10% (or 64 KiB) except those listed
in validate/matrix.py KNOWN_GAPS with the reason (verdict KNOWN); in gloo probes the split between
components at the peak instant is not reproducible from run to run (see `_deterministic`), so there only
the peak is judged, by the tests and by `validate` itself (compare.components_judged): the run exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from distplan.validate.matrix import KNOWN_GAPS  # noqa: E402

PEAK_TOLERANCE = 0.05

KNOWN_COMPONENT_GAPS = {probe: ", ".join(gaps) for probe, gaps in KNOWN_GAPS.items()}
"""Deterministic probes (one process: fake process group, `single`) whose components miss: validate/matrix.py
KNOWN_GAPS, with why."""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the CPU matrix, also on a GPU machine
    out = tmp_path_factory.mktemp("matrix") / "results.jsonl"
    proc = subprocess.run([sys.executable, "-m", "distplan.planner", "validate", "--matrix", "--json",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    rep = json.loads(proc.stdout)
    rep["returncode"] = proc.returncode
    lines = out.read_text().splitlines()
    assert len(lines) == len(rep["probes"]) == 68  # every probe appended to the results file (54 + 4 TP + 5 CP + 5 PP)
    return rep


@pytest.mark.slow
def test_every_probe_ran(report):
    bad = [(p["id"], p["status"], p.get("measurement", {}).get("error"),
            p.get("measurement", {}).get("stderr_tail", "")[-1500:]) for p in report["probes"] if p["status"] != "ok"]
    assert not bad, bad


def _ran(report) -> list[dict]:
    """The probes that ran to the end: a crashed or timed-out probe has no peak or collectives to compare
    and is `test_every_probe_ran`'s failure, reported there once with its reason."""
    return [p for p in report["probes"] if p["status"] == "ok"]


@pytest.mark.slow
def test_peak_within_5_percent(report):
    errors = {p["id"]: p["comparison"]["peak"]["error"] for p in _ran(report)}
    bad = {k: round(100 * e, 2) for k, e in errors.items() if e is None or abs(e) > PEAK_TOLERANCE}
    assert not bad, bad


@pytest.mark.slow
def test_collectives_exact(report):
    bad = [p["id"] for p in _ran(report) if not p["comparison"]["collectives"]["exact"]]
    assert not bad, bad


def _deterministic(probe) -> bool:
    """One process (fake process group or `single`). In a gloo probe the collectives finish on gloo's
    own threads, so which tensors are alive at the peak's instant differs from run to run: the same
    probe split its bytes between grads, comm_buffers, activations and temporaries differently in two
    runs of this matrix (zero3/gpt2-tiny/w2, fsdp/gpt2-tiny/w2, fsdp-grad-op/llama-tiny/w2, hsdp/gpt2-tiny/w2)
    while its peak stayed within 5%. Their peaks and collectives are asserted above; their components
    are not."""
    return probe["inputs"]["mode"] == "fake" or probe["inputs"]["world_size"] == 1


@pytest.mark.slow
def test_components_within_10_percent_or_known(report):
    missed = {}
    for p in filter(_deterministic, _ran(report)):
        comps = p["comparison"]["components"]
        off = sorted(name for name, cell in comps.items() if not cell.get("ok", True))
        if off:
            missed[p["id"]] = ", ".join(off)
    allowed = {k: set(v.split(", ")) for k, v in KNOWN_COMPONENT_GAPS.items()}
    unexpected = {k: v for k, v in missed.items() if not set(v.split(", ")) <= allowed.get(k, set())}
    assert not unexpected, f"components outside 10% beyond the known gaps: {unexpected}"
    assert sum(map(_deterministic, report["probes"])) >= 27  # the fake-pg half of the matrix, and `single`


@pytest.mark.slow
def test_the_matrix_passes_with_its_known_gaps_stated(report):
    """A user's first `validate --matrix` on a CPU machine exits 0: every probe PASS, or KNOWN where
    KNOWN_GAPS lists the component it misses."""
    verdicts = {p["id"]: p["verdict"] for p in report["probes"]}
    assert {v for v in verdicts.values()} <= {"PASS", "KNOWN"}, {k: v for k, v in verdicts.items()
                                                                 if v not in ("PASS", "KNOWN")}
    assert all(k in KNOWN_GAPS for k, v in verdicts.items() if v == "KNOWN")
    assert report["returncode"] == 0 and report["ok"] and report["known"] == sum(v == "KNOWN" for v in verdicts.values())
