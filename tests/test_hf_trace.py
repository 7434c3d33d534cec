"""The trace front end on Hugging Face causal LMs (`--hf-config` with transformers installed).

- the trace on fake tensors equals the same profile on real tensors, byte for byte (every segment's
  saved, forward and backward figures, the gradient-ready order, FLOPs), for each model type;
- a deep model traced at 4 layers and expanded equals tracing every layer;
- `estimate --hf-config` states its front end; the trace takes model types the formulas do not;
- CPU validation (gloo, 2 ranks) of the real transformers models at 8 layers under every strategy:
  peaks within 5%, collectives exact (slow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from math import prod
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from distplan.planner.strategies import NAMES  # noqa: E402
from distplan.planner.workload.trace import (TRACE_LAYERS, periodic_trace_layers, profile_hf,  # noqa: E402
                                             profile_workload)
from distplan.planner.workload.traced_model import HFWorkload  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HF = ROOT / "examples" / "hf"
TYPES = ("llama", "qwen2", "gpt2", "mistral", "phi3", "gemma2")


def _same(a: dict, b: dict, skip=("profile_s",)) -> list:
    return [k for k in set(a) | set(b) if k not in skip and a.get(k) != b.get(k)]


@pytest.mark.parametrize("model_type", TYPES)
@pytest.mark.parametrize("dtype", ["float32", "autocast-bfloat16"])
def test_fake_trace_equals_real_run(model_type, dtype):
    """What the planner reads off fake tensors is what the same model does on real ones."""
    w = HFWorkload(str(HF / f"{model_type}-8l.json"), 2, 32, layers=2)
    fake, real = profile_workload(w, dtype), profile_workload(w, dtype, fake=False)
    assert _same(fake, real) == []
    assert fake["activation_bytes"] > 0 and fake["grad_ready"]


@pytest.mark.parametrize("model_type,dtype", [("llama", "float32"), ("gpt2", "autocast-bfloat16"),
                                              ("qwen2", "bfloat16"), ("mixtral", "autocast-bfloat16"),
                                              ("olmo2", "fsdp-bfloat16")])
def test_expanded_trace_equals_full_trace(model_type, dtype):
    """Everything the planner reads, the construction order and the step's allocation log (each event, id
    and free in order, the gradients' ids and names) included."""
    path = str(HF / f"{model_type}-8l.json")
    expanded = profile_hf(path, 2, 32, dtype)
    assert expanded["traced_layers"] == TRACE_LAYERS
    assert expanded["alloc_log"]["events"] and len(expanded["construct_paths"]) > 8 * 2
    full = profile_workload(HFWorkload(path, 2, 32), dtype)
    assert _same(expanded, full, skip=("profile_s", "traced_layers", "layer_flops")) == []


def _cli(*args):
    from click.testing import CliRunner

    from distplan.planner.cli import main
    return CliRunner().invoke(main, list(args))


def test_estimate_states_front_end():
    base = ["estimate", "--hf-config", str(HF / "llama-8l.json"), "--gpus", "2", "--gpu-mem", "80",
            "--seq-len", "64", "--micro-batch", "2", "--json"]
    t = _cli(*base, "--front-end", "trace")
    a = _cli(*base, "--front-end", "analytic")
    assert t.exit_code == 0 and a.exit_code == 0, (t.output[-500:], a.output[-500:])
    tn, an = json.loads(t.output)["inputs"]["notes"], json.loads(a.output)["inputs"]["notes"]
    assert any(n.startswith("front end: trace") for n in tn)
    assert any(n.startswith("front end: analytic") for n in an)


