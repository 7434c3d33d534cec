"""`distplan calibrate` (validate/calibrate.py): the fits recover known parameters from synthetic
measurements, the overlay round-trips through load_catalog, the CPU pipeline runs end to end, bad input
is one line with exit 2, and (on a GPU only) the real calibration."""

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from distplan.catalog import loader
from distplan.catalog.loader import clear_cache, load_catalog
from distplan.planner.cli import main
from distplan.planner.comm import bus_factor, latency_steps
from distplan.validate import calibrate as cal

MIB = 2**20

def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


# -- the fits ---------------------------------------------------------------------------------------

def test_linear_fit_exact_and_weighted():
    xs = [1.0, 2.0, 4.0, 8.0]
    a, b = cal.linear_fit(xs, [3 + 2 * x for x in xs])
    assert a == pytest.approx(3) and b == pytest.approx(2)
    a, b = cal.linear_fit(xs, [3 + 2 * x for x in xs], [1 / x for x in xs])
    assert a == pytest.approx(3) and b == pytest.approx(2)
    a, b = cal.linear_fit(xs, [-1 + 2 * x for x in xs], nonneg_intercept=True)  # refit through the origin
    assert a == 0 and b > 0
    assert cal.linear_fit([5.0], [10.0]) == (0.0, 2.0)


def test_fit_matmul_recovers_rate_and_half_size():
    peak, eff, G, over = 989e12, 0.8, 20e9, 4e-6
    rng = random.Random(0)
    shapes = [(m, n, k) for m in (512, 1024, 2048, 4096, 8192, 16384) for n in (1024, 4096, 16384)
              for k in (1024, 4096, 16384)]
    flops = [2.0 * m * n * k for m, n, k in shapes]
    secs = [(over + (f + G) / (peak * eff)) * (1 + rng.uniform(-0.01, 0.01)) for f in flops]
    fit = cal.fit_matmul(flops, secs, over)
    assert fit.rate_flops / peak == pytest.approx(eff, rel=0.01)
    assert fit.half_flop == pytest.approx(G, rel=0.05)
    assert fit.rel_rms < 0.01 and fit.points == len(shapes)
    exact = cal.fit_matmul(flops, [over + (f + G) / (peak * eff) for f in flops], over)
    assert exact.rate_flops == pytest.approx(peak * eff, rel=1e-9) and exact.half_flop == pytest.approx(G, rel=1e-6)


def test_fit_matmul_half_size_is_never_negative():
    flops = [1e9, 1e10, 1e11]
    fit = cal.fit_matmul(flops, [f / 1e12 - 1e-5 + 1e-5 * (f == 1e11) for f in flops])
    assert fit.half_flop >= 0 and fit.rate_flops > 0
    with pytest.raises(ValueError):
        cal.fit_matmul([1e9], [1e-3])


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
def test_fit_collective_recovers_busbw_latency_and_half(op):
    """Small messages at the (LL) per-step latency, large ones on a line a + factor*S/busbw: the fit gives
    busbw, the latency and S_half = (a - steps*latency) * busbw / factor, and the planner's alpha-beta model
    with them reproduces the large-message times (the planner's alpha-beta ring with S_half)."""
    n, busbw, lat, half = 8, 370e9, 2.0e-6, 8 * MIB
    f, steps = bus_factor(op, n), latency_steps(op, n)
    small = [8, 1024, 8192, 65536]
    large = [2**p * MIB for p in range(0, 11)]
    t_small = [steps * lat + f * s / 40e9 for s in small]  # LL: low latency, low bandwidth
    t_large = [steps * lat + f * (s + half) / busbw for s in large]
    fit = cal.fit_collective(op, n, small + large, t_small + t_large)
    assert fit.busbw_bytes_per_s == pytest.approx(busbw, rel=1e-6)
    assert fit.latency_s == pytest.approx(t_small[0] / steps, rel=1e-9)
    assert fit.latency_s == pytest.approx(lat, rel=0.01)
    assert fit.half_bytes == pytest.approx(half, rel=0.02)
    assert fit.rel_rms < 0.01
    assert fit.intercept_s == pytest.approx(steps * lat + f * half / busbw, rel=1e-6)
    for s, t in zip(large, t_large):  # the fitted alpha-beta model reproduces the large-message times
        assert steps * fit.latency_s + f * (s + fit.half_bytes) / fit.busbw_bytes_per_s == pytest.approx(t, rel=0.01)
    assert fit.peak_busbw_bytes_per_s == pytest.approx(max(f * s / t for s, t in zip(large, t_large)))


