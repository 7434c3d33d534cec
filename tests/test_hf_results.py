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

from distplan.planner.api import predict_probe  # noqa: E402
from distplan.validate.compare import compare  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "cpu-*-hf.jsonl")))

KNOWN_GAPS = {
    # gloo's reduce-scatter of the root (embedding + head) at the very end holds more copies than the walk
    # knows; with checkpointing nothing else is larger, so the peak is there (-2.8%)
    "zero3/hf:examples/hf/llama-8l.json/w2/full/fp32",
    "zero3/hf:examples/hf/llama-8l.json/w2/every-2/fp32",  # the same instant (-1.5%)
    # FSDP1 SHARD_GRAD_OP under bf16 mixed precision with a tied head: the peak instant's temporaries
    # (-1.96% peak)
    "fsdp-grad-op/hf:examples/hf/qwen2-8l.json/w2/none/bf16-mixed",
    # Gemma-2 (eager attention, soft-capping): the walk's peak is another instant, +0.43%
    "zero3/hf:examples/hf/gemma2-8l.json/w2/none/fp32",
    # full checkpointing, wide blocks (peak within 0.2%): at the peak the probe counts the RoPE tables
    # (cos and sin, 256 x 128 each; fp32, or bf16 under autocast) as activations, the walk elsewhere:
    # 0.13-0.25 MiB, past the 64 KiB floor of a component of about 1 MiB
    "fsdp/hf:examples/hf/llama-w1024-8l-v2k.json/w8-fake/full/fp32",
    "zero3/hf:examples/hf/llama-w1024-8l-v2k.json/w8-fake/full/fp32",
    "fsdp/hf:examples/hf/llama-w1024-8l-v2k.json/w8-fake/full/bf16-mixed",
    "zero3/hf:examples/hf/llama-w1024-8l-v2k.json/w8-fake/full/bf16-mixed",
}


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
        return [(r, compare(predict_probe(dict(r["inputs"])), r["measurement"])) for r in recs]
    finally:
        os.chdir(cwd)


def test_results_are_real_runs_of_every_model_type(repredicted):
    assert len(repredicted) >= 90
    types = {r["inputs"]["module"]["hf_config"].split("/")[-1].split("-")[0] for r, _ in repredicted}
    assert types >= {"llama", "qwen2", "gpt2", "mistral", "phi3", "gemma2"}
    for r, _ in repredicted:
        assert r["status"] == "ok", r["id"]
        assert int(r["inputs"]["module"].get("layers") or 8) >= 8


def test_peaks_within_tolerance(repredicted):
    errors = [abs(c["peak"]["error"]) for _, c in repredicted]
    bad = {r["id"]: round(c["peak"]["error"] * 100, 2) for r, c in repredicted if abs(c["peak"]["error"]) > 0.05}
    assert not bad, bad
    assert statistics.median(errors) <= 0.005


def test_collectives_exact(repredicted):
    bad = [r["id"] for r, c in repredicted if not c["collectives"]["exact"]]
    assert not bad, bad


def test_every_component_passes_but_the_known_gaps(repredicted):
    verdicts = {r["id"]: c["verdict"] for r, c in repredicted}
    bad = {i: v for i, v in verdicts.items() if v != "PASS" and i not in KNOWN_GAPS}
    assert not bad, bad
    assert all(verdicts[i] == "FAIL" for i in KNOWN_GAPS if i in verdicts), "a known gap closed: drop it"
