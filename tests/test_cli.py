"""`distplan` as a user types it: estimate, recommend, sweep, catalog, bad input, import cost."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from distplan.planner.cli import main
from distplan.planner.strategies import NAMES

CONTRACT_MEMORY = {"params", "grads", "optimizer", "activations", "comm_buffers", "temporaries",
                   "peak_allocated", "peak_reserved", "reserved_source", "alloc_retries", "process_overhead", "device_total"}


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_estimate_7b_prints_every_strategy():
    r = run("estimate", "--params", "7B", "--gpus", "8", "--gpu-mem", "80")
    assert r.exit_code == 0, r.output
    for name in NAMES:
        if name != "single":
            assert f"\n{name} " in r.output
    assert "recommendation:" in r.output
    assert "planned the nearest real model, mistral-7b" in r.output
    # the notes as one text (the table may wrap a note onto more lines): none cut short
    lines = r.output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("note: "))
    notes = " ".join(lines[start:lines.index("", start)]).split("note: ")[1:]
    assert "front end: analytic (decoder formulas)" in " ".join(" ".join(notes).split())
    assert all(n.count("(") == n.count(")") for n in notes), notes


def test_estimate_70b_on_h100_json_contract():
    r = run("estimate", "--model", "llama-3-70b", "--gpus", "64", "--gpu", "h100", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert set(d) >= {"inputs", "strategies", "recommendation"}
    assert d["inputs"]["model_params"] == 70553706496
    assert len(d["strategies"]) == len(NAMES) - 1
    for s in d["strategies"]:
        assert set(s) >= {"name", "fits", "peak_phase", "memory", "comm", "step_time_s", "tokens_per_s"}
        assert set(s["memory"]) >= CONTRACT_MEMORY
        assert all(isinstance(v, int) and v >= 0 for k, v in s["memory"].items()
                   if k not in ("reserved_source", "device_footprint"))
        fp = s["memory"]["device_footprint"]
        assert fp["total"] == s["memory"]["process_overhead"] == fp["cuda_context"] + fp["nccl_total"]
        assert fp["nccl_total"] == sum(c["total_bytes"] for c in fp["nccl"]) > 0
        assert s["memory"]["reserved_source"] == "allocator replay"
        assert s["peak_phase"] in ("forward", "backward", "optimizer")
        assert set(s["comm"]) >= {"collectives", "bytes_per_gpu", "time_s", "exposed_s"}
    assert {"strategy", "reasons"} <= set(d["recommendation"])
    by = {s["name"]: s for s in d["strategies"]}
    assert not by["ddp"]["fits"]
    assert by["fsdp"]["memory"]["peak_allocated"] < by["ddp"]["memory"]["peak_allocated"] / 4


@pytest.mark.parametrize("args, flag", [
    (["--params", "7X"], "--params"),
    (["--gpus", "0"], "--gpus"),
    (["--gpu-mem", "-1"], "--gpu-mem"),
    (["--model", "nope"], "--model"),
    (["--hf-config", "missing.json"], "--hf-config"),
    (["--strategy", "nope"], "--strategy"),
    (["--gpu", "h900"], "--gpu"),
    (["--inter", "carrier-pigeon"], "--inter"),
    (["--params", "7B", "--heads", "7"], "heads"),
    (["--params", "7B", "--gpus", "12", "--node", "dgx-h100"], "--gpus=12: not a multiple of the 8 GPUs per node (--node dgx-h100)"),
    (["--params", "7B", "--gpus", "12", "--gpus-per-node", "5"], "accepted: up to 5, or a multiple of 5 (10 or 15 here)"),
    (["--params", "7B", "--model", "llama-2-7b"], "--model and --params: accepted: one of --model, --params and --hf-config"),
    (["--params", "7B", "--attention-kernel", "cudnn"], "--attention-kernel"),
    (["--params", "7B", "--attention", "eager", "--attention-kernel", "flash-triton"], "attention_kernel='flash-triton'"),
])
def test_bad_input_is_one_line_exit_2(args, flag):
    r = CliRunner().invoke(main, ["estimate", *args])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.output
    assert flag in lines[0]
    assert "Traceback" not in r.output


def test_hf_config_heads_not_dividing_hidden(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 100, "num_attention_heads": 7,
           "intermediate_size": 256, "vocab_size": 1000}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    r = CliRunner().invoke(main, ["estimate", "--hf-config", str(path), "--gpus", "2"])
    assert r.exit_code == 2
    assert "--hf-config" in r.output and "heads" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_hf_config_reads(tmp_path):
    r = run("estimate", "--hf-config", "tests/data/hf/llama-3-8b.json", "--gpus", "8", "--gpu-mem", "80")
    assert r.exit_code == 0, r.output
    # the model line carries the config's path and wraps where the path is long (a deep checkout)
    assert "8,030,261,248 params" in " ".join(r.output.split())


def test_estimate_does_not_import_torch():
    code = ("import sys; from distplan.planner.cli import main\n"
            "try:\n main(['estimate','--params','7B','--gpus','8','--gpu-mem','80'], standalone_mode=False)\n"
            "finally:\n print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("NO-TORCH"), out


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "distplan.planner", "estimate", "--params", "125M", "--gpus", "2",
                          "--gpu-mem", "24", "--json"], capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["strategies"]


def test_recommend_small_model_two_gpus_is_replicated():
    # At micro-batch 8 compute dominates (> 85% of every strategy's step) and the pick is a replicated one,
    # the simplest within 5% of the fastest. DDP itself is ~7% slower than FSDP with MixedPrecision:
    # autocast keeps an fp32 residual stream and casts every Linear input and weight (kernels.py), and
    # its unsharded AdamW pass is twice zero2's.
    r = run("recommend", "--params", "125M", "--gpus", "2", "--gpu", "a100-80gb", "--micro-batch", "8", "--json")
    d = json.loads(r.output)
    assert d["recommendation"]["strategy"] in ("ddp", "fsdp-no-shard"), d["recommendation"]
    assert all(s["compute_s"] > 0.85 * s["step_time_s"] for s in d["strategies"])  # compute dominates


def test_recommend_70b_on_64_h100_is_sharded():
    # the strategy choice on a pure data-parallel mesh (--tp/--pp given: no layout search)
    r = run("recommend", "--tp", "1", "--pp", "1", "--params", "70B", "--gpus", "64", "--node", "dgx-h100",
            "--json")
    d = json.loads(r.output)
    assert d["recommendation"]["strategy"] in ("zero3", "fsdp", "hsdp", "zero2", "fsdp-grad-op")
    assert d["recommendation"]["change"]  # 70B at seq 2048 needs activation checkpointing on 80 GB


def test_recommend_70b_infiniband_vs_ethernet_explained():
    # the strategy choice on a pure data-parallel mesh (--tp/--pp given: no layout search)
    dp = ("recommend", "--tp", "1", "--pp", "1", "--params", "70B", "--gpus", "64", "--node", "dgx-h100")
    ib = run(*dp).output
    eth = run(*dp, "--inter", "eth-100g-tcp").output
    assert "over ib-ndr" in ib and "over eth-100g-tcp" in eth
    # the same pick fits both (FSDP with selective recomputation); over TCP the output says the step is
    # communication-bound and offers the change, over InfiniBand it does not
    assert "communication-bound" in eth and "communication-bound" not in ib


def test_recommend_hsdp_over_slow_ethernet():
    # the strategy choice on a pure data-parallel mesh (--tp/--pp given: no layout search)
    args = ["recommend", "--tp", "1", "--pp", "1", "--params", "13B", "--gpus", "64", "--node", "generic-ethernet",
            "--grad-accum", "8"]
    eth = json.loads(run(*args, "--json").output)
    step = {s["name"]: s["step_time_s"] for s in eth["strategies"]}
    # hsdp keeps the all-gathers and reduce-scatters inside the node: faster than full sharding across nodes
    # (the pick itself is SHARD_GRAD_OP, which all-gathers once per step and now fits with room to spare)
    assert step["hsdp"] < 0.5 * min(step["zero3"], step["fsdp"]), step
    small = json.loads(run("recommend", "--tp", "1", "--pp", "1", "--params", "13B", "--gpus", "8", "--node",
                           "dgx-h100", "--json").output)
    assert small["recommendation"]["strategy"] != "hsdp"  # one node: nothing to keep inside it


def test_recommend_nothing_fits_names_a_change():
    # on the mesh given (no layout search): the smallest change beyond it
    r = run("recommend", "--tp", "1", "--pp", "1", "--params", "70B", "--gpus", "2", "--gpu-mem", "24")
    assert r.exit_code == 0
    assert "nothing fits" in r.output and "smallest change" in r.output


def test_sweep_json_rows():
    r = run("sweep", "--params", "7B", "--sweep-gpus", "8,16", "--strategy", "fsdp", "--strategy", "ddp", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert {(x["gpus"], x["strategy"]) for x in rows} == {(8, "fsdp"), (8, "ddp"), (16, "fsdp"), (16, "ddp")}


def test_sweep_states_the_measured_error_as_estimate_does():
    """Issue 61 item 4: a sweep's rows carry the band the project measured (the JSON, every row) and the table
    prints it under itself, the same band and the same lines as `estimate` of the same model."""
    args = ["--params", "7B", "--gpu-mem", "80", "--strategy", "zero3"]
    est = json.loads(run("estimate", *args, "--gpus", "8", "--json").output)
    rows = json.loads(run("sweep", *args, "--sweep-gpus", "8,16", "--json").output)
    assert [x["error_band"] for x in rows] == [est["error_band"]] * 2
    assert est["error_band"]["peak_allocated"]["median"] > 0 and est["error_band"]["step_time"]["max"] > 0
    text = run("sweep", *args, "--sweep-gpus", "8,16").output
    estimate_text = run("estimate", *args, "--gpus", "8").output
    for prefix in ("measured error of the peak: ", "measured error of step time"):
        line = next(x for x in estimate_text.splitlines() if x.startswith(prefix))
        assert line in text.splitlines()


def test_sweep_marks_no_row_where_nothing_fits_and_names_the_change():
    """Llama-3-8B on 8 x 80 GB: micro-batch 1 fits, 8 does not under any strategy. The recommendation at 8 is
    of a changed run (a smaller micro-batch), so no row of that point is marked, and the change is given."""
    r = run("sweep", "--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100", "--seq-len", "2048",
            "--sweep-micro-batch", "1,8", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    fit = [x for x in rows if x["micro_batch"] == 1]
    big = [x for x in rows if x["micro_batch"] == 8]
    assert any(x["fits"] for x in fit) and not any(x["fits"] for x in big)
    marked = [x for x in fit if x["recommended"]]
    assert len(marked) == 1 and marked[0]["fits"] and all(x["smallest_change"] is None for x in fit)
    assert not any(x["recommended"] for x in big)
    assert {x["smallest_change"] for x in big} == {big[0]["smallest_change"]}
    assert big[0]["smallest_change"].startswith("--micro-batch ")
    text = run("sweep", "--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100", "--seq-len", "2048",
               "--sweep-micro-batch", "1,8").output
    assert text.count(" *") == 1
    assert f"micro_batch 8: nothing fits as given; smallest change: {big[0]['smallest_change']}" in text


def test_sweep_warns_where_its_pick_leaves_less_than_the_headroom():
    """Issue 61 item 2 in `sweep`: Llama-3-8B at 8K tokens on 16 H100s picks zero3 with 2.5% free, under the
    5% asked by default: its rows carry recommend's warning and the table says it under itself; at 2%
    asked (--headroom) the same pick keeps it, and no warning is given."""
    given = ["--hf-config", "tests/data/hf/llama-3-8b.json", "--front-end", "analytic", "--gpu", "h100-sxm",
             "--seq-len", "8192", "--tp", "1", "--pp", "1"]
    args = ["sweep", *given, "--sweep-gpus", "16"]
    rows = json.loads(run(*args, "--json").output)
    rec = json.loads(run("recommend", *given, "--gpus", "16", "--json").output)["recommendation"]
    picked = [r for r in rows if r["recommended"]]
    assert [r["strategy"] for r in picked] == [rec["strategy"]]
    assert rec["warning"] and {r["warning"] for r in rows} == {rec["warning"]}
    assert f"gpus 16: warning: {rec['warning']}" in " ".join(run(*args).output.split())
    relaxed = json.loads(run(*args, "--headroom", "2%", "--json").output)
    assert [r["strategy"] for r in relaxed if r["recommended"]] == [rec["strategy"]]
    assert not any(r["warning"] for r in relaxed)


def test_sweep_bad_list():
    r = CliRunner().invoke(main, ["sweep", "--params", "7B", "--sweep-gpus", "8,x"])
    assert r.exit_code == 2 and "--sweep-gpus" in r.output


def test_catalog_list_and_show():
    r = run("catalog", "list", "gpus")
    assert "h100-sxm" in r.output
    r = run("catalog", "show", "dgx-h100")
    assert "ib-ndr" in r.output and "source" in r.output
    r = CliRunner().invoke(main, ["catalog", "show", "nope"])
    assert r.exit_code == 2


def test_user_catalog_dir(tmp_path):
    (tmp_path / "gpus").mkdir()
    (tmp_path / "gpus" / "my-gpu.yaml").write_text(
        "name: my-gpu\nvendor: nvidia\nmemory_gib: 48\nhbm_bandwidth_gb_per_s: 900\nbf16_tflops: 300\n"
        "fp32_tflops: 80\nmatmul_efficiency_fraction: 0.7\nscale_up_link: pcie4\nsource: my lab\n")
    r = run("estimate", "--params", "1B", "--gpus", "2", "--gpu", "my-gpu", "--catalog", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert "my-gpu (48.00 GiB)" in r.output


def test_every_command_is_in_the_readme():
    readme = open("README.md", encoding="utf-8").read()
    for name in main.list_commands(None):  # with the lazily imported ones (validate)
        assert f"distplan {name}" in readme, name


def test_gemma2_analytic_front_end_limits():
    """Gemma-2 plans with the formulas, but neither under tensor parallelism (the plan is torchtitan's Llama)
    nor as a reference-decoder probe (which has no sandwich norms or soft-capping): one line each, exit 2."""
    cfg = str(Path(__file__).parent / "data" / "hf" / "gemma-2-9b.json")
    r = CliRunner().invoke(main, ["estimate", "--hf-config", cfg, "--front-end", "analytic", "--gpus", "16"])
    assert r.exit_code == 0 and "attention eager" in r.output and "soft-cap" in r.output, r.output[-600:]
    r = CliRunner().invoke(main, ["estimate", "--hf-config", cfg, "--front-end", "analytic", "--gpus", "16", "--tp", "2"])
    assert r.exit_code == 2 and "tp=2 with a Gemma-2 model" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["validate", "--hf-config", cfg, "--front-end", "analytic", "--strategy", "zero3"])
    assert r.exit_code == 2 and "reference decoder" in r.output and "--front-end trace" in r.output


def test_qwen3_plans_with_the_formulas_but_is_no_reference_probe():
    """Qwen3's q/k norms are in the formulas (estimate --front-end analytic), not in the reference decoder
    that `validate --front-end analytic` runs: that is refused in one line, exit 2."""
    cfg = str(Path(__file__).parent / "data" / "hf" / "qwen3-8b.json")
    r = CliRunner().invoke(main, ["estimate", "--hf-config", cfg, "--front-end", "analytic", "--gpus", "8"])
    # the header wraps at the terminal width, where a long checkout path moves the break
    assert r.exit_code == 0 and "8,190,735,360 params" in " ".join(r.output.split()), r.output[-600:]
    r = CliRunner().invoke(main, ["validate", "--hf-config", cfg, "--front-end", "analytic", "--strategy", "zero3"])
    assert r.exit_code == 2 and "q/k norms" in r.output and "Traceback" not in r.output, r.output


def test_strategy_takes_a_comma_list_as_validate_does():
    """`--strategy zero3,fsdp` (validate's form) and `--strategy zero3 --strategy fsdp` plan the same two; an
    empty or unknown name in the list is the one-line error naming it."""
    a = json.loads(run("estimate", "--params", "1B", "--gpus", "8", "--strategy", "zero3,fsdp", "--json").output)
    b = json.loads(run("estimate", "--params", "1B", "--gpus", "8", "--strategy", "zero3", "--strategy", "fsdp",
                       "--json").output)
    assert [s["name"] for s in a["strategies"]] == [s["name"] for s in b["strategies"]] == ["zero3", "fsdp"]
    for bad, name in (("zero3,", "''"), ("zero3,fdsp", "'fdsp'")):
        r = CliRunner().invoke(main, ["estimate", "--params", "1B", "--gpus", "8", "--strategy", bad])
        assert r.exit_code == 2 and f"--strategy={name}: accepted:" in r.output and len(r.output.splitlines()) == 1


def test_attention_kernel_is_the_analytic_front_ends():
    """--attention-kernel flash-triton (llm-foundry's Triton FlashAttention) times the analytic decoder's
    attention; a traced transformers model runs its own attention, so --front-end trace refuses it (one line,
    exit 2) and auto picks the analytic front end. Neither imports torch to decide."""
    cfg = str(Path(__file__).parent / "data" / "hf" / "llama-3.2-1b.json")
    r = CliRunner().invoke(main, ["estimate", "--hf-config", cfg, "--front-end", "trace", "--attention-kernel",
                                  "flash-triton"])
    assert r.exit_code == 2 and "--attention-kernel=flash-triton" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["estimate", "--hf-config", cfg, "--attention-kernel", "flash-triton"])
    assert r.exit_code == 0 and "attention sdpa (flash-triton)" in r.output and "front end: analytic" in r.output


def test_alloc_conf_from_the_environment_is_named_as_such():
    """PYTORCH_CUDA_ALLOC_CONF=garbage:1 was blamed on --alloc-conf, which was not given (issue 62)."""
    r = CliRunner().invoke(main, ["estimate", "--params", "7B"], env={"PYTORCH_CUDA_ALLOC_CONF": "garbage:1"})
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0].startswith("Error: PYTORCH_CUDA_ALLOC_CONF='garbage:1': accepted:") and "environment" in lines[0]
    r = CliRunner().invoke(main, ["estimate", "--params", "7B", "--alloc-conf", "expandable_segments:True"],
                           env={"PYTORCH_CUDA_ALLOC_CONF": "garbage:1"})
    assert r.exit_code == 0, r.output


def test_missing_catalog_directory_names_the_flag(tmp_path):
    r = CliRunner().invoke(main, ["estimate", "--params", "7B", "--catalog", str(tmp_path / "none")])
    assert r.exit_code == 2 and "--catalog" in r.output and "extra_dirs" not in r.output, r.output