def test_fit_collective_noise_and_no_small_sizes():
    rng = random.Random(1)
    n, busbw, a = 2, 20e9, 30e-6
    sizes = [2**p * MIB for p in range(0, 8)]
    secs = [(a + bus_factor("all_reduce", n) * s / busbw) * (1 + rng.uniform(-0.02, 0.02)) for s in sizes]
    fit = cal.fit_collective("all_reduce", n, sizes, secs)
    assert fit.busbw_bytes_per_s == pytest.approx(busbw, rel=0.05)
    assert fit.latency_s == pytest.approx(a / latency_steps("all_reduce", n), rel=0.3)  # whole intercept
    assert fit.half_bytes >= 1024
    with pytest.raises(ValueError):
        cal.fit_collective("all_reduce", 1, sizes, secs)


def test_attention_flops_causal_half():
    assert cal.attention_flops(2, 32, 4096, 128) == 2 * 2 * 32 * 4096**2 * 128
    assert cal.attention_flops(2, 32, 4096, 128, causal=False) == 4 * 2 * 32 * 4096**2 * 128


def _synthetic_meas(peak=989e12, eff=0.75, G=30e9, hbm=3.35e12, hbm_eff=0.9, att=0.6, att_bwd=0.45,
                    over=3e-6, host=9e-6):
    shapes = [(m, n, n) for m in (512, 2048, 8192) for n in (1024, 4096, 16384)]
    mm = [(m, n, k, over + (2.0 * m * n * k + G) / (peak * eff)) for m, n, k in shapes]
    attn = []
    for b, h, s, d in [(8, 32, 2048, 128), (2, 32, 8192, 128)]:
        F = cal.attention_flops(b, h, s, d)
        attn.append({"b": b, "heads": h, "s": s, "head_dim": d, "backend": "flash", "fwd_flops": F,
                     "fwd_s": F / (peak * att), "bwd_s": 2.5 * F / (peak * att_bwd)})
    return {"launch": {"kernel_overhead_s": over, "host_op_s": host}, "matmul": mm,
            "bandwidth": {"copy": hbm * hbm_eff, "add": hbm * hbm_eff * 0.98}, "attention": attn}


def test_fit_gpu_recovers_every_key():
    keys, notes = cal.fit_gpu(_synthetic_meas(), 989e12, 3.35e12)
    assert notes == []
    assert keys == {
        "hbm_efficiency_fraction": 0.9, "matmul_efficiency_fraction": 0.75,
        "attention_efficiency_fraction": 0.6, "attention_backward_efficiency_fraction": 0.45,
        "matmul_half_efficiency_gflop": 30.0, "kernel_overhead_us": 3.0, "host_op_us": 9.0}


def test_fit_gpu_clamps_above_peak_and_without_peaks():
    keys, notes = cal.fit_gpu(_synthetic_meas(eff=0.75), 0.5 * 989e12, 0.5 * 3.35e12)
    assert keys["matmul_efficiency_fraction"] == 1.0 and keys["hbm_efficiency_fraction"] == 1.0
    assert any("--peak-tflops" in n for n in notes) and any("bandwidth" in n for n in notes)
    keys, _ = cal.fit_gpu(_synthetic_meas(), None, None)
    assert "matmul_efficiency_fraction" not in keys and keys["hbm_efficiency_fraction"] == 1.0


# -- identifying the GPU ----------------------------------------------------------------------------

