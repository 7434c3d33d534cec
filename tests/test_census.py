"""The trace's kernel census (planner/workload/trace.py `_KernelCensus`) and the step time it gives a traced model
(planner/module_plan.py `traced_compute`), checked against the closed forms and against the analytic front
end's per-kernel model (planner/kernels.py), which derives the same kernels by hand."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from distplan.catalog.loader import load_catalog  # noqa: E402
from distplan.planner import module_plan as mp  # noqa: E402
from distplan.planner.activations import block_linears  # noqa: E402
from distplan.planner.config import TrainConfig  # noqa: E402
from distplan.planner.hf_config import read_hf_config  # noqa: E402
from distplan.planner.kernels import kernel_times  # noqa: E402
from distplan.planner.model import ModelSpec  # noqa: E402
from distplan.planner.workload.trace import CENSUS_FIELDS, profile_hf  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "hf"
DATA = ROOT / "tests" / "data" / "hf"
H100 = load_catalog().gpu("h100-sxm")


def _spec(path) -> ModelSpec:
    return ModelSpec(**read_hf_config(path, implementation=True))


def test_census_counts_a_blocks_matmuls_and_attention_exactly():
    b, s = 2, 512
    prof = profile_hf(str(EXAMPLES / "llama-8l.json"), b, s, "float32")
    spec = _spec(EXAMPLES / "llama-8l.json")
    n = b * s
    linears = block_linears(spec, 1)
    layers = [sg for sg in prof["segments"] if sg["unit"].startswith("model.layers.")]
    assert len(layers) == spec.layers
    for sg in layers[:-1]:  # the last block's segment also holds the final norm, the head and the loss
        fwd, bwd = (dict(zip(CENSUS_FIELDS, c)) for c in sg["census"])
        assert fwd["gemm_flops"] == 2 * n * sum(i * o for i, o, _ in linears)
        assert fwd["gemms"] == len(linears)
        assert bwd["gemm_flops"] == 2 * fwd["gemm_flops"] and bwd["gemms"] == 2 * fwd["gemms"]
        # SDPA with is_causal: QK^T and AV, half the tiles; backward 2.5x (FlashAttention-2, sec. 3.1)
        assert fwd["attention_flops"] == 4 * b * spec.heads * s * s * spec.head_dim / 2
        assert bwd["attention_flops"] == 2.5 * fwd["attention_flops"]
        # the memory-bound kernels: at least the two norms' reads and writes of the fp32 residual stream
        assert fwd["bytes"] > 2 * 2 * n * spec.hidden * 4
        assert fwd["ops"] >= fwd["kernels"] > fwd["gemms"] + 1
        assert sg["unit_census"] == sg["census"][0]  # nothing of the root's runs inside a middle block
    last = layers[-1]
    assert last["census"][0][0] > last["unit_census"][0]  # + the LM head's GEMM
    # the loss, embedding and rotary tables are the root's: a vocabulary-sized gather is not a full read
    root = dict(zip(CENSUS_FIELDS, prof["segments"][0]["census"][1]))
    assert root["bytes"] < spec.vocab * spec.hidden * 4 + 4 * n * spec.hidden * 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-3-8b", "qwen2.5-7b", "qwen3-8b", "mistral-7b", "phi-3-mini", "gemma-2-9b"])
def test_traced_kernels_time_agrees_with_the_analytic_per_kernel_model(name):
    """Two derivations of one step's kernels: the trace's census of what transformers' model launched, and the
    formulas kernels.py writes down for the same blocks. At real width on an H100 their compute time must agree
    (measured 2026-11-24: -6% to +8%), with and without full checkpointing, in both regimes."""
    kw = dict(hf_config=str(DATA / f"{name}.json"), gpus=8, gpu="h100-sxm", seq_len=4096, micro_batch=1,
              precision="bf16-mixed")
    p = mp.module_spec_plan(kw, ["ddp", "zero3"])  # one trace per regime serves both checkpointings
    for ckpt in ("none", "full"):
        twin, _ = mp.analytic_twins(dict(kw, activation_checkpointing=ckpt), p.cluster)
        train = replace(p.train, checkpointing=ckpt)
        for r in p.results:
            desc = p.descs[mp._regime("bf16-mixed", r.strategy.family)]
            assert desc.census
            traced = mp.module_time(desc, train, p.cluster, r.collectives, H100, r.strategy).compute_s
            analytic = mp.twin_time(twin, r.name, 1, p.cluster).compute_s
            assert traced == pytest.approx(analytic, rel=0.10), (name, ckpt, r.name, traced, analytic)


def test_a_materialized_mask_costs_the_whole_attention_in_both_models():
    """A sliding window no longer than the sequence: transformers hands SDPA a mask, and the kernel computes every
    tile (the census sees is_causal=False); the analytic model now times it so too, with GQA's repeated K/V."""
    cfg = DATA / "mistral-7b.json"  # sliding_window 4096
    spec = _spec(cfg)
    for seq, causal in ((2048, True), (4096, False)):
        prof = profile_hf(str(cfg), 1, seq, "bfloat16", layers=2)
        fwd = dict(zip(CENSUS_FIELDS, prof["segments"][1]["census"][0]))
        full = 4 * seq * seq * spec.heads * spec.head_dim
        assert fwd["attention_flops"] == (full / 2 if causal else full)
        kt = kernel_times(TrainConfig(spec, seq_len=seq, micro_batch=1, precision="bf16"), H100, "lowp")
        bf16 = H100.flops["bf16"]
        per_block = kt.attention_s / spec.layers
        expect = fwd["attention_flops"] * (1 / H100.attention_efficiency + 2.5 / H100.attention_backward_efficiency) / bf16
        assert per_block == pytest.approx(expect, rel=1e-9)


