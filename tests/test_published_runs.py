"""Issue 12: published data-parallel training runs as a judged table.

tests/data/published_runs.yaml: pure data-parallel bf16 runs (FSDP1 FULL_SHARD / HYBRID_SHARD, FSDP2
fully_shard; no TP/PP/CP, no Float8; 7B-70B; 8-128 A100 80GB / H100) from torchtitan
(docs/performance.md, benchmarks/), MosaicML llm-foundry (scripts/train/benchmarking/README.md) and IBM
fms-fsdp (README), each with its source (URL, file, commit, table and row) and configuration as stated.

The issue's targets, asserted exactly: over the table, median |predicted / published - 1| <= 15% and
max <= 30%, tokens/s per GPU, each prediction from the public `plan()` with the source's own
implementation (torchtitan: FSDP2 -> "zero3"; llm-foundry and fms-fsdp: FSDP1 -> "fsdp" / "hsdp") and
the trainer's gradient sync under accumulation (`distplan_grad_sync`: Composer reduces FSDP gradients
after every micro-batch).

MFU definitions used (quoted in the YAML's mfu_definitions): every source's MFU is
(6 x N + 12 x L x W x T) x tokens/s per GPU / bf16 dense peak (A100 312, H100 SXM 989 TFLOP/s), with
  torchtitan (2024-04): N = all parameters, W = hidden (all heads);
  torchtitan (2024-12): N = all but the token embedding (no per-row MFU published for those rows);
  llm-foundry: N = the table's NumParams, W = d_model (README: 3 x flops_per_seq + 3 x attn_flops_per_seq);
  fms-fsdp: N = all parameters, W = kv_heads x head_dim (reconstructed: nanoGPT/PaLM cited, no code; the
  34B/70B GQA rows fit only with the KV width).
test_each_row_matches_its_own_mfu checks every row that publishes both figures against that definition:
a transcription check, independent of the planner.

The model is not adjusted to this table here: benchmarks/published_runs.py prints the same table.
"""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("published_runs", ROOT / "benchmarks" / "published_runs.py")
pr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pr)

DOC = pr.load()
RUNS = DOC["runs"]
REQUIRED = ("id", "source", "model", "gpu", "gpu_published", "gpus", "nodes", "gpus_per_node", "network",
            "distplan_inter", "distplan_nics_per_node", "sharding", "distplan_strategy", "seq_len",
            "micro_batch", "grad_accum", "global_batch", "activation_checkpointing", "distplan_checkpointing",
            "compile", "attention", "precision", "published_tokens_per_s_per_gpu", "published_mfu",
            "mfu_definition")
IMPLEMENTATION = {"pytorch/torchtitan": {"zero3"}, "mosaicml/llm-foundry": {"fsdp", "hsdp"},
                  "foundation-model-stack/fms-fsdp": {"fsdp", "hsdp"}}


def test_table_is_the_issues_scope():
    """At least 16 runs from all three sources; 7B-70B on 8-128 GPUs; every field recorded."""
    assert len(RUNS) >= 16
    assert {r["source"]["repo"] for r in RUNS} == set(IMPLEMENTATION)
    assert len({r["id"] for r in RUNS}) == len(RUNS)
    for r in RUNS:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, f"{r['id']}: missing {missing}"
        for k in ("url", "file", "commit", "date", "table", "row"):
            assert r["source"].get(k), f"{r['id']}: source.{k}"
        assert 8 <= r["gpus"] <= 128 and r["gpus"] == r["nodes"] * r["gpus_per_node"], r["id"]
        assert r["global_batch"] == r["micro_batch"] * r["grad_accum"] * r["gpus"], r["id"]
        assert r["distplan_strategy"] in IMPLEMENTATION[r["source"]["repo"]], r["id"]
        # the issue's A100 80GB and H100 SXM; torchtitan's 2024-12 rows name their H100's HBM2e and 500 W
        assert r["gpu"] in ("a100-80gb", "h100-sxm", "h100-sxm-96gb-hbm2e"), r["id"]
        if r["gpu"] == "h100-sxm-96gb-hbm2e":
            assert "HBM2e" in r["gpu_published"] and "500 W" in r["gpu_published"], r["id"]
        params = pr._spec(r["model"]).param_count()
        assert 6e9 <= params <= 75e9, f"{r['id']}: {params:,} parameters"
        assert r["mfu_definition"] in DOC["mfu_definitions"], r["id"]
        # a mode the analytic API cannot take is mapped, with the reason written down
        if r["distplan_checkpointing"] not in str(r["activation_checkpointing"]).split()[0]:
            assert r.get("distplan_checkpointing_reason"), f"{r['id']}: mapped checkpointing without a reason"