@pytest.mark.parametrize("device_name, expect", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100-PCIE-40GB", "a100-40gb-pcie"), ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
    ("Tesla V100-SXM2-16GB", "v100-16gb"), ("Tesla V100-SXM2-32GB", "v100-32gb"), ("Tesla T4", "t4"),
    ("NVIDIA L4", "l4"), ("NVIDIA A10", "a10"), ("NVIDIA L40S", "l40s"), ("NVIDIA B200", "b200"),
    ("AMD Instinct MI300X", "mi300x"),
])
def test_match_gpu_by_name_and_memory(device_name, expect):
    cat = load_catalog()
    mem = int(cat.gpu(expect).memory_bytes * 0.985)  # torch reports a little less than nvidia-smi
    assert cal.match_gpu(device_name, mem, cat.entries("gpus")).name == expect


@pytest.mark.parametrize("device_name, mem_gib", [
    ("NVIDIA H100 NVL", 94), ("NVIDIA GeForce RTX 4090", 24), ("NVIDIA H100 80GB HBM3", 40), ("", 80)])
def test_match_gpu_unknown(device_name, mem_gib):
    assert cal.match_gpu(device_name, mem_gib * 2**30, load_catalog().entries("gpus")) is None


def test_catalog_slug_is_a_catalog_name():
    assert cal.catalog_slug("NVIDIA RTX 6000 Ada Generation") == "nvidia-rtx-6000-ada-generation"
    assert cal.catalog_slug("CPU AMD EPYC") == "cpu-amd-epyc"
    assert cal.catalog_slug("???") == "calibrated-device"
    assert loader._NAME_RE.match(cal.catalog_slug("x" * 300)) and len(cal.catalog_slug("x" * 300)) <= 60


# -- the overlay ------------------------------------------------------------------------------------

def _h100_result(**over):
    meas = _synthetic_meas()
    keys, notes = cal.fit_gpu(meas, 989e12, 3.35e12)
    r = {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "torch": "2.13.0", "cuda": "12.8",
         "hip": None, "nccl": "2.27.3", "nccl_algo": None, "date": "2026-01-02", "memory_bytes": 85e9,
         "device_count": 8, "quick": False, "seconds": 100.0, "catalog_gpu": "h100-sxm",
         "peak_flops": 989e12, "dtype": "bf16", "hbm_bytes_per_s": 3.35e12, "gpu_keys": keys, "measurements": meas,
         "notes": notes, "interconnect": "nvlink4",
         "interconnect_keys": {"busbw_efficiency_fraction": 0.8, "latency_us": 1.7, "half_efficiency_size_mib": 6.5},
         "collectives": {"world": 8, "fits": {}, "raw": {"default": {"all_reduce": {
             "sizes": [[MIB, 1e-4], [1024 * MIB, 5e-3]], "error": None}}}}}
    r.update(over)
    return r


def test_overlay_round_trips_through_load_catalog(tmp_path):
    r = _h100_result()
    written = cal.write_overlay(tmp_path, r)
    assert sorted(Path(p).relative_to(tmp_path).as_posix() for p in written) == [
        "gpus/h100-sxm.yaml", "interconnects/nvlink4.yaml"]
    clear_cache()
    builtin, cat = load_catalog(), load_catalog([tmp_path])
    g, b = cat.gpu("h100"), builtin.gpu("h100-sxm")
    assert g.path.startswith(str(tmp_path))
    assert (g.matmul_efficiency, g.hbm_efficiency, g.attention_efficiency, g.attention_backward_efficiency) == (
        0.75, 0.9, 0.6, 0.45)
    assert g.matmul_half_efficiency_flop == pytest.approx(30e9)
    assert g.kernel_overhead_s == pytest.approx(3e-6) and g.host_op_s == pytest.approx(9e-6)
    assert (g.flops, g.memory_bytes, g.aliases, g.scale_up_link) == (b.flops, b.memory_bytes, b.aliases, "nvlink4")
    assert set(b.source) < set(g.source)
    measured = [s for s in g.source if cal.MEASURED_TAG in s]
    assert len(measured) == 1 and "NVIDIA H100 80GB HBM3, torch 2.13.0, CUDA 12.8, 2026-01-02" in measured[0]
    link = cat.interconnect("nvlink4")
    assert (link.busbw_efficiency, link.latency_s, link.half_efficiency_bytes) == (0.8, pytest.approx(1.7e-6),
                                                                                   6.5 * MIB)
    assert link.line_rate_bytes_per_s == builtin.interconnect("nvlink4").line_rate_bytes_per_s
    assert any("NCCL 2.27.3, 8 GPUs" in s for s in link.source)
    # calibrating again over the overlay replaces the measured line instead of adding one
    r2 = _h100_result(date="2026-02-03")
    cal.write_overlay(tmp_path, r2, catalog_dirs=[str(tmp_path)])
    clear_cache()
    g2 = load_catalog([tmp_path]).gpu("h100-sxm")
    measured = [s for s in g2.source if cal.MEASURED_TAG in s]
    assert len(measured) == 1 and "2026-02-03" in measured[0]
    assert g2.notes.count("Calibrated:") == 1


