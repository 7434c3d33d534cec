"""Tensor, pipeline and context parallelism on the transformers models themselves (issue 13 on the models users
train):
`distplan validate --hf-config PATH --tp 2` builds the transformers model, splits it with the plan torchtitan
applies to transformers models (`validate/tp_probe.parallelize_hf`), keeps transformers' own loss on the
vocabulary-sharded logits; `--pp 2` splits it into pipeline stages as torchtitan does
(`validate/pp_probe.build_hf_stage`), transformers' loss as the schedule's loss_fn; `--cp 2` makes transformers'
SDPA call ring attention over the cp group on each rank's head-tail positions (`validate/cp.hf_context_parallel`).
All are judged against the analytic front end's prediction (the trace follows none); `distplan estimate
--hf-config --tp/--pp/--cp` picks the analytic front end by itself and says why.

The fast tier checks the plumbing (specs, prediction, refusals); the slow tier runs probes on the fake process
group and gloo. The committed campaigns (benchmarks/cpu-tp-hf-plan.yaml, cpu-pp-hf-plan.yaml) are re-predicted
with the other transformers results by tests/test_hf_results.py.
"""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from distplan.planner.api import plan, predict_probe
from distplan.planner.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF = os.path.join(ROOT, "examples", "hf")


def _dry(tmp_path, *args):
    return CliRunner().invoke(main, ["validate", "--hf-config", *args, "--dry-run", "--out",
                                     str(tmp_path / "r.jsonl")])


def _probe_specs(tmp_path, *arg_lists) -> list[dict]:
    """The specs of `validate` runs, one per argument list (captured at the runner, nothing runs)."""
    from distplan.validate import runner
    specs = []
    mp = pytest.MonkeyPatch()
    mp.setattr(runner, "run_validation", lambda s, *a, **k: specs.extend(s) or [])
    try:
        for args in arg_lists:
            r = CliRunner().invoke(main, ["validate", *args, "--out", str(tmp_path / "x.jsonl")])
            assert r.exit_code == 0, r.output
    finally:
        mp.undo()
    return specs


def _run(specs, tmp_path, jobs: int) -> list[dict]:
    from distplan.validate import runner
    return runner.run_validation(specs, str(tmp_path / "results.jsonl"), tolerance=0.05, timeout_s=600, jobs=jobs)


def _specs(tmp_path, *args) -> list[dict]:
    """The probe specs `validate --hf-config ARGS` would run."""
    return _probe_specs(tmp_path, ["--hf-config", *args])


