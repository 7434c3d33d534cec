"""The committed CPU validation of Hugging Face models (benchmarks/results/cpu-*-hf.jsonl: `distplan validate
--hf-config` on the transformers models themselves, gloo and the fake process group) re-predicted with the
trace front end as it is now, so CI notices when a change to the trace or the walk moves away from what the
probes measured. The known gaps are named here and asserted as what they are (peak within tolerance,
components split differently at the peak instant).
"""

from __future__ import annotations

import glob
import json
import os
import statistics

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # re-traces every model in every regime (about a minute on 2 cores)

from distplan.planner.accuracy import PEAK_ALLOCATED  # noqa: E402
from distplan.planner.api import predict_probe  # noqa: E402
from distplan.validate.results import record_spec  # noqa: E402
from distplan.planner.config import NEWEST_TORCH, torch_release  # noqa: E402
from distplan.validate.compare import compare  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "cpu-*-hf.jsonl")))

KNOWN_GAPS = {
    # DDP with eager attention and full checkpointing at 2 x 1024 tokens (cpu-torch2.13-2026-11-28-eager-hf.jsonl):
    # the peak is inside block 0's recompute, at the attention's backward; the trace walk's instant holds block
    # 0's kept input (2 MiB of activations) where the run's holds the MLP's and o_proj's new weight gradients
    # instead (peaks -0.21% to -0.39%; zero3 and fsdp exact; the formulas within +0.7%)
    "ddp/hf:examples/hf/llama-8l.json/w8-fake/full/fp32/eager",
    "ddp/hf:examples/hf/llama-8l.json/w8-fake/full/bf16-mixed/eager",
    "ddp/hf:examples/hf/gpt2-8l.json/w8-fake/full/bf16-mixed/eager",
    # (Gloo probes of 2 processes are judged by their peak and collectives only, their components shown:
    # validate/compare.components_judged. Three were listed here for a component split at the peak instant
    # while their peaks held: fsdp-grad-op qwen2-8l w2 bf16-mixed (temporaries, peak -1.96%), zero3
    # gemma2-8l w2 fp32 (peak +0.43%), zero3 qwen2moe-8l w2 fp32 (peak +0.5%).)
    # Qwen2-MoE (shared expert + 8 routed experts per layer) under FSDP2 zero3 without checkpointing, fp32 and
    # bf16-mixed, 8 fake ranks and gloo 2 ranks: the walk peaks inside the last layer's forward with the root,
    # that layer's parameters and its kept all-gather output (+0.5% to +0.6%, the safe side); the measured peak
    # is early in the backward, with the root, one layer, and the LM head's gradient beside the logits'
    # (2 MiB of temporaries). Mixtral's zero3 (the same experts' code without a shared expert) is exact.
    "zero3/hf:examples/hf/qwen2moe-8l.json/w8-fake/none/fp32",
    "zero3/hf:examples/hf/qwen2moe-8l.json/w8-fake/none/bf16-mixed",
    # FSDP2's dim-0 padding of the stacked experts (more ranks than experts: 16 and 32 fake ranks,
    # cpu-torch2.13-2026-11-27-moe-padding-hf.jsonl), bf16-mixed. Mixtral zero2: peak +0.04% and +0.6%, but
    # the walk's instant holds 512 KiB of gradients the measured one does not. Qwen2-MoE zero3 at 16 ranks:
    # +3.1% (the safe side), the measured instant has 2 MiB of temporaries the walk's has not; at 32 ranks
    # and in fp32 the same probe is exact.
    "zero2/hf:examples/hf/mixtral-8l.json/w16-fake/none/bf16-mixed",
    "zero2/hf:examples/hf/mixtral-8l.json/w32-fake/none/bf16-mixed",
    "zero3/hf:examples/hf/qwen2moe-8l.json/w16-fake/none/bf16-mixed",
    # The same models accumulating over 2 micro-steps at 16 fake ranks
    # (cpu-torch2.13-2026-11-27-moe-padding-accum-hf.jsonl; every peak within 2.8% since FSDP2's accumulated
    # gradients are counted at their real shapes, not padded: +62% and +21% before). Components split
    # differently at the peak instant: Mixtral zero2 bf16-mixed synced every micro-step (grads +15%, peak
    # +0.03%); Qwen2-MoE zero3 fp32 and bf16-mixed (+2.75%, +1.75%: the walk's forward instant, as without
    # accumulation). (Mixtral fsdp fp32, comm buffers +31%, passes since FSDP1's flat gradient accumulated in
    # place is walked as a temporary.)
    "zero2/hf:examples/hf/mixtral-8l.json/w16-fake/none/bf16-mixed/accum2-every",
    "zero3/hf:examples/hf/qwen2moe-8l.json/w16-fake/none/fp32/accum2-last",
    "zero3/hf:examples/hf/qwen2moe-8l.json/w16-fake/none/bf16-mixed/accum2-last",
    # Phi-3-mini at 8 layers, zero3 fp32 over 2 micro-steps, 1024 tokens (cpu-torch2.13-2026-11-28-crosscheck-hf.jsonl):
    # the peak is a forward instant of a later micro-step; the trace walk's is the last block's forward with its
    # all-gather output (+1.29%, the safe side; activations +28%, comm buffers -21%), the measured one and the
    # formulas' (-0.12%) the last block's copy-out, the previous and this block's all-gather outputs beside
    # its parameters.
    "zero3/hf:tests/data/hf/phi-3-mini.json/w8-fake/none/fp32/accum2-last",
}
KNOWN_GAPS_215: set = set()
"""Known gaps of the records made on torch 2.15 and later only (their ids pass on 2.13)."""


