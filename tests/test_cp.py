"""Context parallelism (issue 13, planner/cp.py and validate/cp.py).

Fast tier: the view (s / cp tokens per rank, the strategy over dp x cp ranks), the ring's collectives in
exact bytes and counts, the FLOPs (a rank does 1/cp of the whole model's, attention included), the ring
backward's transient against the committed tracker measurements, compositions with TP, the JSON mesh, and
one-line errors. Slow: ring attention through torch's own `_templated_ring_attention(_backward)` equals
full SDPA on gloo ranks; the CPU matrix's CP probes (peaks within 5%, collectives exact); the tracker's
measurement of the ring backward still matches the committed one on the installed torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from distplan.planner.api import plan, predict_probe
from distplan.planner.cli import main
from distplan.planner.compute import model_flops
from distplan.planner.cp import CPView, cp_view, ring_backward_bytes
from distplan.validate import matrix as mx

ROOT = Path(__file__).resolve().parents[1]
RING_DATA = ROOT / "tests" / "data" / "cp_ring_backward_cpu.json"


def _plan(**kw):
    args = dict(model="llama-3-8b", gpus=64, seq_len=131072, strategies=["zero3"])
    args.update(kw)
    return plan(**args)


def test_view_holds_one_ranks_tokens():
    p = _plan(cp=8)
    v = cp_view(p.train)
    assert isinstance(v, CPView) and v.seq_len == 131072 // 8 and v.cp == 8
    assert cp_view(v) is v and cp_view(replace(p.train, cp=1)).seq_len == 131072
    assert v != p.train  # a view is not the user's configuration (caches keep them apart)
    mesh = p.to_dict()["inputs"]["mesh"]
    assert mesh == {"pp": 1, "dp": 8, "cp": 8, "tp": 1, "sequence_parallel": False}
    assert any("context parallel" in n for n in p.notes)


def test_activations_scale_with_the_rank_tokens():
    one = _plan(cp=1, seq_len=16384, gpus=8)["zero3"].memory.components["activations"]
    eight = _plan(cp=8, gpus=64)["zero3"].memory.components["activations"]
    # the same 16384 tokens on a rank; CP adds wo's input copy (n x h per layer) and keeps the RoPE table
    # and the saved tensors of s/cp tokens
    m = _plan(cp=8).train.model
    assert 0 < eight - one <= m.layers * 16384 * m.hidden * 2 * 1.001


def test_ring_collectives_exact():
    p = _plan(cp=8, precision="bf16-mixed")
    m = p.train.model
    n = 131072 // 8
    cp = [c for c in p["zero3"].collectives if c.group == "cp"]
    got = sorted((c.op, c.phase, c.dtype, c.message_bytes, c.calls) for c in cp)
    kv = m.kv_dim
    assert got == sorted([
        ("all_gather", "forward", "bfloat16", 8 * 2 * n * kv * 2, m.layers),
        ("all_gather", "backward", "bfloat16", 8 * 2 * n * kv * 2, m.layers),
        ("all_to_all", "backward", "float32", 2 * n * kv * 4, 8 * m.layers)])
    # full checkpointing repeats the forward's all-gather in backward
    full = _plan(cp=8, precision="bf16-mixed", activation_checkpointing="full")
    bwd = [c for c in full["zero3"].collectives if c.group == "cp" and c.op == "all_gather" and c.phase == "backward"]
    assert sum(c.calls for c in bwd) == 2 * m.layers
    # the strategy's group is the dp x cp ranks; its collectives are the 16384-token sequences' (none
    # depends on the sequence length), all 64 ranks
    dp = [c for c in p["zero3"].collectives if c.group != "cp"]
    assert dp and {c.group for c in dp} <= {"dp_cp", "intra_node", "inter_node"}
    assert {c.group_size for c in dp if c.group == "dp_cp"} == {64}
    # exposed whole in the step time
    assert p["zero3"].time.exposed_comm_s >= sum(c.time_s for c in cp)


def test_flops_are_one_cp_ranks_share():
    t = _plan(cp=1, gpus=8).train
    for cp in (2, 4, 8):
        v = cp_view(replace(t, cp=cp))
        assert model_flops(v) == pytest.approx(model_flops(t) / cp, rel=1e-12)


def test_tokens_per_second_count_every_sequence_once():
    a = _plan(cp=1, gpus=64, seq_len=8192)["zero3"].time
    b = _plan(cp=2, gpus=64, seq_len=8192)["zero3"].time
    # the same global batch in tokens per step (64 x 8192 vs 32 sequences x 2 ranks x 4096)
    assert a.tokens_per_s * a.step_time_s == pytest.approx(b.tokens_per_s * b.step_time_s * 2, rel=1e-9)


def test_ring_backward_transient_vs_tracker():
    data = json.loads(RING_DATA.read_text())
    assert len(data["rows"]) == 21
    errors = []
    for r in data["rows"]:
        heads = r["heads"]
        from distplan.planner.model import ModelSpec
        m = ModelSpec(name="x", layers=1, hidden=r["q_width"], heads=heads,
                      kv_heads=heads * r["kv_width"] // r["q_width"], ffn_hidden=64, vocab=64)
        # one rank's view: r["tokens"] tokens of a sequence cp times longer
        v = CPView(m, seq_len=r["tokens"], micro_batch=1, cp=r["cp"],
                   precision="fp32" if r["elem_bytes"] == 4 else "bf16")
        regime = "fp32" if r["elem_bytes"] == 4 else "lowp"
        errors.append(ring_backward_bytes(v, regime) / r["backward_transient_bytes"] - 1)
    print(f"ring backward transient: {min(errors):+.1%} .. {max(errors):+.1%} over {len(errors)} shapes")
    # the bounds ring_backward_bytes' docstring states
    assert -0.08 <= min(errors) and max(errors) <= 0.04


def test_composes_with_tensor_parallelism():
    p = _plan(cp=4, tp=8, sequence_parallel=True, gpus=64)
    groups = {c.group for c in p["zero3"].collectives}
    assert {"tp", "cp", "dp_cp"} <= groups
    assert {c.group_size for c in p["zero3"].collectives if c.group == "cp"} == {4}
    assert p.to_dict()["inputs"]["mesh"]["dp"] == 2


@pytest.mark.parametrize("args, needle", [
    (["--cp", "3"], "--cp=3: the sequence length 2048 must be a multiple of 2 x cp = 6"),
    (["--cp", "2", "--attention", "eager"], "ring attention replaces SDPA"),
    (["--cp", "2", "--strategy", "single"], "--strategy=single with --cp=2"),
    (["--cp", "0"], "--cp"),
    (["--cp", "16", "--gpus", "8"], "must divide the 8 GPUs"),
])
def test_bad_cp_one_line(args, needle):
    r = CliRunner().invoke(main, ["estimate", "--params", "7B", "--gpus", "8", *args])
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0], r.output


def test_cli_estimate_with_cp_json():
    r = CliRunner().invoke(main, ["estimate", "--model", "llama-3-8b", "--gpus", "16", "--seq-len", "131072",
                                  "--cp", "8", "--activation-checkpointing", "full", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["inputs"]["mesh"]["cp"] == 8 and d["inputs"]["train"]["cp"] == 8


def test_matrix_has_the_cp_probes():
    specs = mx.cp_matrix({"gpus": 0})
    assert len(specs) == 5 and all(s["model"]["layers"] >= 8 for s in specs)
    assert {s["cp"] for s in specs} == {2, 4, 8} and any(s.get("tp") == 2 for s in specs)
    assert {s["mode"] for s in specs} == {"cpu", "fake"}
    assert mx.cp_matrix({"gpus": 1}) == []  # the GPU probe is not wired (validate/cp.py)
    for s in specs:  # the prediction carries the ring's collectives
        assert any(c["op"] == "all_to_all" for c in predict_probe(s)["collectives"])


# -- slow: real probes ------------------------------------------------------------------------------

def _torchrun_gloo(script, n, tmp_path):
    """Run `script` on `n` gloo ranks; each rank's stdout/stderr lands in its own file under tmp_path/logs
    (torchrun --redirects 3), so a rank that dies is seen whole, not as the last lines of the launcher's."""
    logs = tmp_path / f"logs{n}"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                           f"--log-dir={logs}", "--redirects=3", str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", TORCH_SHOW_CPP_STACKTRACES="1"))
    rank_logs = "\n".join(f"--- {f.relative_to(logs)}\n{f.read_text()[-3000:]}"
                           for f in sorted(logs.rglob("std*.log")) if f.stat().st_size)
    return proc, rank_logs


