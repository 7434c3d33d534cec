"""validate's verdicts: components of multi-process gloo probes shown, not judged; known gaps KNOWN, not FAIL."""

from __future__ import annotations

from distplan.validate.compare import COMPONENTS, compare, rule_text
from distplan.validate.matrix import KNOWN_GAPS
from distplan.validate.runner import make_record

MiB = 2**20


def _pair(mode: str, world: int, measured_grads: int):
    comps = dict.fromkeys(COMPONENTS, 0)
    comps.update(params=10 * MiB, grads=10 * MiB, optimizer=20 * MiB, temporaries=0)
    meas = dict(comps, grads=measured_grads)
    peak_p, peak_m = sum(comps.values()), sum(meas.values())
    prediction = {"memory": dict(comps, peak_allocated=peak_p, peak_phase="optimizer"), "collectives": [],
                  "step_time_s": None}
    measurement = {"status": "ok", "mode": mode, "world_size": world, "device": "cpu",
                   "memory": {"peak_allocated": peak_m, "peak_phase": "optimizer", "components": meas},
                   "collectives": [], "step_time_s": None}
    return prediction, measurement


def test_a_component_miss_fails_a_one_process_probe():
    pred, meas = _pair("fake", 8, 11 * MiB)  # grads -9.1%: within 10%
    assert compare(pred, meas)["verdict"] == "PASS"
    pred, meas = _pair("fake", 8, 12 * MiB)  # grads -16.7%, peak -3.8%
    out = compare(pred, meas)
    assert out["verdict"] == "FAIL" and out["reasons"][0].startswith("grads:")


def test_gloo_processes_show_their_components_without_judging_them():
    pred, meas = _pair("cpu", 2, 12 * MiB)
    out = compare(pred, meas)
    assert out["verdict"] == "PASS", out["reasons"]
    cell = out["components"]["grads"]
    assert cell["judged"] is False and cell["ok"] is False and cell["measured"] == 12 * MiB
    assert "shown, not judged" in rule_text()
    pred, meas = _pair("cpu", 2, 14 * MiB)  # the peak -7.4%: still judged
    assert compare(pred, meas)["verdict"] == "FAIL"
    pred, meas = _pair("cpu", 1, 12 * MiB)  # one gloo process (`single`): judged
    assert compare(pred, meas)["verdict"] == "FAIL"


def test_a_listed_gap_is_known_and_only_that_gap():
    pred, meas = _pair("fake", 8, 12 * MiB)
    out = compare(pred, meas, known_gaps={"grads": "why it misses"})
    assert out["verdict"] == "KNOWN" and "(known gap: why it misses)" in out["reasons"][0]
    assert compare(pred, meas, known_gaps={"temporaries": "another"})["verdict"] == "FAIL"
    pred, meas = _pair("fake", 8, 14 * MiB)  # the peak off too: a failure, known gap or not
    assert compare(pred, meas, known_gaps={"grads": "why"})["verdict"] == "FAIL"


def test_records_of_the_matrix_s_known_probes_carry_their_gaps():
    probe = "zero3/llama-tiny-8l/w8-fake/cp2/tp2-sp/none/bf16-mixed"
    pred, meas = _pair("fake", 8, 12 * MiB)
    rec = make_record({"id": probe}, pred, None, meas, 0.05)
    assert probe in KNOWN_GAPS and rec["verdict"] == "KNOWN"
    assert make_record({"id": "zero3/other"}, pred, None, meas, 0.05)["verdict"] == "FAIL"
