"""Issue 13's tensor-parallel must-show: the standard probe (`validate/probe.py`) runs an 8-layer
Llama-style decoder split with torchtitan's plan over tp = 2 (loss parallel, with and without sequence
parallelism), alone (`single`: dp = 1) and under FSDP2 on the dp dimension of a (2, 2) mesh, on the fake
process group and on gloo (2 processes); the planner's `predict_probe` must give the peak within 5% and
every collective (op, group size, dtype, message bytes, calls) exactly, the TP group's included.

The fast tier checks the plumbing without torch probes: specs carry tp, the prediction holds the TP
collectives (loss parallel's three all-reduces, SP's norm-gradient all-reduces), `validate --tp` refuses
what the probes cannot run.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from distplan.planner.api import predict_probe
from distplan.planner.cli import main
from distplan.validate import matrix as mx

PEAK_TOLERANCE = 0.05
LLAMA8 = dict(mx.SHAPES_CPU["llama-tiny"], layers=mx.TP_LAYERS, name="llama-tiny-8l")
# 48 tokens per sequence: b*s*4 (loss parallel's all-reduces) differs from h*4 (SP's norm gradients)
TRAIN = dict(seq_len=48, micro_batch=2, grad_accum=1)


def _spec(strategy, mode, world, sp, precision, ckpt="none", micro_batch=2):
    return mx.make_spec(strategy, LLAMA8, world, mode, precision=precision, checkpointing=ckpt, tp=2,
                        sequence_parallel=sp, **dict(TRAIN, micro_batch=micro_batch))


def _tp_calls(pred: dict) -> dict:
    out: dict = {}
    for c in pred["collectives"]:
        k = (c["op"], c["dtype"], c["message_bytes"])
        out[k] = out.get(k, 0) + c["calls"]
    return out


# -- fast: plumbing ---------------------------------------------------------------------------------

def test_spec_and_prediction_carry_tensor_parallelism():
    s = _spec("single", "fake", 1, True, "fp32")
    assert s["world_size"] == 2 and s["tp"] == 2 and s["sequence_parallel"] is True
    assert s["id"] == "single/llama-tiny-8l/w2-fake/tp2-sp/none/fp32"
    n, h, L = 2 * 48, LLAMA8["hidden"], LLAMA8["layers"]
    calls = _tp_calls(predict_probe(s))
    assert calls[("all_reduce", "float32", n * 4)] == 3  # loss parallel: max, sum of exp, target logit
    assert calls[("all_reduce", "float32", h * 4)] == 3 * (2 * L + 1)  # AdamW reads each Partial grad 3x
    assert calls[("all_gather", "float32", n * h * 4)] == 4 * L + 2  # forward 2L + head, backward 2L + embed
    assert calls[("reduce_scatter", "float32", n * h * 4)] == 4 * L + 2
    plain = _tp_calls(predict_probe(_spec("single", "fake", 1, False, "fp32")))
    assert plain == {("all_reduce", "float32", n * 4): 3, ("all_reduce", "float32", n * h * 4): 4 * L + 2}
    # FSDP2 on the dp dimension: its own collectives besides the TP group's; norm gradients all-reduced
    # once each, in the unsharded parameter's dtype (bf16 under FSDP2 mixed precision)
    z3 = _tp_calls(predict_probe(dict(_spec("zero3", "fake", 4, True, "bf16-mixed"), torch_version="2.13")))
    assert z3[("all_reduce", "bfloat16", h * 2)] == 2 * L + 1
    # torch 2.15's FSDP2 makes the gradients in reduce_dtype (config.fsdp2_grads_in_reduce_dtype): fp32
    z3_215 = _tp_calls(predict_probe(dict(_spec("zero3", "fake", 4, True, "bf16-mixed"), torch_version="2.15")))
    assert z3_215[("all_reduce", "float32", h * 4)] == 2 * L + 1 and ("all_reduce", "bfloat16", h * 2) not in z3_215
    assert any(op == "reduce_scatter" and b != n * h * 4 for op, _, b in z3)


def test_tp_memory_is_one_ranks():
    one = predict_probe(mx.make_spec("single", LLAMA8, 1, "fake", precision="fp32", **TRAIN))["memory"]
    two = predict_probe(_spec("single", "fake", 1, False, "fp32"))["memory"]
    assert two["params"] < 0.55 * one["params"] and two["peak_allocated"] < one["peak_allocated"]


def test_standard_matrix_has_the_tp_probes():
    specs = [s for s in mx.standard_matrix({"gpus": 0}) if s.get("tp") and not s.get("cp")]  # cp: test_cp.py
    assert 2 <= len(specs) <= 4
    assert {s["strategy"] for s in specs} == {"single", "zero3", "zero2"}
    assert {s["sequence_parallel"] for s in specs} == {True, False}
    assert all(s["model"]["layers"] >= 8 for s in specs)
    assert {s["mode"] for s in specs if s["strategy"] == "single"} == {"cpu"}
    assert not [s for s in mx.standard_matrix({"gpus": 0}, ["ddp"]) if s.get("tp") and not s.get("cp")]


@pytest.mark.parametrize("args, needle", [
    (["--sequence-parallel"], "needs --tp > 1"),
    (["--tp", "2", "--strategy", "ddp"], "ddp with --tp=2"),
    (["--tp", "2", "--matrix"], "--matrix"),
    (["--tp", "3"], "--tp=3: must divide"),
    (["--tp", "2", "--strategy", "zero3", "--nproc", "2"], "needs a world of 2 x 2 ranks"),
])
def test_validate_tp_refuses_what_the_probes_cannot_run(args, needle, tmp_path):
    r = CliRunner().invoke(main, ["validate", *args, "--out", str(tmp_path / "r.jsonl")])
    assert r.exit_code == 2, r.output
    assert needle in r.output and r.output.count("\n") == 1, r.output


# -- slow: real probes ------------------------------------------------------------------------------

def _run(specs, tmp_path):
    pytest.importorskip("torch")
    from distplan.validate.runner import run_validation
    return run_validation(specs, str(tmp_path / "results.jsonl"), tolerance=PEAK_TOLERANCE, timeout_s=600,
                          jobs=2)


def _judge(records):
    for r in records:
        assert r["status"] == "ok", (r["id"], r["measurement"].get("error"))
        cmp = r["comparison"]
        m = r["measurement"]["memory"]
        print(f"{r['id']}: predicted {r['prediction']['memory']['peak_allocated']} measured "
              f"{m['peak_allocated']} B ({100 * cmp['peak']['error']:+.2f}%)")
        assert abs(cmp["peak"]["error"]) <= PEAK_TOLERANCE, r["id"]
        assert cmp["collectives"]["exact"], (r["id"], [x for x in cmp["collectives"]["rows"] if not x["match"]])
        # the TP group's collectives were measured, not absent on both sides
        tp_rows = [x for x in cmp["collectives"]["rows"] if x["group_size"] == 2 and x["op"] == "all_reduce"]
        assert tp_rows and all(x["measured_calls"] > 0 for x in tp_rows), r["id"]


@pytest.mark.slow
def test_tp2_fake_process_group(tmp_path):
    specs = [_spec("single", "fake", 1, sp, prec) for sp in (False, True) for prec in ("fp32", "bf16-mixed")]
    # 4 sequences: the peak moves from the optimizer step into backward (activations, loss parallel)
    specs += [_spec("single", "fake", 1, sp, "fp32", micro_batch=4) for sp in (False, True)]
    specs += [_spec("single", "fake", 1, True, "fp32", ckpt="full"),
              _spec("zero3", "fake", 4, True, "fp32"), _spec("zero2", "fake", 4, False, "bf16-mixed")]
    _judge(_run(specs, tmp_path))


@pytest.mark.slow
def test_tp2_gloo_two_processes(tmp_path):
    specs = [_spec("single", "cpu", 1, False, "fp32"), _spec("single", "cpu", 1, True, "fp32"),
             _spec("single", "cpu", 1, True, "bf16-mixed")]
    _judge(_run(specs, tmp_path))