def _known_gap(r) -> bool:
    return r["id"] in KNOWN_GAPS or (r["id"] in KNOWN_GAPS_215 and torch_release(r["torch_version"]) >= (2, 15))


# Closed on 2026-11-29: the schedules `_PipelineScheduleRuntime` runs (interleaved 1F1B +3.5%, ZB-V +2.0%,
# interleaved ZB +2.2%) on torch 2.15 (cpu-torch2.15-2026-11-29-pp-hf.jsonl, the transformers Llama on 2 ranks),
# where 2.15 lowers them with `_add_send_recv` / `_add_wait_send` (each receive buffer made at its RECV, a
# forward send retired right after its backward) and the walk kept 2.13's buffers for the run and every send to
# the step's end; now ported (pp.lowered_actions, pp.runtime_boundary_tensors): comm buffers exact.
# Closed on 2026-11-29: interleaved 1F1B of the transformers Llama (alone and under FSDP2 zero3, torch 2.13:
# peak -0.1%, temporaries -33%), where the walk merged each chunk's two MLP-backward instants into one (the
# activations the MLP backward frees counted beside the larger temporaries); now walked as one stage's.
# Closed on 2026-11-29: pipeline stages on torch 2.15 (the transformers Llama, 1F1B, alone and under DDP /
# FSDP2 over 2 replicas: peaks +1.3% to +2.2%), where torch 2.15's PipelineStage makes each receive buffer
# right before its receive (torch/distributed/pipelining/_recv_buffers.py) and drops a sent output once its
# send completes, and the stage walk kept 2.13's buffers, one per micro-batch for the run
# (config.pp_recv_buffers_per_receive).
# Closed on 2026-11-27: FSDP1 in fp32 with a tied 64k-vocabulary head (gemma2-vocab64k-2l, fsdp and
# fsdp-grad-op), where the walk's root concatenation counted the tied head's and the embedding's gradients
# beside the view gradient they are summed into, and peaked there instead of at the embedding's backward
# (cpu-torch2.13-2026-11-27-tied64k-hf.jsonl: the same in a tied Llama, +13.7% before).
# Closed on 2026-11-24: full checkpointing of the wide llama blocks (fsdp and zero3, w8-fake, fp32 and
# bf16-mixed), where the walk left out the RoPE tables a checkpointed layer keeps as inputs (the trace now
# records each unit's shared tensor inputs, module_probe `shared_inputs`); and zero3 of llama-8l with full
# and every-2 checkpointing in fp32 (-2.8%, -1.5%), where gloo's reduce-scatter of the root held more than
# the walk knew: the root's last parameter's unsharded gradient, which `foreach_reduce` keeps to its end.


@pytest.fixture(scope="module")
def repredicted():
    recs = []
    for path in FILES:
        with open(path) as f:
            recs += [json.loads(line) for line in f if line.strip()]
    if not recs:
        pytest.skip("no committed HF results")
    cwd = os.getcwd()
    os.chdir(ROOT)  # the records name examples/hf/... relative to the repository
    try:
        return [(r, compare(predict_probe(record_spec(r)), r["measurement"])) for r in recs]
    finally:
        os.chdir(cwd)


def _repredict_one(name: str):
    """(record, its comparison) of a results file holding one record, re-predicted from the repository root."""
    with open(os.path.join(ROOT, "benchmarks", "results", name)) as f:
        (r,) = [json.loads(line) for line in f if line.strip()]
    cwd = os.getcwd()
    os.chdir(ROOT)  # the records name examples/hf/... relative to the repository
    try:
        return r, compare(predict_probe(record_spec(r)), r["measurement"])
    finally:
        os.chdir(cwd)


def _type(r) -> str:
    return r["inputs"]["module"]["hf_config"].split("/")[-1].split("-")[0]