def test_a_trace_only_model_is_timed_by_its_kernels_not_its_flops():
    kw = dict(hf_config=str(EXAMPLES / "olmo2-8l.json"), gpus=8, gpu="h100-sxm", seq_len=512, micro_batch=2,
              precision="bf16-mixed")
    p = mp.module_spec_plan(kw, ["zero3"])
    assert any(n.startswith("step time: every kernel the traced step launched") for n in p.notes), p.notes
    r = p.results[0]
    desc = p.descs[mp._regime("bf16-mixed", "fsdp2")]
    flops_only = 3 * desc.forward_flops / H100.achievable_flops("bf16")  # the time model it replaced
    # the FLOPs-only time of a small model is a fraction of what launching and issuing its kernels takes
    assert r.time.compute_s > 5 * flops_only
    fwd, bwd, host = mp.traced_compute(desc, p.train, H100)
    assert r.time.compute_s == pytest.approx(max(fwd + bwd, host))
    # full checkpointing runs each block's forward again in backward
    again = mp.traced_compute(desc, replace(p.train, checkpointing="full"), H100)
    rerun = sum(mp.census_seconds(own, H100, "bf16-mixed", False)
                for seg, (_, _, own) in zip(desc.segments, desc.census) if seg[0].startswith("model.layers."))
    assert again[0] == fwd and again[1] == pytest.approx(bwd + rerun) and rerun > 0
    # a larger batch: more bytes and FLOPs, as many kernels
    big = desc.scaled(2 * desc.batch)
    assert mp.traced_compute(big, p.train, H100)[0] > fwd
    assert [c[4] for seg in big.census for c in seg] == [c[4] for seg in desc.census for c in seg]


def test_a_traced_models_overlapped_collectives_slow_its_kernels():
    """module_time charges what overlapping costs as compute.exposed_comm does: NCCL's CTAs hold SMs the
    GEMMs and attention would use (compute.contention), by the census's share of GEMM and attention time."""
    kw = dict(hf_config=str(EXAMPLES / "olmo2-8l.json"), gpus=16, gpu="h100-sxm", seq_len=2048, micro_batch=4,
              precision="bf16-mixed")
    p = mp.module_spec_plan(kw, ["zero3"])
    r = p.results[0]
    desc = p.descs[mp._regime("bf16-mixed", "fsdp2")]
    plain = mp.module_time(desc, p.train, p.cluster, r.collectives, replace(H100, sm_count=None), r.strategy)
    assert r.time.compute_s == plain.compute_s and r.time.step_time_s > plain.step_time_s
    fwd, bwd, _ = mp.traced_compute(desc, p.train, H100)
    busy = sum(mp.traced_compute(desc, p.train, H100, sm_bound=True)[:2])
    assert 0 < busy < fwd + bwd
    overlapped = sum(c.time_s for c in r.collectives if c.phase != "optimizer")
    assert r.time.exposed_comm_s - plain.exposed_comm_s <= 24 / 132 * busy / (fwd + bwd) * overlapped + 1e-12


