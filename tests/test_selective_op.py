"""torchtitan's op-level selective checkpointing (`selective_ac_option = "op"`): the outputs of mm and
SDPA are saved except every second mm of a block, which backward recomputes with the pointwise ops.
Planned as `--activation-checkpointing selective-op`; the reference decoder runs the same policy
(validate/model.py `_every_other_mm_contexts`), and the probes committed in
`benchmarks/results/cpu-*-selective-op.jsonl` (gloo 2 ranks, 4 layers, 2 x 1024 tokens) are re-predicted."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import replace

import pytest

from distplan.catalog.loader import load_catalog
from distplan.planner.activations import activations_in, block_linears, saved_linears
from distplan.planner.api import predict_probe
from distplan.validate.results import record_spec
from distplan.planner.config import TrainConfig
from distplan.planner.kernels import kernel_times
from distplan.planner.model import ModelSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L8 = ModelSpec("llama-3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256)


def test_every_second_mm_is_recomputed():
    tr = TrainConfig(model=L8, checkpointing="selective-op")
    # q, k, v, o, gate, up, down: mm 2 (k), 4 (o) and 6 (up) are recomputed
    assert saved_linears(tr) == [True, False, True, False, True, False, True]
    assert saved_linears(replace(tr, checkpointing="selective")) == [True] * 7
    # a biased Linear is addmm, not in torchtitan's save list and not counted
    qwen = replace(L8, qkv_bias=True)
    assert saved_linears(TrainConfig(model=qwen, checkpointing="selective-op")) == [
        False, False, False, True, False, True, False]


def test_saves_less_than_selective_by_the_recomputed_outputs():
    tr = TrainConfig(model=L8, seq_len=8192, micro_batch=2, checkpointing="selective")
    op = replace(tr, checkpointing="selective-op")
    n, e = 2 * 8192, 2
    dropped = n * e * (1024 + 4096 + 14336)  # k, o and up outputs of one block
    assert (activations_in(tr, "lowp", "cuda").blocks_total - activations_in(op, "lowp", "cuda").blocks_total
            == 32 * dropped)


def test_recomputes_the_unsaved_gemms():
    gpu = load_catalog().gpu("h100-sxm")
    tr = TrainConfig(model=L8, seq_len=8192, checkpointing="selective")
    sel, op = kernel_times(tr, gpu, "lowp"), kernel_times(replace(tr, checkpointing="selective-op"), gpu, "lowp")
    flops = sum(2.0 * 8192 * i * o for (i, o, _), keep in zip(block_linears(L8), saved_linears(
        replace(tr, checkpointing="selective-op"))) if not keep)
    extra = op.block_backward_s - sel.block_backward_s
    assert flops / (989e12 * gpu.matmul_efficiency) < extra < 1.3 * flops / (989e12 * gpu.matmul_efficiency)


def _records():
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "cpu-*-selective-op.jsonl"))):
        with open(path) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out


def test_committed_probes_repredicted():
    recs = _records()
    assert {r["inputs"]["strategy"] for r in recs} >= {"single", "ddp", "zero2", "zero3", "fsdp"}
    for r in recs:
        assert r["inputs"]["train"]["checkpointing"] == "selective-op" and r["measurement"]["status"] == "ok"
        pred = predict_probe(record_spec(r))["memory"]["peak_allocated"]
        assert pred / r["measurement"]["memory"]["peak_allocated"] - 1 == pytest.approx(0, abs=0.05), r["id"]


@pytest.mark.slow
def test_live_probe_zero3(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "r.jsonl"
    proc = subprocess.run([sys.executable, "-m", "distplan.planner", "validate", "--strategy", "zero3",
                           "--activation-checkpointing", "selective-op", "--layers", "4", "--seq-len", "512",
                           "--json", "--out", str(out)], capture_output=True, text=True, timeout=600)
    probe = json.loads(proc.stdout)["probes"][0]
    assert probe["status"] == "ok", probe
    assert abs(probe["comparison"]["peak"]["error"]) <= 0.05, probe["comparison"]["peak"]
    assert probe["comparison"]["collectives"]["exact"]
