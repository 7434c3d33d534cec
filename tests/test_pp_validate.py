"""Pipeline probes in `distplan validate` (issue 13): `--pp N` and the CPU matrix's 5 pipeline probes
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
    assert len(specs) == 5 and all(s["model"]["layers"] >= 8 and s["pp"] == 2 for s in specs)
    assert {s["strategy"] for s in specs} == {"single", "ddp", "zero3"}
    assert {s["schedule"] for s in specs} == {"1f1b", "gpipe"} and {s["dp"] for s in specs} == {1, 2}
    assert [s["cp"] for s in specs].count(2) == 1  # one probe of CP x PP (ring attention in each stage)
    assert mx.pp_matrix({"gpus": 2}) == []  # the pipeline probe runs gloo only
    assert not mx.pp_matrix({"gpus": 0}, ["fsdp"])
    assert [s["strategy"] for s in mx.pp_matrix({"gpus": 0}, ["zero3"])] == ["zero3"]
    # launched as the pipeline probe, one process per stage and replica
    argv = probe_argv(specs[2], "s.json", "o.json")
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
    (["--pp", "2", "--strategy", "fsdp"], "fsdp with --pp=2"),
    (["--pp", "2", "--layers", "8", "--pp-schedule", "zbv", "--activation-checkpointing", "full"],
     "accepted: --activation-checkpointing none"),
    (["--pp", "2", "--strategy", "zero1", "--pp-schedule", "gpipe"], "DDP reducer stops"),
    (["--pp", "2", "--strategy", "ddp", "--pp-schedule", "gpipe"], "DDP reducer stops"),
    (["--pp", "2", "--strategy", "ddp", "--pp-schedule", "interleaved-1f1b"], "DDP reducer stops"),
    (["--pp-microbatches", "3"], "needs --pp > 1"),
    (["--pp", "2", "--precision", "bf16-mixed"], "runs fp32"),
    (["--pp", "2", "--tp", "2"], "drop --tp"),
    (["--pp", "2", "--cp", "2", "--strategy", "single"], "under ddp"),
    (["--pp", "2", "--cp", "3"], "multiple of 2 x cp"),
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
    assert len(rep["probes"]) == 3  # single, ddp, zero3
    for p in rep["probes"]:
        cmp = p["comparison"]
        assert p["status"] == "ok" and cmp["verdict"] == "PASS", (p["id"], cmp.get("reasons"))
        assert abs(cmp["peak"]["error"]) <= 0.05 and cmp["collectives"]["exact"]


def test_cp_probe_prediction_has_the_ring_and_the_pipeline():
    """The CP x PP probe: every rank's prediction carries the ring's collectives (its stage's layers x the
    micro-batches; backward gathers K/V again, and the recompute too) and the s/cp-token boundary
    tensors; the ranks of a stage (its two cp ranks) predict the same."""
    spec = next(s for s in mx.pp_matrix({"gpus": 0}) if s["cp"] == 2)
    ranks = predict_probe_ranks(spec)
    assert len(ranks) == 4
    b, s, h = spec["train"]["micro_batch"], spec["train"]["seq_len"], spec["model"]["hidden"]
    for r in ranks:
        c = {x["op"]: x for x in r["collectives"]}
        assert c["all_to_all"]["calls"] == 4 * 4 * 2  # 4 layers x 4 micro-batches x cp ring shifts
        assert c["all_gather"]["calls"] == 3 * 4 * 4  # forward, backward and the recompute's forward
        assert c["send"]["message_bytes"] == b * (s // 2) * h * 4
    assert ranks[0]["peak_bytes"] == ranks[1]["peak_bytes"] and ranks[2]["peak_bytes"] == ranks[3]["peak_bytes"]