def test_overlay_peak_flag_replaces_catalog_peak(tmp_path):
    r = _h100_result(peak_flops=700e12)
    cal.write_overlay(tmp_path, r)
    clear_cache()
    assert load_catalog([tmp_path]).gpu("h100-sxm").flops["bf16"] == 700e12


def test_overlay_new_gpu_entry(tmp_path):
    r = _h100_result(device_name="NVIDIA RTX 6000 Ada Generation", catalog_gpu=None, interconnect=None,
                     interconnect_keys=None, memory_bytes=48 * 2**30, hbm_bytes_per_s=960e9, peak_flops=364e12)
    (p,) = cal.write_overlay(tmp_path, r)
    assert Path(p).name == "nvidia-rtx-6000-ada-generation.yaml"
    clear_cache()
    g = load_catalog([tmp_path]).gpu("NVIDIA RTX 6000 Ada Generation")  # the device name is an alias
    assert g.flops == {"bf16": 364e12} and g.hbm_bytes_per_s == 960e9 and g.memory_bytes == 48 * 2**30
    assert g.vendor == "nvidia" and g.matmul_efficiency == r["gpu_keys"]["matmul_efficiency_fraction"]


def test_overlay_fp16_gpu_writes_its_fp16_peak(tmp_path):
    """A GPU without bf16 (V100) is measured in fp16 against its fp16 peak; --peak-tflops replaces that."""
    r = _h100_result(device_name="Tesla V100-SXM2-16GB", catalog_gpu="v100-16gb", dtype="fp16",
                     peak_flops=100e12, interconnect=None, interconnect_keys=None)
    cal.write_overlay(tmp_path, r)
    clear_cache()
    g = load_catalog([tmp_path]).gpu("v100-16gb")
    assert g.flops["fp16"] == 100e12 and "bf16" not in g.flops