def test_results_are_real_runs_of_every_model_type(repredicted):
    assert len(repredicted) >= 90
    types = {_type(r) for r, _ in repredicted}
    assert types >= {"llama", "qwen2", "gpt2", "mistral", "phi3", "gemma2", "qwen3"}
    # on the pinned torch and on the newest release the model follows (config.NEWEST_TORCH)
    by_release = {}
    for r, _ in repredicted:
        by_release.setdefault(torch_release(r["torch_version"]), set()).add(_type(r))
    assert by_release[(2, 13)] >= {"llama", "qwen2", "gpt2"}
    assert by_release[NEWEST_TORCH] >= {"llama", "qwen2", "gpt2", "mistral", "phi3", "gemma2", "qwen3"}
    for r, _ in repredicted:
        assert r["status"] == "ok", r["id"]
        assert int(r["inputs"]["module"].get("layers") or 8) >= 8


def test_peaks_within_tolerance(repredicted):
    errors = [abs(c["peak"]["error"]) for _, c in repredicted]
    bad = {r["id"]: round(c["peak"]["error"] * 100, 2) for r, c in repredicted if abs(c["peak"]["error"]) > 0.05}
    assert not bad, bad
    assert statistics.median(errors) <= 0.005


def test_the_printed_cpu_band_is_the_matrix_of_2026_11_23(repredicted):
    """accuracy.PEAK_ALLOCATED["trace-hf-cpu"], printed under a traced Hugging Face model's memory table planned
    for the CPU target (`--device cpu`), is the |peak error| of the 90 probes of
    cpu-torch2.13-2026-11-23-hf.jsonl: the median to 0.05%. The max (0.78% re-predicted in a process of its
    own) is not tied here: in CI's shared xdist worker, after other test files, one of these records
    re-predicted at 1.27% (2026-12-06) -- a prediction that depends on what ran before it in the process,
    open; tests/test_golden.py's cold-answer test covers the analytic front end only."""
    def key(r) -> str:  # ids repeat between the results files: a record is known by its whole content
        return json.dumps(r, sort_keys=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "cpu-torch2.13-2026-11-23-hf.jsonl")) as f:
        wanted = {key(json.loads(line)) for line in f if line.strip()}
    errors = list({key(r): abs(c["peak"]["error"]) for r, c in repredicted if key(r) in wanted}.values())
    assert len(wanted) == len(errors) == 90
    band = PEAK_ALLOCATED["trace-hf-cpu"]
    assert abs(statistics.median(errors) - band["median"]) < 0.0005
    assert max(errors) <= 0.05  # test_peaks_within_tolerance's bound


def test_collectives_exact(repredicted):
    bad = [r["id"] for r, c in repredicted if not c["collectives"]["exact"]]
    assert not bad, bad


def test_every_component_passes_but_the_known_gaps(repredicted):
    # ids repeat across files (the same strategy and config at another sequence length): judged per record
    bad = {r["id"]: c["verdict"] for r, c in repredicted if c["verdict"] != "PASS" and not _known_gap(r)}
    assert not bad, bad
    failing = {r["id"] for r, c in repredicted if c["verdict"] == "FAIL"}
    closed = sorted(i for i in KNOWN_GAPS | KNOWN_GAPS_215 if i not in failing)
    assert not closed, f"a known gap closed: drop it: {closed}"


def test_each_record_is_predicted_for_its_own_torch(repredicted):
    """zero3 of the HF llama with full and every-2 checkpointing peaks at the root's reduce-scatter, where
    torch through 2.14 still holds the LM head's unsharded gradient (config.fsdp2_reduce_keeps_last_grad)
    and 2.15 does not: each record agrees within 0.5% when predicted for the torch it ran on and is
    more than 1% off when predicted for the other release."""
    picked = [r for r, _ in repredicted if r["inputs"]["strategy"] == "zero3" and _type(r) == "llama"
              and r["inputs"]["train"]["checkpointing"] in ("full", "every-2") and r["inputs"]["mode"] == "cpu"
              and r["inputs"]["train"]["precision"] == "fp32"]
    assert {torch_release(r["torch_version"]) for r in picked} >= {(2, 13), (2, 15)}
    for r in picked:
        own = record_spec(r)
        other = dict(own, torch_version="2.15" if torch_release(own["torch_version"]) < (2, 15) else "2.14")
        measured = r["measurement"]["memory"]["peak_allocated"]
        err = {k: predict_probe(s)["memory"]["peak_allocated"] / measured - 1 for k, s in (("own", own),
                                                                                            ("other", other))}
        assert abs(err["own"]) <= 0.005 and abs(err["other"]) > 0.01, (r["id"], r["torch_version"], err)