@pytest.mark.slow
@pytest.mark.newest
def test_gemma2_on_both_front_ends():
    """Gemma-2 (explicit head_dim, sandwich norms, soft-capped eager attention and logits): the trace and the
    analytic front end print the same peaks (within 0.1%) and, through the analytic twin, one step time."""
    args = ["estimate", "--hf-config", str(ROOT / "tests" / "data" / "hf" / "gemma-2-9b.json"), "--gpus", "64",
            "--gpu-mem", "80", "--seq-len", "4096", "--micro-batch", "1", "--activation-checkpointing", "full",
            "--json"]
    out = {}
    for fe in ("trace", "analytic"):
        r = _cli(*args, "--front-end", fe)
        assert r.exit_code == 0, r.output[-800:]
        out[fe] = {s["name"]: s for s in json.loads(r.output)["strategies"]}
    for name in ("ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op", "hsdp"):
        t, a = out["trace"][name], out["analytic"][name]
        assert a["memory"]["peak_allocated"] == pytest.approx(t["memory"]["peak_allocated"], rel=0.001), name
        assert a["step_time_s"] == pytest.approx(t["step_time_s"], rel=1e-9), name
    r = _cli("estimate", "--hf-config", str(HF / "gemma2-8l.json"), "--gpus", "2", "--gpu-mem", "80",
             "--seq-len", "64", "--front-end", "trace", "--strategy", "zero3")
    assert r.exit_code == 0, r.output[-800:]
    assert "Gemma2ForCausalLM" in r.output and "8 x model.layers.N" in r.output