@pytest.mark.slow
def test_ring_attention_equals_sdpa_on_gloo(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "ring.py"
    script.write_text(RING_CHECK)
    for n in (2, 4):
        proc, rank_logs = _torchrun_gloo(script, n, tmp_path)
        if proc.returncode != 0 and "Signal 6 (SIGABRT)" in proc.stderr:
            # Two CI runs (2 cores, the whole suite) lost a rank to SIGABRT here; 90 runs alone and under CPU
            # load did not. Rerun once, and say so with every rank's log: a second abort fails the test.
            import warnings
            warnings.warn(f"ring attention on {n} gloo ranks: a rank aborted; rerunning once\n{rank_logs}")
            proc, rank_logs = _torchrun_gloo(script, n, tmp_path)
        assert proc.returncode == 0, proc.stderr[-1500:] + "\n" + rank_logs
        # one file per rank: ranks printing at once can interleave their lines on a shared stdout
        rows = [json.loads((tmp_path / f"err{r}.json").read_text()) for r in range(n)]
        assert max(max(row) for row in rows) < 1e-5, rows


RING_CHECK = """
import torch, torch.distributed as dist, torch.nn.functional as F
from distplan.validate.cp import ring_attention, head_tail_indices
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
B, H, KV, S, D = 2, 4, 2, 32, 8
q, k, v = (torch.randn(B, n, S, D).requires_grad_() for n in (H, KV, KV))
ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
g = torch.randn_like(ref)
ref.backward(g)
keep = head_tail_indices(S, w, r)
ql, kl, vl = (t.detach()[:, :, keep].clone().requires_grad_() for t in (q, k, v))
out = ring_attention(ql, kl, vl, dist.group.WORLD)
out.backward(g[:, :, keep])
errs = [(out - ref[:, :, keep]).abs().max()] + [(a.grad - b.grad[:, :, keep]).abs().max()
                                                for a, b in ((ql, q), (kl, k), (vl, v))]
import json, pathlib, sys
pathlib.Path(sys.argv[1], f"err{r}.json").write_text(json.dumps([float(e) for e in errs]))
dist.barrier()  # no rank closes its gloo connections while a peer may still be reading from them
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_cp_probes_pass(tmp_path):
    pytest.importorskip("torch")
    from distplan.validate.runner import run_validation
    records = run_validation(mx.cp_matrix({"gpus": 0}), str(tmp_path / "r.jsonl"), tolerance=0.05,
                             timeout_s=600, jobs=2)
    assert len(records) == 5
    for r in records:
        assert r["status"] == "ok", (r["id"], r["measurement"].get("error"))
        cmp = r["comparison"]
        print(f"{r['id']}: {100 * cmp['peak']['error']:+.2f}%")
        assert abs(cmp["peak"]["error"]) <= 0.05, r["id"]
        assert cmp["collectives"]["exact"], r["id"]
        ring = [x for x in cmp["collectives"]["rows"] if x["op"] == "all_to_all"]
        assert ring and all(x["measured_calls"] > 0 for x in ring), r["id"]


@pytest.mark.slow
def test_ring_backward_measurement_is_current():
    """The committed tracker rows still describe the installed torch's ring backward (cp = 4, rank 0)."""
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "-m", "distplan.validate.cp", "4", "0"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    now = json.loads(proc.stdout)
    rows = {(r["cp"], r["rank"], r["tokens"], r["q_width"], r["kv_width"], r["elem_bytes"]): r
            for r in json.loads(RING_DATA.read_text())["rows"]}
    same = [(r, rows[k]) for r in now if (k := (4, 0, r["tokens"], r["q_width"], r["kv_width"], r["elem_bytes"])) in rows]
    assert same
    for r, old in same:
        assert r["backward_transient_bytes"] == old["backward_transient_bytes"], r


def test_composes_with_pipeline_stages():
    """CP inside each pipeline stage (torchtitan's mesh pp, dp, cp, tp): the ring's collectives are the
    busiest pipeline rank's layers x the micro-batches, the boundary tensors carry s/cp tokens, the
    strategy runs over a stage's dp x cp ranks, and the step counts every sequence once."""
    kw = dict(gpus=32, seq_len=32768, pp=2, pp_microbatches=8, strategies=["zero2"])
    p, q = _plan(cp=4, **kw), _plan(cp=1, **kw)
    cols = p["zero2"].collectives
    a2a = [c for c in cols if c.group == "cp" and c.op == "all_to_all"]
    assert sum(c.calls for c in a2a) == 16 * 8 * 4  # 16 layers of the first stage x 8 micro-batches x cp
    send = [c for c in cols if c.group == "pp" and c.op == "send"]
    send1 = [c for c in q["zero2"].collectives if c.group == "pp" and c.op == "send"]
    assert {c.message_bytes for c in send} == {m // 4 for m in {c.message_bytes for c in send1}}
    assert {c.group_size for c in cols if c.group == "dp_cp"} == {16}  # 32 / pp 2: dp 4 x cp 4
    assert p.to_dict()["inputs"]["mesh"] == {**p.to_dict()["inputs"]["mesh"], "pp": 2, "dp": 4, "cp": 4, "tp": 1}
    # the same sequences per step: dp 4 x 8 micro-batches of 32K tokens, with cp as without (dp 16)
    tp_, tq = p["zero2"].time, q["zero2"].time
    assert tp_.tokens_per_s * tp_.step_time_s * 4 == pytest.approx(tq.tokens_per_s * tq.step_time_s, rel=1e-9)
    # FSDP2 under PP all-gathers each block once per step (the parameters stay unsharded)
    ag = [c for c in cols if c.group == "dp_cp" and c.op == "all_gather"]
    assert {c.phase for c in ag} == {"forward"} and sum(c.calls for c in ag) == 16 + 1
