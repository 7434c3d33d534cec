"""Pipeline probes in `distplan validate` (issue 13): `--pp N` and the CPU matrix's 3 pipeline probes
(validate/pp_probe.py through the standard runner and comparison: the most loaded rank's peak within 5%,
its collectives exact, sends and receives included).

Fast: the specs, the prediction of the most loaded rank, the refusals. Slow: `validate --pp 2` end to end.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from distplan.planner.api import predict_probe
from distplan.planner.cli import main
from distplan.planner.pp import predict_probe_ranks
from distplan.validate import matrix as mx
from distplan.validate.runner import probe_argv


def test_matrix_has_the_pp_probes():
    specs = mx.pp_matrix({"gpus": 0})
    assert len(specs) == 3 and all(s["model"]["layers"] >= 8 and s["pp"] == 2 for s in specs)
    assert {s["schedule"] for s in specs} == {"1f1b", "gpipe"} and {s["dp"] for s in specs} == {1, 2}
    assert mx.pp_matrix({"gpus": 2}) == []  # the pipeline probe runs gloo only
    assert not mx.pp_matrix({"gpus": 0}, ["zero3"])
    # launched as the pipeline probe, one process per stage and replica
    argv = probe_argv(specs[-1], "s.json", "o.json")
    assert "distplan.validate.pp_probe" in argv and "--nproc-per-node=4" in argv


def test_prediction_is_the_most_loaded_rank():
    for spec in mx.pp_matrix({"gpus": 0}):
        ranks = predict_probe_ranks(spec)
        pred = predict_probe(spec)
        worst = max(ranks, key=lambda r: r["peak_bytes"])
        assert pred["memory"]["peak_allocated"] == worst["peak_bytes"]
        assert pred["collectives"] == worst["collectives"]
        assert {c["op"] for c in pred["collectives"]} >= {"send", "recv"}


@pytest.mark.parametrize("args, needle", [
    (["--pp", "2", "--strategy", "zero3"], "zero3 with --pp=2"),
    (["--pp-microbatches", "3"], "needs --pp > 1"),
    (["--pp", "2", "--precision", "bf16-mixed"], "runs fp32"),
    (["--pp", "2", "--tp", "2"], "--tp/--cp"),
    (["--pp", "2", "--matrix"], "--matrix"),
])
def test_validate_pp_refuses_what_the_probe_cannot_run(args, needle, tmp_path):
    r = CliRunner().invoke(main, ["validate", *args, "--out", str(tmp_path / "r.jsonl")])
    assert r.exit_code == 2, r.output
    assert needle in r.output and r.output.count("\n") == 1, r.output


@pytest.mark.slow
def test_validate_pp_end_to_end(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "r.jsonl"
    r = CliRunner().invoke(main, ["validate", "--pp", "2", "--layers", "8", "--json", "--out", str(out)])
    assert r.exit_code == 0, r.output[-3000:]
    rep = json.loads(r.output[r.output.index("{"):])
    assert len(rep["probes"]) == 2
    for p in rep["probes"]:
        cmp = p["comparison"]
        assert p["status"] == "ok" and cmp["verdict"] == "PASS", (p["id"], cmp.get("reasons"))
        assert abs(cmp["peak"]["error"]) <= 0.05 and cmp["collectives"]["exact"]