def test_trace_of_a_later_micro_step_counts_the_gradients_not_yet_added():
    """A micro-step after the first of accumulation adds each new gradient into the kept .grad in place; until
    its AccumulateGrad runs the new one is alive beside it. Llama-3.2-1B's width at 2 layers, zero3 fp32 over 2
    micro-steps (benchmarks/results/cpu-torch2.13-2026-11-28-accum-shallow.jsonl): at the tied embedding's
    backward the head's gradient, the embedding's and their sum (3 x V x h) beside the kept one. The trace
    counted none of the new ones (`module_plan` walked them as added already): -17.1%; it now records when
    each parameter's gradient is accumulated (`_SegmentTracker.segment_peaks_accumulating`)."""
    _, c = _repredict_one("cpu-torch2.13-2026-11-28-accum-shallow.jsonl")
    assert abs(c["peak"]["error"]) < 0.001, c["peak"]
    assert all(v["ok"] for v in c["components"].values()), c["components"]


def test_fsdp1_first_micro_step_without_sync_is_walked(repredicted):
    """FSDP1 without sync over 2 micro-steps (benchmarks/results/cpu-torch2.13-2026-11-28-fsdp1-accum-hf.jsonl):
    the first micro-step ends with every unit's unsharded flat gradient kept and, under SHARD_GRAD_OP, every
    unit still unsharded; the root's last gradients come on top (a tied 152K vocabulary's three V x h). Both
    walks looked at a later micro-step only: Qwen2.5-0.5B fsdp-grad-op fp32 -4.69% (peak FAIL), Llama-3.2-1B
    fsdp-grad-op bf16-mixed -1.08% with every component off. Both front ends now exact on all seven; the
    stored verdicts stay what the runs said."""
    path = os.path.join(ROOT, "benchmarks", "results", "cpu-torch2.13-2026-11-28-fsdp1-accum-hf.jsonl")
    with open(path) as f:
        ids = {(r["id"], r["date"]) for r in map(json.loads, filter(str.strip, f))}
    picked = [(r, c) for r, c in repredicted if (r["id"], r["date"]) in ids]
    assert len(picked) == len(ids) == 7
    assert {r["verdict"] for r, _ in picked} == {"PASS", "FAIL"}
    for r, c in picked:
        assert abs(c["peak"]["error"]) < 0.001, (r["id"], c["peak"])
        assert all(v["ok"] for v in c["components"].values()), (r["id"], c["components"])


def test_tied_accumulation_first_micro_step_on_torch_2_15(repredicted):
    """FSDP2 with mixed precision accumulating a tied embedding over micro-steps without sync, on torch 2.15
    (benchmarks/results/cpu-torch2.15-2026-11-29-tied-accum-hf.jsonl: GPT-2 medium, Qwen2.5-0.5B,
    Llama-3.2-1B's width, Gemma-2, rank 0 of 8). From the second step on, the first micro-step still has
    FSDP2's fp32 `grad_dtype` from the previous reduce, so at the tied embedding's backward the head's
    gradient, the embedding's and their sum are three fp32 V x h tensors where 2.13 makes them in bf16
    (config.fsdp2_first_microstep_grads_in_reduce_dtype). Every record is exact when predicted for its own
    torch. Predicted for 2.14, which walked the later micro-step alone, none is over and five are 3.7-17%
    under (GPT-2 medium zero3: -15.1%, the dangerous side), where that instant is the peak; the controls of
    the same file (synced every micro-step, fp32, an untied model, FSDP1's hsdp) are the same either way."""
    path = os.path.join(ROOT, "benchmarks", "results", "cpu-torch2.15-2026-11-29-tied-accum-hf.jsonl")
    with open(path) as f:
        ids = {(r["id"], r["date"]) for r in map(json.loads, filter(str.strip, f))}
    picked = [(r, c) for r, c in repredicted if (r["id"], r["date"]) in ids]
    assert len(picked) == len(ids) >= 10
    under = []
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for r, c in picked:
            assert abs(c["peak"]["error"]) < 0.005, (r["id"], c["peak"])
            t = r["inputs"]["train"]
            measured = r["measurement"]["memory"]["peak_allocated"]
            as_214 = predict_probe(dict(record_spec(r), torch_version="2.14"))["memory"]["peak_allocated"]
            err = as_214 / measured - 1
            fsdp2 = r["inputs"]["strategy"] in ("zero2", "zero3")
            if fsdp2 and t["precision"] == "bf16-mixed" and t["grad_sync"] == "last" and "llama-8l" not in r["id"]:
                assert err < 0.001, (r["id"], err)
                under += [r["id"]] if err < -0.03 else []
            else:  # the controls
                assert abs(err) < 0.005, (r["id"], err)
    finally:
        os.chdir(cwd)
    assert len(under) >= 5, under
