"""The analytic front end (the decoder formulas that `--model`, `--params` and `--hf-config --front-end
analytic` use) against what CPU probes measured on the transformers models themselves: every committed
`benchmarks/results/cpu-*-hf*.jsonl` record of a model type it reads (llama, mistral, qwen2, phi3, gpt2,
gemma2), re-predicted from the record's config.

The probes ran the Hugging Face modules, not the reference decoder the formulas were derived from, so
this is the check that the formulas hold for the model a user trains. No tracing: fast tier.
"""

from __future__ import annotations

import glob
import json
import os
import statistics

from distplan.planner.api import predict_probe
from distplan.validate.results import record_spec
from distplan.planner.hf_config import read_hf_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "cpu-*-hf*.jsonl")))
ANALYTIC_TYPES = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "gemma2"}


def _records():
    out = []
    for path in FILES:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                r = json.loads(line)
                with open(os.path.join(ROOT, r["inputs"]["module"]["hf_config"])) as g:
                    if json.load(g)["model_type"] in ANALYTIC_TYPES and r["status"] == "ok":
                        out.append(r)
    return out


def _analytic_peak(r) -> int:
    spec = record_spec(r)
    spec.pop("module")
    spec["model"] = read_hf_config(os.path.join(ROOT, r["inputs"]["module"]["hf_config"]), implementation=True)
    if r["inputs"]["module"].get("layers"):  # `validate --layers N` cut the published config to N blocks
        spec["model"]["layers"] = int(r["inputs"]["module"]["layers"])
    return predict_probe(spec)["memory"]["peak_allocated"]


def test_formulas_repredict_the_measured_hf_peaks():
    recs = _records()
    assert len(recs) >= 150
    errors = {r["id"]: _analytic_peak(r) / r["measurement"]["memory"]["peak_allocated"] - 1 for r in recs}
    worst = sorted(errors.items(), key=lambda kv: -abs(kv[1]))[:5]
    print("analytic vs measured HF peaks:", len(errors), "probes, median |error|",
          f"{statistics.median(abs(e) for e in errors.values()):.2%}; worst",
          [(i, f"{e:+.2%}") for i, e in worst])
    bad = {i: round(100 * e, 2) for i, e in errors.items() if abs(e) > 0.05}  # validate's peak rule
    assert not bad, bad
    assert statistics.median(abs(e) for e in errors.values()) <= 0.005


REFERENCE = os.path.join(ROOT, "benchmarks", "results", "cpu-torch2.13-2026-11-24-blockpeak-analytic.jsonl")


def test_formulas_repredict_their_own_probes_at_block_peaks():
    """`validate --front-end analytic` records (the reference decoder of the same wide-block shape, so the
    peak is at a block's post-backward; fsdp, fsdp-grad-op, fsdp-no-shard, zero2, zero3 x fp32,
    bf16-mixed x none, full): the peaks within 1%. FSDP1 with full checkpointing peaks at block 1's
    reduce-scatter, next to the gradient shards of the blocks after it; walked at the first block only,
    the formulas were 11.3% (bf16-mixed) and 7.9% (fp32) under."""
    with open(REFERENCE) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    assert len(recs) == 20 and all(r["status"] == "ok" for r in recs)
    errors = {r["id"]: predict_probe(record_spec(r))["memory"]["peak_allocated"]
              / r["measurement"]["memory"]["peak_allocated"] - 1 for r in recs}
    bad = {i: round(100 * e, 2) for i, e in errors.items() if abs(e) > 0.01}
    assert not bad, bad


REALSIZE = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "cpu-*-realsize-hf.jsonl")))


def test_formulas_at_published_width_and_depth():
    """The probes of published configs at their full width and depth (benchmarks/cpu-realsize-plan.yaml:
    Qwen2.5-0.5B, GPT-2 medium, Llama-3.2-1B, Qwen3-0.6B, Gemma-2-2B; 8 and 64 fake ranks): the formulas within
    0.5% of every measured peak. Among them Qwen2.5-0.5B under zero2 and fsdp-grad-op in fp32 at 256 tokens,
    whose peak is the LM head's backward (its V x h weight gradient beside the logits' gradient, wider than
    the loss's two n x V tensors when h > 2n): -2.96% and -1.63% before the walk had that instant."""
    recs = []
    for path in REALSIZE:
        with open(path) as f:
            recs += [json.loads(line) for line in f if line.strip()]
    assert len(recs) >= 30 and all(r["status"] == "ok" for r in recs)
    errors = {r["id"]: _analytic_peak(r) / r["measurement"]["memory"]["peak_allocated"] - 1 for r in recs}
    # zero3 of Llama-3.2-1B in fp32 accumulating 2 micro-steps without sync: the peak is at a block's MLP
    # output projection's backward, its new weight gradient not yet added into the kept .grad
    # (memory._in_place_block_peak); -0.57% (the dangerous side) when the walk counted none there.
    accum = errors["zero3/hf:tests/data/hf/llama-3.2-1b.json/w8-fake/none/fp32/accum2-last"]
    assert abs(accum) < 0.001, accum
    bad = {i: round(100 * e, 3) for i, e in errors.items() if abs(e) > 0.005}
    assert not bad, bad
    head = [i for i in errors if i.startswith(("zero2/", "fsdp-grad-op/")) and "qwen2.5-0.5b" in i and i.endswith("/fp32")]
    assert len(head) == 2 and all(abs(errors[i]) < 0.001 for i in head), {i: errors[i] for i in head}


