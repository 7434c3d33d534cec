"""Tensor parallelism (with and without sequence parallelism) in the analytic planner (issue 13)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from distplan.planner import plan
from distplan.planner.activations import activations_in, block_saved
from distplan.planner.api import resolve_model
from distplan.planner.cli import main
from distplan.planner.config import TrainConfig
from distplan.planner.model import ModelSpec, tp_rank_spec


def _run(*args):
    return CliRunner().invoke(main, list(args))


# -- inputs ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["--tp", "3"], "--tp=3: must divide heads=64, kv_heads=8, ffn_hidden=28672, gpus=64, gpus_per_node=8"),
    (["--tp", "16"], "--tp=16: must divide kv_heads=8, gpus_per_node=8"),
    (["--sequence-parallel"], "--sequence-parallel: needs --tp > 1"),
    (["--tp", "0"], "--tp=0"),
])
def test_tp_errors_one_line_exit_2(args, needle):
    r = _run("estimate", "--model", "llama-3-70b", "--gpus", "64", "--node", "dgx-h100", *args)
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and needle in line, line
    if "must divide" in needle:
        assert line.endswith("accepted: 1, 2, 4, 8")


def test_tp_must_divide_the_gpus_of_a_node():
    with pytest.raises(ValueError, match=r"--tp=4: must divide gpus=2, gpus_per_node=2"):
        plan("llama-3-8b", gpus=2, tp=4)
    with pytest.raises(ValueError, match=r"tp=3: must divide heads=32"):
        TrainConfig(resolve_model("llama-3-8b")[0], tp=3)


# -- parameters ------------------------------------------------------------------------------------

def test_parameter_elements_per_rank():
    """torchtitan's plan: q/k/v, w1/w3 colwise (out/t rows), wo/w2 rowwise (in/t columns), embedding
    and head vocab/t rows, norms replicated."""
    m = resolve_model("llama-3-70b")[0]
    h, kv, f, V, L, t = m.hidden, m.kv_dim, m.ffn_hidden, m.vocab, m.layers, 8
    block = 2 * h + (h * h + 2 * kv * h + h * h) // t + 3 * h * f // t
    expect = 2 * (V // t) * h + h + L * block
    r = tp_rank_spec(m, t)
    assert r.param_count() == expect
    assert abs(r.param_count() * t - m.param_count()) < L * 2 * h * t + h * t  # only norms replicated
    p = plan("llama-3-70b", gpus=64, node="dgx-h100", tp=t, strategies=["ddp", "zero3"])
    assert p["ddp"].memory.components["params"] == 4 * expect  # fp32 parameters, replicated over dp
    z3 = p["zero3"].memory.components["params"]
    assert abs(z3 - 4 * expect / 8) / (4 * expect / 8) < 1e-3  # FSDP2 over the 8 dp ranks (+ padding)


# -- activations: Korthikanti et al. 2022 ------------------------------------------------------------

GPT = ModelSpec(name="gpt-block", layers=2, hidden=1024, heads=16, kv_heads=16, ffn_hidden=4096, vocab=32000,
                max_positions=2048, mlp="gelu", norm="layernorm", position="learned", linear_bias=True,
                attn_dropout=0.1, resid_dropout=0.1)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("b, s", [(1, 2048), (2, 1024)])
def test_korthikanti_closed_forms(t, b, s):
    """Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    (arXiv:2205.05198), Table 2 / Eq. 2-4, per layer in bytes for their GPT block (16-bit, LayerNorm,
    GELU 4h MLP, MHA, eager attention, dropout on the probabilities and both residual branches):

        tensor parallel (Eq. 3):                  s b h (10 + 24/t + 5 a s / (h t))
        tensor + sequence parallel (Eq. 4):       s b h / t (34 + 5 a s / h)

    Our per-op formulas (pure bf16 on CUDA: the 'lowp' regime with bool dropout masks) for the same
    block equal these plus three terms that cannot coincide:
      - LayerNorm statistics: `native_layer_norm` saves mean and rstd, fp32 per token (2 norms x 8
        bytes per token, on s/t tokens with SP); the paper counts only sbh terms.
      - the causal mask: our eager attention saves the (s, s) bool mask its `masked_fill` uses, once per
        block on every rank (Megatron's fused scale-mask-softmax keeps none).
      - with SP, each colwise Linear saves its all-gathered (replicated) input: PyTorch's DTensor
        redistributes in forward and `mm` saves the result, where Megatron-LM saves the shard and
        all-gathers it again in backward (paper Sec. 4.2.2): 2 x 2sbh (1 - 1/t) more.
    """
    m = GPT
    h, a = m.hidden, m.heads
    n = b * s
    for sp in ((False, True) if t > 1 else (False,)):
        tr = TrainConfig(m, seq_len=s, micro_batch=b, precision="bf16", attention="eager", tp=t,
                         sequence_parallel=sp)
        ours = block_saved(tr, "lowp", "cuda")
        assert ours == activations_in(tr, "lowp", "cuda").per_block
        mask = s * s
        if not sp:
            paper = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
            stats = 2 * 8 * n
            gathered = 0
        else:
            paper = s * b * h / t * (34 + 5 * a * s / h)
            stats = 2 * 8 * n // t
            gathered = 2 * 2 * n * h * (1 - 1 / t)
        assert ours == pytest.approx(paper + stats + mask + gathered, rel=0, abs=1e-6)


def test_sequence_parallel_saves_activations():
    """Llama (RMSNorm, SwiGLU, SDPA): per-layer bytes fall with t; SP shrinks them further."""
    m = resolve_model("llama-3-70b")[0]
    per = {}
    for t, sp in ((1, False), (8, False), (8, True)):
        tr = TrainConfig(m, seq_len=8192, precision="bf16", tp=t, sequence_parallel=sp)
        per[t, sp] = block_saved(tr, "lowp", "cuda")
    assert per[8, False] < per[1, False] / 2
    assert per[8, True] < per[8, False]


# -- collectives ----------------------------------------------------------------------------------

def _tp_colls(p, name):
    return [c for c in p[name].collectives if c.group == "tp"]


def test_tp_collectives_per_layer():
    b, s, A = 2, 4096, 2
    kw = dict(gpus=16, node="dgx-h100", seq_len=s, micro_batch=b, grad_accum=A, tp=4, strategies=["zero3", "ddp"])
    m = resolve_model("llama-3-8b")[0]
    L, h = m.layers, m.hidden
    p = plan("llama-3-8b", **kw)
    # FSDP2 (bf16 parameters): every message b*s*h in bf16
    tp = _tp_colls(p, "zero3")
    blk = [c for c in tp if c.unit == "tp_block"]
    assert {(c.op, c.phase) for c in blk} == {("all_reduce", "forward"), ("all_reduce", "backward")}
    assert all(c.calls == 2 * L * A and c.message_bytes == b * s * h * 2 and c.group_size == 4 for c in blk)
    assert {c.unit for c in tp} == {"tp_block", "tp_embed", "tp_head", "tp_loss"}
    loss = [c for c in tp if c.unit == "tp_loss"]  # loss parallel: 3 all-reduces of b*s fp32 per micro-step
    assert [(c.op, c.calls, c.message_bytes, c.dtype) for c in loss] == [("all_reduce", 3 * A, b * s * 4, "float32")]
    # the data-parallel collectives run over gpus / tp = 4 ranks, named by their mesh dimension
    dp = [c for c in p["zero3"].collectives if c.group != "tp"]
    assert dp and all(c.group == "dp" and c.group_size == 4 for c in dp)
    sp = plan("llama-3-8b", sequence_parallel=True, **kw)
    blk_sp = [c for c in _tp_colls(sp, "zero3") if c.unit == "tp_block"]
    assert sorted((c.op, c.phase) for c in blk_sp) == sorted([
        ("all_gather", "forward"), ("reduce_scatter", "forward"),
        ("all_gather", "backward"), ("reduce_scatter", "backward")])
    assert all(c.calls == 2 * L * A and c.message_bytes == b * s * h * 2 for c in blk_sp)
    for name in ("zero3", "ddp"):  # the same bytes on the wire (DDP: fp32 residual stream under autocast)
        assert sum(c.bytes_per_gpu for c in _tp_colls(sp, name) if c.unit != "tp_norm_grad") == sum(
            c.bytes_per_gpu for c in _tp_colls(p, name))
    # with SP the norms' Partial gradients: all-reduced once per step before FSDP2's reduce-scatter,
    # accumulated over the micro-steps in fp32 (reduce_dtype)
    norm = [c for c in _tp_colls(sp, "zero3") if c.unit == "tp_norm_grad"]
    assert [(c.op, c.calls, c.message_bytes) for c in norm] == [("all_reduce", 2 * L + 1, h * 4)]
    # exposed whole in the step time
    for name in ("zero3", "ddp"):
        t = p[name].time
        assert t.exposed_comm_s >= sum(c.time_s for c in _tp_colls(p, name))


def test_tp1_output_has_no_tp_collectives():
    p = plan("llama-3-8b", gpus=8, strategies=["zero3"])
    assert all(c.group in ("world", "intra_node", "inter_node") for c in p["zero3"].collectives)
    assert p.to_dict()["inputs"]["mesh"] == {"pp": 1, "dp": 8, "cp": 1, "tp": 1, "sequence_parallel": False}


# -- end to end ------------------------------------------------------------------------------------

def test_llama3_70b_on_64_h100_fits_with_tp8():
    """Llama-3-70B, seq 8192, micro-batch 1, selective checkpointing, 64 H100 (8 x DGX): FSDP alone
    keeps every block's saved matmul outputs for 8192 tokens on each GPU; TP=8 splits q, k, v, gate,
    up and SDPA's output 8 ways (the block input and the rowwise o/down outputs, partial sums h wide,
    stay whole), so the saved bytes fall by more than half and zero3 over the 8 dp ranks fits where
    pure FSDP does not."""
    kw = dict(gpus=64, node="dgx-h100", seq_len=8192, activation_checkpointing="selective",
              strategies=["zero3"])
    fsdp = plan("llama-3-70b", **kw)["zero3"]
    tp8 = plan("llama-3-70b", tp=8, **kw)["zero3"]
    tp8sp = plan("llama-3-70b", tp=8, sequence_parallel=True, **kw)["zero3"]
    a1, a8, a8s = (r.memory.components["activations"] for r in (fsdp, tp8, tp8sp))
    assert a8 < a1 / 2 and a8s < a8
    assert not fsdp.fits and tp8.fits and tp8sp.fits
    # tokens/s counts the 8 data-parallel ranks' tokens only
    assert tp8.time.tokens_per_s == pytest.approx(8 * 8192 / tp8.time.step_time_s)


def test_cli_json_shows_the_mesh():
    r = _run("estimate", "--model", "llama-3-70b", "--gpus", "64", "--node", "dgx-h100", "--tp", "8",
             "--sequence-parallel", "--seq-len", "8192", "--strategy", "zero3", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["inputs"]["mesh"] == {"pp": 1, "dp": 8, "cp": 1, "tp": 8, "sequence_parallel": True}
    assert d["inputs"]["train"]["tp"] == 8 and d["inputs"]["model"]["heads"] == 64
    groups = {c["group"] for c in d["strategies"][0]["comm"]["collectives"]}
    assert groups == {"dp", "tp"}
    for cmd in ("recommend", "sweep"):
        extra = ["--sweep-seq-len", "4096,8192"] if cmd == "sweep" else []
        r = _run(cmd, "--model", "llama-3-70b", "--gpus", "64", "--node", "dgx-h100", "--tp", "8", *extra)
        assert r.exit_code == 0, r.output


def test_per_rank_flops_and_gemm_shapes():
    """The kernel model sees one rank's shapes: every block GEMM's FLOPs and the attention's divide by
    tp (tp divides the heads and the MLP width), the LM head's by tp (vocabulary shard)."""
    from distplan.planner.activations import block_linears
    from distplan.planner.compute import _forward_flops
    from distplan.planner.tp import tp_view
    from distplan.planner.config import Cluster
    m = resolve_model("llama-3-70b")[0]
    full = TrainConfig(m, seq_len=4096)
    for t in (2, 4, 8):
        rank, _ = tp_view(TrainConfig(m, seq_len=4096, tp=t), Cluster(gpus=8))
        assert sum(i * o for i, o, _ in block_linears(m, t)) * t == sum(i * o for i, o, _ in block_linears(m))
        (b1, h1), (bt, ht) = _forward_flops(full), _forward_flops(rank)
        assert bt * t == pytest.approx(b1) and ht * t == pytest.approx(h1)