@pytest.mark.slow
@pytest.mark.newest
def test_a_mixture_of_experts_counts_each_tokens_experts_and_plans_every_strategy():
    """Mixtral (transformers 5: the experts in one `_grouped_mm`, which flop_counter has no formula for): the
    census counts top-k experts per token; under DDP's autocast the experts run in fp32 (transformers casts
    their input to the fp32 weight's dtype; the op is on no autocast list), which both device kernels take,
    so every strategy is planned, and those GEMMs are counted apart and timed at the fp32 rate."""
    import json
    cfg = EXAMPLES / "mixtral-4l.json"
    c = json.loads(cfg.read_text())
    b, s = 1, 512
    prof = profile_hf(str(cfg), b, s, "bfloat16")
    h, heads, kv, f = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    d = h // heads
    attn = h * heads * d * 2 + 2 * h * kv * d  # q, o; k, v
    router = h * c["num_local_experts"]
    experts = c["num_experts_per_tok"] * 3 * h * f  # gate, up, down of each chosen expert
    fwd = dict(zip(CENSUS_FIELDS, prof["segments"][1]["census"][0]))
    assert fwd["gemm_flops"] == 2 * b * s * (attn + router + experts) and fwd["fp32_gemm_flops"] == 0
    # the forward FLOPs that MFU counts are the census's, the experts' grouped GEMMs included, and causal
    # attention halved as the analytic front end counts it, on every torch (FlopCounterMode counted no grouped
    # GEMM, and the CPU's SDPA in torch 2.15 only, unhalved)
    gemm = sum(seg["census"][0][0] for seg in prof["segments"])
    attention = sum(seg["census"][0][2] for seg in prof["segments"])  # causal: half the score FLOPs
    assert attention > 0 and prof["forward_flops"] == gemm + attention
    amp = profile_hf(str(cfg), b, s, "autocast-bfloat16", device="cuda")
    fwd = dict(zip(CENSUS_FIELDS, amp["segments"][1]["census"][0]))
    assert fwd["gemm_flops"] == 2 * b * s * (attn + router + experts)
    assert fwd["fp32_gemm_flops"] == 2 * b * s * experts  # the grouped GEMMs; autocast casts the Linears
    p = mp.module_spec_plan(dict(hf_config=str(cfg), gpus=8, gpu="h100-sxm", seq_len=s, micro_batch=b,
                                 precision="bf16-mixed"), ())
    assert {r.name for r in p.results} >= {"ddp", "zero1", "zero2", "zero3", "fsdp"}
    assert not any("not planned: the trace" in n for n in p.notes), p.notes
    assert all(r.time.compute_s > 0 for r in p.results)
    # DDP's fp32 experts at the fp32 rate (67 of H100's 989 TFLOP/s), FSDP's bf16 ones at the 16-bit rate
    desc = p.descs[mp._regime("bf16-mixed", "ddp")]
    seg = desc.census[1][0]
    assert seg[6] == fwd["fp32_gemm_flops"] > 0
    as16 = mp.census_seconds(seg[:6] + (0,), H100, "bf16-mixed", False)
    assert mp.census_seconds(seg, H100, "bf16-mixed", False) - as16 == pytest.approx(
        seg[6] * (1 / H100.achievable_flops("fp32") - 1 / H100.achievable_flops("bf16")))


def test_a_mixture_of_experts_traces_in_fp32_for_the_cpu_and_the_gpu():
    """Both device kernels of `_grouped_mm` take fp32 (the CPU's loops over the groups; CUDA's runs bf16 on its
    CUTLASS path and every other dtype through `_grouped_mm_fallback`), though torch 2.13's meta function
    refuses it: during a trace the grouped GEMM keeps its inputs' dtype on either device, outside one the
    meta function is torch's own."""
    torch = pytest.importorskip("torch")
    cfg = str(EXAMPLES / "mixtral-4l.json")
    fp32 = profile_hf(cfg, 1, 64, "float32")
    bf16 = profile_hf(cfg, 1, 64, "bfloat16")
    assert fp32["forward_flops"] == bf16["forward_flops"] > 0
    assert fp32["params"] == bf16["params"] and (fp32["param_bytes_dtype"], bf16["param_bytes_dtype"]) == (4, 2)
    # CUDA runs fp32 attention with grouped KV heads as the math composite, whose score GEMMs count whole
    # (the CPU's flash kernel: halved); the experts' GEMMs are the same
    assert profile_hf(cfg, 1, 64, "float32", device="cuda")["forward_flops"] > fp32["forward_flops"]
    a, w = torch.empty(8, 16, device="meta"), torch.empty(2, 16, 32, device="meta")
    offs = torch.tensor([3, 8], dtype=torch.int32, device="meta")
    try:  # outside a trace: torch's own rule (2.13 and 2.14 refuse fp32, each in its words; 2.15 takes it)
        out = torch._grouped_mm(a, w, offs=offs)
        assert out.dtype == torch.float32 and out.shape == (8, 32)
    except RuntimeError as e:
        assert "BF16" in str(e) or "BFloat16" in str(e), str(e)


def test_traced_forward_flops_are_the_analytic_ones_for_llama():
    """MFU's FLOPs from the trace (the census) equal the analytic front end's for a Llama (Narayanan et al.
    2021, Eq. 3, causal attention halved), whole model and per layer (the layer the trace repeats)."""
    from distplan.planner.api import resolve_model
    from distplan.planner.compute import _forward_flops
    cfg = str(EXAMPLES / "llama-8l.json")
    prof = profile_hf(cfg, 2, 64, "float32")
    spec, _ = resolve_model(hf_config=cfg)
    block, head = _forward_flops(TrainConfig(spec, seq_len=64, micro_batch=2))
    assert prof["layer_flops"] == block
    assert prof["forward_flops"] == spec.layers * block + head