SHALLOW = os.path.join(ROOT, "benchmarks", "results", "cpu-torch2.13-2026-11-28-accum-shallow.jsonl")


def test_formulas_of_a_later_micro_step_at_the_tied_embedding():
    """Llama-3.2-1B's width at 2 layers (a 128K tied vocabulary over a shallow model), zero3 fp32 over 2
    micro-steps without sync: the peak is the tied embedding's backward of the last micro-step, its dense
    gradient, the head's half and their sum alive beside every unit's kept .grad. The formulas have that
    instant (`snap_tied_embedding`); so, now, does the trace (test_hf_results: it was -17.1%)."""
    with open(SHALLOW) as f:
        (r,) = [json.loads(line) for line in f if line.strip()]
    assert r["inputs"]["module"]["layers"] == 2 and r["inputs"]["train"]["grad_accum"] == 2
    err = _analytic_peak(r) / r["measurement"]["memory"]["peak_allocated"] - 1
    assert abs(err) < 0.001, err


ACCUM = os.path.join(ROOT, "benchmarks", "results", "cpu-torch2.13-2026-11-28-accum-hf.jsonl")


def test_formulas_of_later_micro_steps():
    """Accumulation over 2 micro-steps in fp32 (benchmarks/cpu-accum-plan.yaml: Qwen2.5-0.5B at 8 and 24 layers,
    Qwen3-0.6B and GPT-2 medium at 8; zero2, zero3, ddp; sync last and every): every peak within 0.1%. Five of
    the nine peak at the LM head's backward of a later micro-step, its new V x h weight gradient alive until
    AccumulateGrad adds it into the kept .grad: -1.6% to -3.75% when the walk had that instant only without
    accumulation."""
    with open(ACCUM) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    assert len(recs) == 9 and all(r["status"] == "ok" and r["inputs"]["train"]["grad_accum"] == 2 for r in recs)
    errors = {r["id"]: _analytic_peak(r) / r["measurement"]["memory"]["peak_allocated"] - 1 for r in recs}
    bad = {i: round(100 * e, 3) for i, e in errors.items() if abs(e) > 0.001}
    assert not bad, bad


CROSSCHECK = os.path.join(ROOT, "benchmarks", "results", "cpu-torch2.13-2026-11-28-crosscheck-hf.jsonl")


def test_formulas_where_they_disagreed_most_with_the_trace():
    """The four configurations of an 840-point grid where the formulas and the trace disagreed most, probed
    (benchmarks/results/README.txt). GPT-2 medium under ddp bf16-mixed accumulating 2 micro-steps peaks at the
    backward of the LM head's 16-bit weight cast (its 16-bit and fp32 weight gradients alive): -1.36% before
    the walk had that instant, now within 0.1%. Mistral-7B's width under fsdp (FSDP1) bf16-mixed accumulating
    peaks at a block's reduce-scatter of the last micro-step, where the new flat gradient, added in place into
    the kept one, is still held by the post-backward hook (a hook of the FlatParameter's AccumulateGrad):
    -1.09% before, now within 0.1%. The other two are asserted as they are: Phi-3-mini zero3 fp32 -0.12%, GPT-2
    medium zero3 fp32 full checkpointing at 1024 tokens +2.7% (the safe side)."""
    with open(CROSSCHECK) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    errors = {r["inputs"]["strategy"] + "/" + os.path.basename(r["inputs"]["module"]["hf_config"])[:-5]:
              _analytic_peak(r) / r["measurement"]["memory"]["peak_allocated"] - 1 for r in recs}
    assert abs(errors["ddp/gpt2-medium"]) < 0.001, errors
    assert -0.002 < errors["zero3/phi-3-mini"] < 0, errors
    assert abs(errors["fsdp/mistral-7b"]) < 0.001, errors
    assert 0.02 < errors["zero3/gpt2-medium"] < 0.03, errors