@pytest.mark.parametrize("run", [r for r in RUNS if r.get("published_mfu") is not None], ids=lambda r: r["id"])
def test_each_row_matches_its_own_mfu(run):
    """Published MFU == published tokens/s x FLOPs/token / peak under that source's definition, within 3%."""
    d = DOC["mfu_definitions"][run["mfu_definition"]]
    mfu = pr.source_mfu(run, d, run["published_tokens_per_s_per_gpu"])
    assert mfu == pytest.approx(run["published_mfu"], rel=0.03), (
        f"{run['id']}: {run['published_tokens_per_s_per_gpu']} tokens/s/GPU x "
        f"{pr.source_flops_per_token(run, d):.4g} FLOP/token / {d['peak_tflops'][run['gpu']]} TFLOP/s = "
        f"{mfu:.4f}, published {run['published_mfu']}")


@pytest.mark.parametrize("run", [r for r in RUNS if r.get("published_num_params")], ids=lambda r: r["id"])
def test_llm_foundry_catalog_model_is_the_benchmarked_one(run):
    """The catalog MPT has the table's NumParams (learned positions at max_seq_len 2048, biases)."""
    assert run["seq_len"] == 2048
    assert pr._spec(run["model"]).param_count() == run["published_num_params"]


@pytest.mark.xfail(strict=True, reason=(
    "issue 12's target is not met yet: median |error| 15.1%, max 37.8% (2026-12-03), every run but four "
    "predicted faster than published; the H100 rows (-2.8% to +38%; torchtitan's and llm-foundry's +19% to "
    "+38%) far more than the A100 rows (-2% to +22%). "
    "strict: when the model meets the target this xfail fails and must go"))
def test_published_runs_within_issue_targets():
    """Issue 12: median |error| <= 15%, max |error| <= 30% over the whole table."""
    table = pr.rows(DOC)
    errs = [abs(r["error"]) for r in table]
    median, worst = statistics.median(errs), max(errs)
    msg = "\n" + pr.format_table(table)
    assert median <= pr.MEDIAN_TARGET and worst <= pr.MAX_TARGET, msg


def test_published_runs_no_worse_than_today():
    """Where the model stands (2026-12-03: median 15.1%, max 37.8%; 17.8% before llm-foundry's Triton
    attention kernel was timed as one, `attention_kernel='flash-triton'`): a change that moves the time model
    away from the published runs fails here; the issue's target is the xfail above."""
    table = pr.rows(DOC)
    errs = [abs(r["error"]) for r in table]
    assert statistics.median(errs) <= 0.155 and max(errs) <= 0.39, "\n" + pr.format_table(table)


def test_triton_attention_rows_say_so():
    """The runs whose trainer ran FlashAttention in Triton (llm-foundry attn_impl='triton') are planned with
    that kernel, and only those: the kernel's slower backward is what their error depends on."""
    for r in RUNS:
        triton = "attn_impl 'triton'" in r["attention"]
        assert (r.get("distplan_attention_kernel") == "flash-triton") == triton, r["id"]
        assert pr.plan_kwargs(r).get("attention_kernel", "flash") == ("flash-triton" if triton else "flash")


KNOWN_NO_FIT: set = set()
# (2026-12-04: torchtitan's Llama-2-13B on 64 A100s without checkpointing, 78.1 GiB allocated by the analytic Llama,
# had run out of memory in the allocator replay limited to 80 GiB; with the forward written op by op
# (alloc_trace.block_program) it fits, 78.9 GiB reserved, only by the allocator releasing its cache and retrying:
# `fits` but not `fits_cleanly`.)
"""Published runs (they ran) that the planner predicts do not fit, each with the reason."""


def test_published_runs_fit():
    """Every published run ran on its GPUs, so each must be predicted to fit, except the known gaps. The
    rows with gradient accumulation check the trainer's gradient sync: llm-foundry's Composer reduces FSDP
    gradients every micro-batch (`distplan_grad_sync: every`); with no_sync they keep whole gradients, and none
    fits cleanly: past the line, or (MPT-7B on 8 A100s: 77.7 GiB allocated of 80) only by the allocator releasing
    its cache and retrying, 8 times a step in the replay (`MemoryEstimate.fits_cleanly`, what `recommend` asks)."""
    from distplan.planner.api import plan
    verdicts = {run["id"]: pr.predict(run)["fits"] for run in RUNS}
    assert {k for k, fits in verdicts.items() if not fits} == KNOWN_NO_FIT
    no_sync = [dict(run, distplan_grad_sync="last") for run in RUNS if run.get("distplan_grad_sync") == "every"]
    assert no_sync
    for run in no_sync:
        mem = plan(**pr.plan_kwargs(run))[run["distplan_strategy"]].memory
        assert not mem.fits_cleanly, run["id"]