def _validate_hf(name: str, out, *extra) -> dict:
    proc = subprocess.run([sys.executable, "-m", "distplan.planner", "validate", "--hf-config",
                           str(HF / f"{name}-8l.json"), "--strategy", "all", "--precision", "fp32",
                           "--json", "--out", str(out), *extra],
                          capture_output=True, text=True, cwd=ROOT, timeout=1500,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("name,world", [pytest.param("llama", None, id="llama", marks=pytest.mark.newest),
                                         pytest.param("qwen2", 8, id="qwen2"), pytest.param("gpt2", 8, id="gpt2")])
def test_hf_models_validate_on_cpu(name, world, tmp_path):
    """The CPU matrix's HF rows: the transformers model itself, 8 layers, every strategy. Llama on gloo
    (2 processes, real collectives), Qwen2 (tied head) and GPT-2 as rank 0 of 8 on the fake process group
    (one process each: the CI's two cores do them in 35 s, not 80 s, and the shards are eighths)."""
    extra = ("--simulate-world-size", str(world)) if world else ()
    probes = _validate_hf(name, tmp_path / "r.jsonl", *extra)["probes"]
    if world:
        assert all(p["inputs"]["world_size"] == world or p["inputs"]["strategy"] == "single" for p in probes)
    assert {p["inputs"]["strategy"] for p in probes} == set(NAMES)
    assert all(p["status"] == "ok" for p in probes), [(p["id"], p.get("measurement", {}).get("error"))
                                                      for p in probes]
    errors = {p["inputs"]["strategy"]: p["comparison"]["peak"]["error"] for p in probes}
    assert all(abs(e) <= 0.05 for e in errors.values()), errors
    inexact = [p["id"] for p in probes if not p["comparison"]["collectives"]["exact"]]
    assert not inexact, inexact


def test_unknown_model_type_is_one_line(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"model_type": "no_such_model", "hidden_size": 8}')
    r = _cli("estimate", "--hf-config", str(p), "--front-end", "trace", "--gpus", "2")
    assert r.exit_code == 2 and "no_such_model" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1 and len(r.output) < 300, r.output


@pytest.mark.slow
@pytest.mark.newest
def test_every_k_checkpointing_lies_between_none_and_full():
    """every-2 checkpoints half the layers: its activations sit between none's and full's, in the trace
    and in the analytic front end, which agree within 0.5% on it."""
    peaks = {}
    for fe in ("trace", "analytic"):
        for mode in ("none", "every-2", "full"):
            r = _cli("estimate", "--hf-config", str(HF / "llama-8l.json"), "--front-end", fe, "--gpus", "2",
                     "--gpu-mem", "80", "--seq-len", "256", "--micro-batch", "4", "--strategy", "zero3",
                     "--activation-checkpointing", mode, "--json")
            assert r.exit_code == 0, r.output[-500:]
            peaks[fe, mode] = json.loads(r.output)["strategies"][0]["memory"]["peak_allocated"]
        assert peaks[fe, "full"] < peaks[fe, "every-2"] < peaks[fe, "none"], peaks
    assert peaks["analytic", "every-2"] == pytest.approx(peaks["trace", "every-2"], rel=0.005), peaks


SLOW_NEWEST = (pytest.mark.slow, pytest.mark.newest)


@pytest.mark.parametrize("model_type,k,depth,dtype", [
    ("llama", 2, 8, "float32"), ("llama", 3, 12, "float32"), ("qwen2", 2, 9, "bfloat16"),
    pytest.param("llama", 4, 16, "autocast-bfloat16", marks=SLOW_NEWEST),
    pytest.param("gpt2", 3, 13, "autocast-bfloat16", marks=SLOW_NEWEST)])
def test_every_k_allocation_log_equals_full_trace(model_type, k, depth, dtype):
    """Under every-K checkpointing (K >= 2) a deep model's layers are of two kinds (checkpointed where
    t % K == 0), so the step's allocation log is traced at `periodic_trace_layers` layers and a period of K
    layers repeated, each deep layer its kind's: equal to tracing every layer (each event, id and free in
    order, the kept tensors, the gradients' ids and names). It used to be expanded from the 4 layers traced
    for the rest of the profile, which at every-4 checkpoint layer 0 only: Qwen2.5-7B at 4096 tokens replayed
    49.9 GiB allocated (zero2) where the walk has 44.9."""
    path = str(HF / f"{model_type}-8l.json")
    traced = periodic_trace_layers(depth, k)
    assert TRACE_LAYERS < traced < depth
    expanded = profile_hf(path, 2, 32, dtype, layers=depth, checkpoint_every=k)
    assert len([u for u in expanded["units"] if u["name"] != "root"]) == traced
    full = profile_workload(HFWorkload(path, 2, 32, layers=depth), dtype, checkpoint_every=k)
    assert expanded["alloc_log"]["events"]
    assert expanded["alloc_log"] == full["alloc_log"]


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_traced_plan_evaluates_another_cluster_as_its_own(name):
    """`recommend` weighs remedies (fewer nodes, more NICs, RDMA) by re-planning the pick on another cluster:
    for a traced model that is the trace's walk, not the analytic decoder's (it took a ModuleTrain and
    raised AttributeError). On the plan's own cluster it reproduces the plan's results exactly; llama has an
    analytic twin (step time, reserved peak), mixtral has none."""
    from distplan.planner.module_plan import module_spec_plan
    p = module_spec_plan({"hf_config": str(HF / f"{name}-8l.json"), "gpus": 16, "gpu": "h100-sxm", "seq_len": 64,
                          "micro_batch": 2, "detect_local": False})
    assert (p.twin is not None) == (name == "llama")
    for r in p.results:
        again = p.evaluate_on(p.cluster, r.name)
        assert again.memory.components == r.memory.components
        assert again.memory.peak_reserved == r.memory.peak_reserved
        assert [c.to_dict() for c in again.collectives] == [c.to_dict() for c in r.collectives]
        assert again.step_time_s == r.step_time_s
    two = p.evaluate_on(replace(p.cluster, gpus=8), "zero3")
    assert two.memory.components["params"] > p["zero3"].memory.components["params"]  # 8 shards, not 16


def test_comm_bound_traced_moe_recommends_and_names_fsdp2_padding():
    """A mixture-of-experts model on 64 GPUs over 1 Gbit/s: the pick is communication-bound (the remedies, one
    node here, are planned with the trace), and FSDP2's dim-0 shards of the stacked experts (4 rows for 64
    ranks) are named; the padding is measured at 16 and 32 fake ranks
    (benchmarks/results/cpu-torch2.13-2026-11-27-moe-padding-hf.jsonl)."""
    r = _cli("recommend", "--hf-config", str(HF / "mixtral-8l.json"), "--gpus", "64", "--gpu", "h100-sxm",
             "--seq-len", "64", "--micro-batch", "2", "--inter-gbps", "1", "--json")
    assert r.exit_code == 0, r.output[-2000:]
    out = json.loads(r.output)
    bound = [x for x in out["recommendation"]["reasons"] if x.startswith("communication-bound")]
    assert len(bound) == 1 and "--gpus 8 (1 node)" in bound[0], out["recommendation"]["reasons"]
    pad = [n for n in out["inputs"]["notes"] if "FSDP2 shards each parameter on dim 0" in n]
    assert len(pad) == 1 and "experts" in pad[0] and "4 rows for 64 ranks" in pad[0], out["inputs"]["notes"]
    # the analytic front end does not read Mixtral: the trace plans dp 64 alone, and says the layout was not searched
    assert "search" not in out["recommendation"]
    assert any(n.startswith("layout: not searched") and "'mixtral'" in n for n in out["inputs"]["notes"])
    llama = _cli("estimate", "--hf-config", str(HF / "llama-8l.json"), "--gpus", "64", "--gpu", "h100-sxm",
                 "--seq-len", "64", "--micro-batch", "2", "--front-end", "trace", "--json")
    assert llama.exit_code == 0
    assert not any("FSDP2 shards each parameter" in n for n in json.loads(llama.output)["inputs"]["notes"])


@pytest.mark.slow
@pytest.mark.newest
def test_traced_nothing_fits_names_checkpointing_when_it_fits():
    """A traced model that fits nowhere at micro-batch 1 (16K tokens in 3 GiB) is traced again with full
    activation checkpointing, and the change is named with what it needs (it printed no advice before). At the
    data-parallel mesh (--tp 1 --pp 1), which the trace plans alone: without them the layout is searched."""
    base = ["--hf-config", str(HF / "llama-8l.json"), "--front-end", "trace", "--gpus", "2", "--gpu-mem", "3",
            "--seq-len", "16384", "--micro-batch", "1", "--json"]
    r = _cli("recommend", *base, "--tp", "1", "--pp", "1")
    assert r.exit_code == 0, r.output[-2000:]
    rec = json.loads(r.output)["recommendation"]
    assert rec["strategy"] is None and rec["change"].startswith("--activation-checkpointing full")
    assert rec["reasons"][0].endswith(rec["change"])
    full = json.loads(_cli("estimate", *base, "--activation-checkpointing", "full").output)
    needs = min(s["memory"]["device_total"] for s in full["strategies"])
    assert f"needs {needs / 2**30:.2f} GiB" in rec["change"] and needs < 3 * 2**30


def test_fp32_moe_on_the_gpu_is_planned():
    """An fp32 plan of an MoE model: the grouped GEMM's CUDA kernel takes fp32 (`_grouped_mm_fallback`), so the
    trace runs where torch 2.13's meta function alone would refuse it, and every strategy is planned."""
    r = _cli("estimate", "--hf-config", str(HF / "mixtral-8l.json"), "--gpus", "16", "--gpu", "h100-sxm",
             "--precision", "fp32", "--json")
    assert r.exit_code == 0, r.output[-2000:]
    assert {s["name"] for s in json.loads(r.output)["strategies"]} >= {"ddp", "zero1", "zero3", "fsdp"}


def test_mixtral_8x7b_on_64_gpus_pads_fsdp2_expert_shards():
    """Mixtral-8x7B as published (mistralai/Mixtral-8x7B-v0.1 config.json) on 64 H100s: FSDP2 (zero3) gives
    each rank ceil(rows / 64) rows of every parameter, so 1 of the 8 stacked experts' rows; FSDP1 (fsdp) one
    flat parameter per layer padded to a multiple of 64. Both closed forms from the config, in fp32 (the
    sharded parameters under bf16-mixed)."""
    r = _cli("estimate", "--hf-config", str(ROOT / "tests" / "data" / "hf" / "mixtral-8x7b.json"), "--gpus", "64",
             "--gpu", "h100-sxm", "--strategy", "zero3,fsdp", "--json")
    assert r.exit_code == 0, r.output[-2000:]
    out = json.loads(r.output)
    h, f, kv, e, v, w = 4096, 14336, 1024, 8, 32000, 64
    layer = [(h, h), (kv, h), (kv, h), (h, h), (e, h), (e, 2 * f, h), (e, h, f), (h,), (h,)]  # q k v o router experts norms
    root = [(v, h), (h,), (v, h)]  # embedding, final norm, LM head

    def numel(s):
        n = 1
        for d in s:
            n *= d
        return n

    def dim0(shapes):
        return sum(-(-s[0] // w) * numel(s[1:]) for s in shapes)
    rope = 2 * (h // 32 // 2) * 4  # the rotary embedding's fp32 buffers, inv_freq and original_inv_freq, unsharded
    zero3 = 4 * (32 * dim0(layer) + dim0(root)) + rope
    fsdp = 4 * (32 * -(-sum(map(numel, layer)) // w) + -(-sum(map(numel, root)) // w)) + rope
    got = {s["name"]: s["memory"]["params"] for s in out["strategies"]}
    assert got == {"zero3": zero3, "fsdp": fsdp}
    assert zero3 > 7 * fsdp  # 1 of 8 expert rows per rank instead of 1/64 of them
    assert any("(8x28672x4096) has 8 rows for 64 ranks" in n for n in out["inputs"]["notes"]), out["inputs"]["notes"]


def test_api_plans_with_the_trace_as_the_cli_does():
    """`plan(hf_config=..., front_end="trace")` in a notebook is the CLI's `estimate --front-end trace`: the
    same strategies, memory, collectives and times (a model the analytic front end refuses, Mixtral, too)."""
    from distplan.planner import plan
    args = dict(hf_config=str(HF / "mixtral-8l.json"), gpus=16, gpu="h100-sxm", seq_len=64, micro_batch=2,
                precision="bf16", activation_checkpointing="full")
    p = plan(**args, front_end="trace")
    cli = _cli("estimate", "--hf-config", args["hf_config"], "--gpus", "16", "--gpu", "h100-sxm", "--seq-len", "64",
               "--micro-batch", "2", "--precision", "bf16", "--activation-checkpointing", "full",
               "--front-end", "trace", "--json")
    assert cli.exit_code == 0, cli.output[-1000:]
    assert p.to_dict()["strategies"] == json.loads(cli.output)["strategies"]
    assert {r.name for r in p.results} >= {"ddp", "zero3", "fsdp"}  # bf16 weights: every strategy traces
    with pytest.raises(ValueError, match="model_type 'mixtral'"):
        plan(**args)  # the default front end is the analytic one, which has no MoE formulas
    with pytest.raises(ValueError, match=r"--tp=2: tensor parallelism is modelled by the analytic front end only"):
        plan(**args, front_end="trace", tp=2)


def test_sweep_traces_what_the_analytic_front_end_does_not_read():
    """`sweep`'s default front end is the analytic one (a trace per point takes seconds); a model type it
    does not read (an MoE) is traced instead of refused, and every row says which front end made it."""
    def rows(path):
        r = _cli("sweep", "--hf-config", str(path), "--gpus", "8", "--gpu", "h100-sxm", "--seq-len", "64",
                 "--sweep-micro-batch", "1,2", "--strategy", "zero3", "--json")
        assert r.exit_code == 0, r.output[-1000:]
        return json.loads(r.output)
    moe, llama = rows(HF / "mixtral-8l.json"), rows(HF / "llama-8l.json")
    assert {r["front_end"] for r in moe} == {"trace"} and {r["front_end"] for r in llama} == {"analytic"}
    assert [r["micro_batch"] for r in moe] == [1, 2] and moe[1]["peak_allocated"] > moe[0]["peak_allocated"]
    text = _cli("sweep", "--hf-config", str(HF / "mixtral-8l.json"), "--gpus", "8", "--gpu", "h100-sxm",
                "--seq-len", "64", "--sweep-micro-batch", "1", "--strategy", "zero3")
    assert "front end: trace (the model run on fake tensors, traced again at each point)" in text.output
    tail = " ".join(text.output.split("traced again at each point)")[-1].split())
    # then the bands measured for a traced Hugging Face model (accuracy.py), as estimate prints them
    assert tail.startswith("measured error of the peak:") and "18 H100 runs" in tail, tail
    assert "measured error of step time" in tail


def test_the_cpu_target_prints_the_cpu_probes_band():
    """Issue 61 item 4, per device: a traced model planned for the CPU target (`--device cpu`, what the CPU
    probes run) prints the band of the CPU probes (accuracy.py "trace-hf-cpu") and no reserved-peak band (the
    CPU has no caching allocator); for CUDA, the H100 runs' bands."""
    args = ["estimate", "--hf-config", str(HF / "llama-8l.json"), "--front-end", "trace", "--gpus", "2",
            "--strategy", "ddp", "--seq-len", "64"]
    cpu = json.loads(_cli(*args, "--device", "cpu", "--json").output)["error_band"]
    cuda = json.loads(_cli(*args, "--device", "cuda", "--json").output)["error_band"]
    assert cpu["peak_reserved"] is None and "CPU probes" in cpu["peak_allocated"]["measured_against"]
    assert cuda["peak_reserved"]["max"] > 0 and "H100" in cuda["peak_allocated"]["measured_against"]
    assert cpu["step_time"] == cuda["step_time"]  # the GPU's step time on either target
    text = " ".join(_cli(*args, "--device", "cpu").output.split())
    assert "the reserved peak not judged (the CPU has no caching allocator); against 90 CPU probes" in text


def test_traced_nothing_fits_names_the_smaller_micro_batch_flag():
    """A traced HF model's smaller-batch change names --micro-batch (it named --module's --input-shape), at
    the data-parallel mesh the trace plans alone (--tp 1 --pp 1)."""
    r = _cli("recommend", "--hf-config", str(HF / "llama-8l.json"), "--front-end", "trace", "--gpus", "2",
             "--gpu-mem", "3", "--seq-len", "8192", "--micro-batch", "4", "--tp", "1", "--pp", "1", "--json")
    assert r.exit_code == 0, r.output[-2000:]
    change = json.loads(r.output)["recommendation"]["change"]
    assert "(--micro-batch 1; raise --grad-accum" in change and "--input-shape" not in change, change


@pytest.mark.slow
@pytest.mark.newest
def test_fsdp2_accumulated_gradients_are_unpadded():
    """Without sync, FSDP2 keeps each unsharded parameter's .grad between micro-steps at its real shape, not
    the dim-0-padded all-gather size: Mixtral's 4 expert rows padded to 16 ranks made the walk +62% over the
    probe (benchmarks/results/cpu-torch2.13-2026-11-27-moe-padding-accum-hf.jsonl). What accumulation adds to the peak is at most
    the model's real parameter count in fp32 (the reduce dtype under bf16-mixed)."""
    from distplan.planner.module_plan import module_spec_plan
    kw = {"hf_config": str(HF / "mixtral-8l.json"), "gpus": 16, "gpu": "h100-sxm", "seq_len": 64, "micro_batch": 2,
          "precision": "bf16-mixed", "detect_local": False}  # (a GPU plan: fp32 experts do not trace on 2.13)
    one = module_spec_plan(kw, ["zero3"])
    two = module_spec_plan(dict(kw, grad_accum=2), ["zero3"])
    real = sum(prod(s) for _, ps in one.desc.units for _, s in ps)
    padded = sum(-(-s[0] // 16) * 16 * prod(s[1:]) for _, ps in one.desc.units for _, s in ps)
    assert padded > 1.5 * real  # the experts' padding is large here
    added = two["zero3"].memory.peak_allocated - one["zero3"].memory.peak_allocated
    assert 0 < added <= 4 * real, (added, 4 * real, 4 * padded)