def test_validate_hf_tp_specs_carry_the_model_and_the_split(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    specs = _specs(tmp_path, os.path.join(HF, "llama-8l.json"), "--tp", "2", "--sequence-parallel",
                   "--simulate-world-size", "4", "--seq-len", "64", "--micro-batch", "2", "--precision", "bf16-mixed")
    assert [s["strategy"] for s in specs] == ["single", "zero2", "zero3"]
    for s in specs:
        assert s["tp"] == 2 and s["sequence_parallel"] is True
        assert s["module"]["hf_config"].endswith("llama-8l.json") and s["module"]["seq_len"] == 64
        assert s["model"]["hf_model_type"] == "llama"  # the analytic terms for transformers' Llama
        assert s["id"].startswith(f"{s['strategy']}/hf:{s['module']['hf_config']}/") and "/tp2-sp/" in s["id"]
    # predicted by the analytic front end: the TP group's collectives (loss parallel's three all-reduces of
    # the b x s fp32 maxima / sums / target logits) beside FSDP2's
    n, h = 2 * 64, s["model"]["hidden"]
    pred = predict_probe(dict(specs[2], torch_version="2.13"))
    rows = {(c["op"], c["group_size"], c["dtype"], c["message_bytes"]): c["calls"] for c in pred["collectives"]}
    assert rows[("all_reduce", 2, "float32", n * 4)] == 3
    # SP: the norm weights' Partial gradients, all-reduced once each before FSDP2's reduce-scatter (bf16 through
    # torch 2.14, fp32 from 2.15: config.fsdp2_grads_in_reduce_dtype)
    assert rows[("all_reduce", 2, "bfloat16", h * 2)] == 2 * 8 + 1
    assert rows[("all_gather", 2, "bfloat16", n * h * 2)] and rows[("reduce_scatter", 2, "bfloat16", n * h * 2)]
    # the same numbers as the public API's plan of that config
    p = plan(hf_config=os.path.join(HF, "llama-8l.json"), gpus=4, gpus_per_node=4, seq_len=64, micro_batch=2,
             precision="bf16-mixed", tp=2, sequence_parallel=True, strategies=["zero3"], front_end="analytic")
    assert p.train.model.hf_model_type == "llama" and p.train.tp == 2


@pytest.mark.parametrize("config, needle", [
    ("phi3-8l.json", "model_type 'phi3'"),  # fused qkv_proj / gate_up_proj
    ("gpt2-8l.json", "model_type 'gpt2'"),  # Conv1D c_attn
])
def test_validate_hf_tp_refuses_what_the_probe_cannot_split(config, needle, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    r = _dry(tmp_path, os.path.join(HF, config), "--tp", "2", "--simulate-world-size", "4", "--seq-len", "64")
    assert r.exit_code == 2, r.output
    assert needle in r.output and r.output.count("\n") == 1, r.output


def test_validate_hf_tp_splits_a_tied_head(tmp_path):
    """A tied head (Qwen2's small models, Llama-3.2): the embedding and the LM head stay one parameter, a
    Shard(0) DTensor over the vocabulary (validate/tp_probe.parallelize_hf ties them again after the split)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    specs = _specs(tmp_path, os.path.join(HF, "qwen2-8l.json"), "--tp", "2", "--simulate-world-size", "4",
                   "--seq-len", "64", "--strategy", "zero3")
    assert specs[0]["model"]["tie_embeddings"] and specs[0]["tp"] == 2


def test_validate_hf_tp_refuses_eager_attention_with_sequence_parallelism(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    args = [os.path.join(HF, "llama-8l.json"), "--tp", "2", "--simulate-world-size", "4", "--seq-len", "64",
            "--attention", "eager"]
    r = _dry(tmp_path, *args, "--sequence-parallel")
    assert r.exit_code == 2 and "--attention eager with --sequence-parallel" in r.output, r.output
    assert _dry(tmp_path, *args).exit_code == 0  # without SP the eager model splits


def test_estimate_hf_tp_uses_the_analytic_front_end_and_says_why():
    path = os.path.join(ROOT, "tests", "data", "hf", "llama-3-8b.json")
    r = CliRunner().invoke(main, ["estimate", "--hf-config", path, "--gpus", "16", "--tp", "2", "--seq-len", "4096",
                                  "--gpu", "h100", "--strategy", "zero3", "--json"])
    assert r.exit_code == 0, r.output
    notes = json.loads(r.output)["inputs"]["notes"]
    assert any("front end: analytic" in n and "the trace does not follow --tp" in n for n in notes), notes
    r = CliRunner().invoke(main, ["estimate", "--hf-config", path, "--gpus", "16", "--tp", "2", "--front-end", "trace"])
    if "needs torch and transformers" not in r.output:  # (without them: that error instead)
        assert r.exit_code == 2 and "drop --front-end trace" in r.output and r.output.count("\n") == 1, r.output


# -- slow: real probes ------------------------------------------------------------------------------

@pytest.mark.slow
def test_hf_tp_probes_pass(tmp_path):
    """Llama (transformers) at 8 layers split over tp = 2, at 2 x 256 tokens: without SP on 2 gloo processes
    (fp32), with SP under FSDP2 zero3 on the fake process group's (2, 2) mesh (bf16 mixed precision, and fp32
    with full checkpointing). Peak within 5%, every component within the rule, every collective exact."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    common = ["--hf-config", os.path.join(HF, "llama-8l.json"), "--tp", "2", "--seq-len", "256", "--micro-batch", "2",
              "--simulate-world-size", "4", "--steps", "1"]
    specs = _probe_specs(tmp_path, *[common + extra for extra in (
        ["--strategy", "single", "--precision", "fp32"],
        ["--strategy", "zero3", "--sequence-parallel", "--precision", "bf16-mixed"],
        ["--strategy", "zero3", "--sequence-parallel", "--precision", "fp32", "--activation-checkpointing", "full"])])
    assert len(specs) == 3
    for r in _run(specs, tmp_path, jobs=2):
        assert r["status"] == "ok", (r["id"], r["measurement"].get("error"))
        cmp = r["comparison"]
        assert abs(cmp["peak"]["error"]) <= 0.05, (r["id"], cmp["peak"])
        assert cmp["verdict"] == "PASS", (r["id"], cmp["reasons"])
        tp_rows = [x for x in cmp["collectives"]["rows"] if x["group_size"] == 2 and x["op"] == "all_reduce"]
        assert tp_rows and all(x["measured_calls"] > 0 for x in tp_rows), r["id"]


# -- pipeline parallelism ---------------------------------------------------------------------------