def test_overlay_refusals(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(cal.CalibrationError, match="--out"):
        cal.write_overlay(f, _h100_result())
    with pytest.raises(cal.CalibrationError, match="--peak-tflops"):
        cal.write_overlay(tmp_path / "o", _h100_result(catalog_gpu=None, peak_flops=None))


def test_overlay_yaml_has_no_anchors_and_only_unit_keys(tmp_path):
    text = cal._dump_yaml({"source": ["a", "a"], "x_us": 1.0, "l": [1, 2]})
    assert "&" not in text and "*" not in text


# -- the measurements and the command on the CPU ----------------------------------------------------

def test_cli_cpu_quick_end_to_end(tmp_path):
    out = tmp_path / "calib"
    r = CliRunner().invoke(main, ["calibrate", "--device", "cpu", "--quick", "--peak-tflops", "1",
                                  "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output + r.stderr
    assert "these numbers describe the CPU" in r.stdout
    assert "calibrate [" in r.stderr and "100%" in r.stderr  # the progress bar, on stderr
    (p,) = (out / "gpus").iterdir()
    clear_cache()
    g = load_catalog([out]).gpu(p.stem)
    assert g.flops == {"bf16": 1e12} and 0 < g.matmul_efficiency <= 1 and g.hbm_efficiency == 1.0
    assert 0 < g.kernel_overhead_s < 1e-3 and 0 < g.host_op_s < 1e-3
    assert "describe the CPU" in g.notes and any("CPU" in s and cal.MEASURED_TAG in s for s in g.source)
    # the overlay works where a user puts it: --catalog
    r = run("estimate", "--params", "125M", "--gpus", "1", "--gpu", p.stem, "--catalog", str(out), "--json")
    assert r.exit_code == 0, r.output


def test_cli_cpu_json_without_peak_writes_nothing(tmp_path):
    out = tmp_path / "calib"
    r = CliRunner().invoke(main, ["calibrate", "--device", "cpu", "--quick", "--json", "--out", str(out)])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["device"] == "cpu" and d["overlay"] == {"dir": None, "files": []} and not out.exists()
    assert "matmul_efficiency_fraction" not in d["gpu_keys"]  # no peak, no efficiency
    assert d["measurements"]["matmul_fit"]["rate_flops"] > 1e8
    assert {"copy", "add"} == set(d["measurements"]["bandwidth"])
    assert all(a["bwd_s"] > 0 for a in d["measurements"]["attention"])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_cli_without_gpu_is_one_line_exit_2():
    r = run("calibrate", "--quick")
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "--device cuda: no GPU found" in lines[0] and "--device cpu" in lines[0]


@pytest.mark.parametrize("args, flag", [
    (["--device", "tpu"], "--device"), (["--peak-tflops", "0"], "--peak-tflops"),
    (["--peak-tflops", "nan"], "--peak-tflops"), (["--peak-tflops", "inf"], "--peak-tflops"),
    (["--peak-tflops", "2e6"], "--peak-tflops"), (["--peak-tflops", "x"], "--peak-tflops"),
    (["--out", ""], "--out"), (["--quick", "extra"], "extra"),
])
def test_cli_bad_input_is_one_line_exit_2(args, flag):
    r = run("calibrate", "--device", "cpu", *args)
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and flag in lines[0], r.output


def test_cli_out_is_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("")
    r = run("calibrate", "--device", "cpu", "--peak-tflops", "1", "--out", str(f))
    assert r.exit_code == 2 and "--out" in r.output and len(r.output.strip().splitlines()) == 1


def test_planner_cli_import_does_not_import_torch():
    code = ("import sys, distplan.planner.cli as c; assert 'calibrate' in c.main.list_commands(None); "
            "assert 'torch' not in sys.modules and 'distplan.validate.calibrate' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_launch_and_bandwidth_on_cpu():
    launch = cal.measure_launch("cpu", ops=200, trials=2)
    assert launch["kernel_overhead_s"] == launch["host_op_s"] and 1e-8 < launch["host_op_s"] < 1e-3
    bw = cal.measure_bandwidth("cpu", 2**22, target_s=0.002)
    assert all(1e8 < v < 1e13 for v in bw.values())


@pytest.mark.slow
def test_collectives_on_cpu_with_gloo():
    """The spawned-rank path (NCCL on GPUs) on two gloo ranks: every op timed or its error said, and the
    busbw fit runs on what came back."""
    res = cal.measure_collectives("cpu", 2, [8, 1024, 65536, MIB, 2 * MIB], timeout_s=120)
    assert set(res) == set(cal.COLLECTIVE_OPS)
    ar = res["all_reduce"]
    assert ar["error"] is None and [s for s, _ in ar["sizes"]] == [8, 1024, 65536, MIB, 2 * MIB]
    assert all(t > 0 for _, t in ar["sizes"])
    for op, r in res.items():
        assert r["error"] is None or r["sizes"] == [] or len(r["sizes"]) < 5, op
    fit = cal.fit_collective("all_reduce", 2, *zip(*ar["sizes"]))
    assert fit.busbw_bytes_per_s > 1e6 and fit.latency_s > 0


def test_text_progress_lines():
    import io
    s = io.StringIO()
    p = cal.TextProgress(s)
    for i, label in enumerate(["matmul 1", "matmul 2", "attention 1"]):
        p(i, 3, label)
    p(3, 3, "done")
    lines = s.getvalue().splitlines()
    assert len(lines) == 3 and lines[-1].startswith("calibrate [" + "#" * 24 + "] 100%")


def _fake_gpu_machine(monkeypatch, world=8, algos_fail=()):
    """calibrate('cuda') on this CPU: a fake 8x H100 node whose measurements follow known parameters."""
    info = {"device": "cuda", "torch": "2.13.0", "cuda": "12.8", "hip": None, "date": "2026-01-02",
            "device_name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85_045_000_000, "device_count": world,
            "uuid": "", "nccl": "2.27.3", "nccl_algo": None, "sm_count": 132}
    meas = _synthetic_meas()
    calls = []
    busbw, lat, half = 0.8 * 450e9, 1.5e-6, 4 * MIB

    def collectives(device, n, sizes, ops=cal.COLLECTIVE_OPS, algo=None, timeout_s=300.0):
        calls.append((algo, tuple(ops)))
        if algo in algos_fail:
            raise RuntimeError(f"NCCL_ALGO={algo}: no algorithm")
        out = {}
        for op in ops:
            f, steps = bus_factor(op, n), latency_steps(op, n)
            out[op] = {"error": None, "sizes": [
                [s, steps * lat + f * s / 30e9 if s <= cal.SMALL_MAX_BYTES else steps * lat + f * (s + half) / busbw]
                for s in sizes]}
        return out

    monkeypatch.setattr(cal, "check_device", lambda device: None)
    monkeypatch.setattr(cal, "_device_info", lambda device: dict(info))
    monkeypatch.setattr(cal, "_dtype_name", lambda device: "bf16")
    monkeypatch.setattr(cal, "measure_launch", lambda *a, step=None, **k: step("launch") or meas["launch"])
    monkeypatch.setattr(cal, "measure_host_step", lambda *a, step=None, **k: step("host") or {
        "host_op_s": meas["launch"]["host_op_s"], "host_step_s": 1e3 * meas["launch"]["host_op_s"],
        "host_step_ops": 1000})
    monkeypatch.setattr(cal, "measure_matmul", lambda *a, step=None, **k: step("matmul") or meas["matmul"])
    monkeypatch.setattr(cal, "measure_bandwidth", lambda *a, step=None, **k: step("bw") or meas["bandwidth"])
    monkeypatch.setattr(cal, "measure_attention", lambda *a, step=None, **k: step("attn") or meas["attention"])
    monkeypatch.setattr(cal, "measure_collectives", collectives)
    return calls, (busbw, lat, half)


def test_gpu_orchestration_on_a_fake_node(monkeypatch, tmp_path):
    """The GPU-only glue (identification, peaks from the catalog, collectives per algorithm, the link fit,
    both overlay files) with the measurements replaced by known parameters."""
    calls, (busbw, lat, half) = _fake_gpu_machine(monkeypatch, algos_fail=("Tree",))
    seen = []
    r = cal.calibrate("cuda", quick=False, progress=lambda d, t, label: seen.append((d, t, label)))
    assert r["catalog_gpu"] == "h100-sxm" and r["peak_flops"] == 989e12 and r["interconnect"] == "nvlink4"
    assert calls == [(None, cal.COLLECTIVE_OPS), ("Ring", ("all_reduce",)), ("Tree", ("all_reduce",))]
    assert any("NCCL_ALGO=Tree" in n for n in r["notes"])
    assert set(r["collectives"]["fits"]) == {"default/all_reduce", "default/all_gather", "default/reduce_scatter",
                                             "Ring/all_reduce"}
    assert r["gpu_keys"]["matmul_efficiency_fraction"] == 0.75
    assert r["interconnect_keys"] == {"busbw_efficiency_fraction": 0.8, "latency_us": pytest.approx(
        lat * 1e6 + bus_factor("all_reduce", 8) * 8 / 30e9 / 14 * 1e6, rel=1e-3),
        "half_efficiency_size_mib": pytest.approx(4.0, rel=0.01)}
    assert seen[-1][0] == seen[-1][1] and [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)
    written = cal.write_overlay(tmp_path, r)
    clear_cache()
    cat = load_catalog([tmp_path])
    link = cat.interconnect("nvlink4")
    assert link.busbw_efficiency == 0.8 and link.half_efficiency_bytes == pytest.approx(4 * MIB, rel=0.01)
    assert any("8 GPUs, all_reduce, NCCL_ALGO=Ring" in s and cal.MEASURED_TAG in s for s in link.source)
    assert len(written) == 2 and cat.gpu("h100").matmul_efficiency == 0.75
    assert r["gpu_keys"]["sm_count"] == 132 and cat.gpu("h100").sm_count == 132  # the device's own count
    text = cal.render(r, written, str(tmp_path))
    assert "interconnect nvlink4:" in text and "Ring/all_reduce on 8" in text and "(catalog: 0.803)" in text
    assert "sm_count: 132   (catalog: 132)" in text


def test_cli_on_a_fake_gpu_node(monkeypatch, tmp_path):
    _fake_gpu_machine(monkeypatch, world=2)
    r = CliRunner().invoke(main, ["calibrate", "--quick", "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["catalog_gpu"] == "h100-sxm" and d["collectives"]["world"] == 2
    assert sorted(Path(p).name for p in d["overlay"]["files"]) == ["h100-sxm.yaml", "nvlink4.yaml"]


def test_unknown_gpu_needs_peak_before_measuring(monkeypatch):
    _fake_gpu_machine(monkeypatch)
    monkeypatch.setattr(cal, "_device_info", lambda device: {
        "device": "cuda", "device_name": "NVIDIA GeForce RTX 4090", "memory_bytes": 24 * 2**30, "device_count": 1,
        "nccl_algo": None, "uuid": ""})
    monkeypatch.setattr(cal, "measure_launch", lambda *a, **k: pytest.fail("measured before the check"))
    r = run("calibrate")
    assert r.exit_code == 2 and "--peak-tflops" in r.output and "RTX 4090" in r.output
    assert len(r.output.strip().splitlines()) == 1


# -- on a GPU ---------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_gpu_quick_calibration(tmp_path):
    import torch
    r = cal.calibrate("cuda", quick=True, collectives=False,
                      peak_tflops=None if cal.match_gpu(torch.cuda.get_device_name(0),
                                                        torch.cuda.get_device_properties(0).total_memory,
                                                        load_catalog().entries("gpus")) else 1000.0)
    assert r["seconds"] < 60
    k = r["gpu_keys"]
    assert 0.2 < k["matmul_efficiency_fraction"] <= 1 and 0.3 < k["hbm_efficiency_fraction"] <= 1
    assert 0.05 < k["attention_efficiency_fraction"] <= 1 and 0.05 < k["attention_backward_efficiency_fraction"] <= 1
    assert 0.5 < k["kernel_overhead_us"] < 50 and 1 < k["host_op_us"] < 200
    assert k["sm_count"] == torch.cuda.get_device_properties(0).multi_processor_count
    assert r["measurements"]["matmul_fit"]["rel_rms"] < 0.3
    if "flop" in loader._DIM_MAX:
        written = cal.write_overlay(tmp_path, r)
        clear_cache()
        assert load_catalog([tmp_path]).gpu(Path(written[0]).stem).matmul_efficiency == k["matmul_efficiency_fraction"]


@pytest.mark.skipif(not __import__("torch").cuda.is_available() or __import__("torch").cuda.device_count() < 2,
                    reason="needs 2+ CUDA GPUs")
def test_gpu_nccl_collectives():
    import torch
    n = torch.cuda.device_count()
    res = cal.measure_collectives("cuda", n, [8, MIB, 16 * MIB, 64 * MIB])
    for op in cal.COLLECTIVE_OPS:
        assert res[op]["error"] is None
        fit = cal.fit_collective(op, n, *zip(*res[op]["sizes"]))
        assert fit.busbw_bytes_per_s > 1e9 and 0 < fit.latency_s < 1e-3