def test_validate_hf_pp_specs_carry_the_model_and_the_stages(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    specs = _specs(tmp_path, os.path.join(HF, "llama-8l.json"), "--pp", "2", "--seq-len", "64",
                   "--micro-batch", "2")
    assert [s["strategy"] for s in specs] == ["single", "ddp", "zero3"]
    for s in specs:
        assert s["pp"] == 2 and s["schedule"] == "1f1b" and s["microbatches"] == 4
        assert s["module"]["hf_config"].endswith("llama-8l.json") and s["model"]["hf_model_type"] == "llama"
        assert s["id"].startswith(f"{s['strategy']}/hf:{s['module']['hf_config']}/") and "/pp2-1f1b-m4/" in s["id"]
    pred = predict_probe(specs[0])  # the pipeline walk: one stage's half of the layers, its send/recv
    whole = plan(hf_config=os.path.join(HF, "llama-8l.json"), gpus=1, seq_len=64, micro_batch=2, precision="fp32",
                 strategies=["single"], front_end="analytic").results[0].memory.components["params"]
    assert pred["memory"]["params"] < 0.6 * whole
    assert {c["op"] for c in pred["collectives"]} == {"send", "recv"}


@pytest.mark.parametrize("args, needle", [
    (["phi3-8l.json", "--pp", "2", "--cp", "2"], "--cp"),
    (["gpt2-8l.json", "--pp", "2"], "model_type 'gpt2'"),
    (["llama-8l.json", "--pp", "2", "--attention", "eager"], "drop --attention eager"),
    (["qwen2-8l.json", "--pp", "2"], "untied LM head"),
])
def test_validate_hf_pp_refuses_what_the_probe_cannot_split(args, needle, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    r = _dry(tmp_path, os.path.join(HF, args[0]), *args[1:], "--seq-len", "64")
    assert r.exit_code == 2, r.output
    assert needle in r.output and r.output.count("\n") == 1, r.output


@pytest.mark.slow
def test_hf_pp_probes_pass(tmp_path):
    """Llama (transformers) at 8 layers in 2 stages, 4 micro-batches of 2 x 64 tokens, on gloo: 1F1B alone and
    with full checkpointing under DDP over 2 replicas. Peak within 5%, every component within the rule, the
    point-to-point sends and receives exact."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    common = ["--hf-config", os.path.join(HF, "llama-8l.json"), "--pp", "2", "--seq-len", "64", "--micro-batch", "2"]
    specs = _probe_specs(tmp_path, common + ["--strategy", "single"],
                         common + ["--strategy", "ddp", "--activation-checkpointing", "full"])
    assert len(specs) == 2
    for r in _run(specs, tmp_path, jobs=1):
        assert r["status"] == "ok", (r["id"], r["measurement"].get("error"))
        cmp = r["comparison"]
        assert cmp["verdict"] == "PASS", (r["id"], cmp["reasons"])
        assert {x["op"] for x in cmp["collectives"]["rows"]} >= {"send", "recv"}


# -- context parallelism ----------------------------------------------------------------------------

def test_validate_hf_cp_specs_and_refusals(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    specs = _specs(tmp_path, os.path.join(HF, "qwen2-8l.json"), "--cp", "2", "--simulate-world-size",
                   "4", "--seq-len", "64", "--strategy", "zero3,ddp")
    for s in specs:
        assert s["cp"] == 2 and s["module"]["hf_config"].endswith("qwen2-8l.json") and "/cp2/" in s["id"]
        assert s["model"]["hf_model_type"] == "qwen2"  # a tied head is fine for CP
    rows = {(c["op"], c["group_size"]) for c in predict_probe(specs[0])["collectives"]}
    assert ("all_gather", 2) in rows  # the ring's K/V all-gather over the cp pair
    ddp = {(c["op"], c["dtype"], c["message_bytes"]) for c in predict_probe(specs[1])["collectives"]}
    assert ("broadcast", "float32", specs[1]["model"]["hidden"] // specs[1]["model"]["heads"] * 4) in ddp  # inv_freq x 2
    for args, needle in ((["gpt2-8l.json", "--cp", "2"], "model_type 'gpt2'"),
                         (["llama-8l.json", "--cp", "2", "--attention", "eager"], "drop --attention eager")):
        r = _dry(tmp_path, os.path.join(HF, args[0]), *args[1:], "--seq-len", "64", "--simulate-world-size", "4")
        assert r.exit_code == 2 and needle in r.output and r.output.count("\n") == 1, r.output


@pytest.mark.slow
def test_hf_cp_probe_on_gloo_passes(tmp_path):
    """Llama (transformers) at 8 layers, 2 x 128 tokens, cp = 2 on 2 gloo processes under DDP: the ring's
    all-gathers and all-to-alls executed; peak, components and collectives within the rule."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    specs = _probe_specs(tmp_path, ["--hf-config", os.path.join(HF, "llama-8l.json"), "--cp", "2", "--nproc", "2",
                                    "--strategy", "ddp", "--seq-len", "128", "--micro-batch", "2", "--steps", "1"])
    (rec,) = _run(specs, tmp_path, jobs=1)
    assert rec["status"] == "ok", rec["measurement"].get("error")
    assert rec["comparison"]["verdict"] == "PASS", rec["comparison"]["reasons"]
    assert {x["op"] for x in rec["comparison"]["collectives"]["rows"]} >= {"all_gather", "all_to_all", "all_reduce"}
