"""`distplan calibrate`: measure this machine's GPU (and its GPU-to-GPU link) and write a catalog overlay.

Usage::

    distplan calibrate --out calib            # a few minutes on a GPU; --quick: well under a minute
    distplan estimate --catalog calib ...     # or: export DISTPLAN_CATALOG=calib
    distplan calibrate --device cpu --quick --peak-tflops 1 --out /tmp/c   # the pipeline on a CPU (tests)

Writes `<out>/gpus/<gpu>.yaml` (the catalog entry of the detected GPU with the measured keys replaced)
and, with 2+ GPUs, `<out>/interconnects/<intra-link>.yaml`; a same-named file replaces the built-in entry.
Definitions: GEMM FLOPs 2*m*n*k (`torch.matmul`); memory bandwidth = bytes read + written / time
(`Tensor.copy_`, `torch.add(out=)`); attention FLOPs of `torch.nn.functional.scaled_dot_product_attention`
(is_causal=True, `torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)`) 2*b*heads*s^2*head_dim
forward, 2.5x that backward (Dao 2023, FlashAttention-2 sec. 3.1); GPU times by `torch.cuda.Event`;
collectives `torch.distributed.all_reduce` / `all_gather_into_tensor` / `reduce_scatter_tensor`, busbw =
algbw x 2(n-1)/n (all-reduce) or (n-1)/n (all-gather, reduce-scatter, S = the full buffer) as defined by
NVIDIA/nccl-tests doc/PERFORMANCE.md.

Owns the pure fits (no torch: `fit_matmul`, `fit_collective`, `fit_gpu`, `match_gpu`), the measurements
(torch imported inside; each takes a `device`, so the same code runs on "cpu" for tests), the collective
workers (one process per GPU on 127.0.0.1, NCCL; gloo on CPU) and `write_overlay`.

Model choices: a GEMM of F FLOPs takes (F + G) / (peak x eff) after the per-kernel overhead (weighted
least squares, relative errors, over the sweep: G = `matmul_half_efficiency_gflop`). A collective of S bytes
takes steps x latency + factor x (S + S_half) / busbw (planner/comm.py): busbw and the intercept come from a
fit to sizes >= 1 MiB, the per-step latency from the fastest small message (<= 64 KiB) / steps, and S_half
from what the intercept leaves; the split of the intercept cannot be identified with one group size. The
link keys come from all-reduce with NCCL_ALGO=Ring (the catalog's figure is the ring's); NCCL's default
(NVLS on NVSwitch nodes), Tree (full run) and the other ops are measured and reported in --json.

Known limitations: peaks come from the catalog (or `--peak-tflops`), so efficiencies are only as right as
those; the intra-node link is the GPU entry's `scale_up_link` (a PCIe card with an NVLink bridge is
measured against the PCIe line rate); NVLS/in-switch reductions above the line rate are clamped to 1.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from distplan.catalog.loader import UNIT_SUFFIXES, clear_cache, load_catalog
from distplan.catalog.yaml_guard import Refused, read_yaml

# (the fits and the measurements are `calibrate_fit`'s and `calibrate_measure`'s; named here as before: __all__)
from .calibrate_fit import (COLLECTIVE_OPS, LARGE_MIN_BYTES, SMALL_MAX_BYTES, CalibrationError, CollectiveFit,
                            MatmulFit, _fraction, _sig, attention_flops, bus_factor, fit_collective, fit_gpu,
                            fit_matmul, linear_fit)
from .calibrate_measure import (_device_info, _dtype_name, _nvml_peak_bandwidth, check_device, count_aten_ops,
                                measure_attention, measure_bandwidth, measure_collectives, measure_host_step,
                                measure_launch, measure_matmul, reference_step)

__all__ = [
    "CalibrationError", "MatmulFit", "CollectiveFit", "linear_fit", "fit_matmul", "fit_collective",
    "attention_flops", "fit_gpu", "match_gpu", "catalog_slug", "check_device", "measure_matmul",
    "measure_bandwidth", "measure_attention", "measure_launch", "measure_host_step", "count_aten_ops",
    "reference_step", "measure_collectives",
    "calibrate",
    "write_overlay", "render", "TextProgress",
]

MIB = 2**20
MEASURED_TAG = "measured by distplan calibrate"
"""Every source line the overlay adds starts its text with this (an older one is dropped on recalibration)."""

# -- sweeps ---------------------------------------------------------------------------------------

_GPU_M = (512, 1024, 2048, 4096, 8192, 16384)            # tokens
_GPU_NK = (1024, 2048, 4096, 8192, 16384)                 # weight dims
SWEEPS: dict[tuple[str, bool], dict[str, Any]] = {
    # (device kind, quick) -> shapes and sizes
    ("cuda", False): dict(
        matmul=[(m, n, k) for m in _GPU_M for n in _GPU_NK for k in _GPU_NK],
        attention=[(16384 // s, 32, s, 128) for s in (1024, 2048, 4096, 8192)],  # (b, heads, s, head_dim)
        bandwidth_bytes=2**30, launch_ops=256, target_s=0.02,
        collective_sizes=[8, 1024, 8192, 65536] + [2**p * MIB for p in range(0, 11)],
        algorithms=(None, "Ring", "Tree")),
    ("cuda", True): dict(
        matmul=[(m, n, n) for m in (512, 2048, 8192) for n in (1024, 4096, 16384)] + [(4096, 4096, 16384)],
        attention=[(8, 32, 2048, 128), (2, 32, 8192, 128)],
        bandwidth_bytes=2**28, launch_ops=256, target_s=0.01,
        collective_sizes=[8, 8192] + [4**p * MIB for p in range(0, 5)], algorithms=(None, "Ring")),
    ("cpu", False): dict(
        matmul=[(m, n, k) for m in (64, 128, 256, 512) for n in (256, 512, 1024) for k in (256, 512, 1024)],
        attention=[(1, 4, 256, 64), (1, 4, 512, 64), (1, 4, 1024, 64)],
        bandwidth_bytes=2**26, launch_ops=2000, target_s=0.05,
        collective_sizes=[8, 1024, 65536, MIB, 4 * MIB], algorithms=(None,)),
    ("cpu", True): dict(
        matmul=[(m, n, n) for m in (64, 256) for n in (256, 512, 1024)],
        attention=[(1, 4, 256, 64), (1, 4, 512, 64)],
        bandwidth_bytes=2**25, launch_ops=1000, target_s=0.01,
        collective_sizes=[8, 1024, 65536, MIB], algorithms=(None,)),
}


# -- identifying the GPU ---------------------------------------------------------------------------

_VENDOR_WORDS = {"nvidia", "tesla", "amd", "instinct", "radeon", "geforce", "quadro", "rtx", "intel",
                 "data", "center", "gpu", "tensor", "core"}
_FORM_WORDS = {"pcie", "sxm", "sxm2", "sxm3", "sxm4", "sxm5", "nvl", "oam"}


def _tokens(name: str) -> list[str]:
    return [t for t in re.split(r"[^a-z0-9]+", name.lower()) if t]


def _model_token(device_name: str) -> str | None:
    for t in _tokens(device_name):
        if t in _VENDOR_WORDS or t in _FORM_WORDS or re.fullmatch(r"\d+gb|hbm\d*e?|\d+", t):
            continue
        if re.fullmatch(r"[a-z]+\d+[a-z]*", t):
            return t
    return None


def match_gpu(device_name: str, memory_bytes: int, gpus: Sequence[Any]) -> Any | None:
    """The catalog GPU (an entry with .name, .aliases, .memory_bytes) that `device_name` (as
    torch.cuda.get_device_name says it, e.g. 'NVIDIA H100 80GB HBM3') and its memory describe, or None.

    Candidates share the model token (h100, a100, mi300x, ...) with the entry's name or an alias; a
    'PCIe' device prefers a '-pcie' entry and any other prefers one without; an 'NVL' device takes only an
    '-nvl' entry; memory must agree within 10% and the closest wins."""
    model = _model_token(device_name)
    if model is None:
        return None
    toks = set(_tokens(device_name))
    cands = []
    for g in gpus:
        names = [g.name, *g.aliases]
        if any(_tokens(n)[:1] == [model] for n in names if _tokens(n)):
            cands.append(g)
    pcie = "pcie" in toks
    same_form = [g for g in cands if ("pcie" in g.name) == pcie]
    cands = same_form or cands
    if "nvl" in toks:  # an NVL card (H100 NVL: 94 GB) is neither the SXM part nor the PCIe one
        cands = [g for g in cands if "nvl" in _tokens(g.name)]
    fits = [g for g in cands if abs(g.memory_bytes - memory_bytes) <= 0.10 * max(memory_bytes, 1)]
    if not fits:
        return None
    return min(fits, key=lambda g: abs(g.memory_bytes - memory_bytes))


def catalog_slug(device_name: str, prefix: str = "") -> str:
    """A catalog file name for a device: lowercase letters, digits and '-' ('NVIDIA RTX 6000 Ada' ->
    'nvidia-rtx-6000-ada'), at most 60 characters."""
    s = "-".join(_tokens(prefix + " " + device_name))[:60].strip("-")
    return s or "calibrated-device"


# -- the whole calibration -------------------------------------------------------------------------

def _peak_from_flag(peak_tflops: float | None) -> float | None:
    if peak_tflops is None:
        return None
    if not (isinstance(peak_tflops, (int, float)) and math.isfinite(peak_tflops) and 1e-3 <= peak_tflops <= 1e6):
        raise CalibrationError(f"--peak-tflops={peak_tflops!r:.40}: accepted: a dense bf16 peak in TFLOP/s, "
                               f"0.001 to 1,000,000")
    return float(peak_tflops) * 1e12


def calibrate(device: str = "cuda", quick: bool = False, peak_tflops: float | None = None,
              progress: Callable[[int, int, str], None] | None = None, catalog_dirs: Sequence[str] = (),
              collectives: bool | None = None, sweep: dict | None = None) -> dict:
    """Measure this machine and fit the catalog keys. Returns a JSON-able dict (see `write_overlay`).

    `progress(done, total, label)` is called before each measurement and once at the end. `collectives`:
    None = with 2+ GPUs on 'cuda'. `sweep` overrides SWEEPS entries (tests)."""

    peak = _peak_from_flag(peak_tflops)
    check_device(device)
    info = _device_info(device)
    cat = load_catalog(tuple(catalog_dirs))
    entry = match_gpu(info["device_name"], info["memory_bytes"], cat.entries("gpus")) if device == "cuda" else None
    if entry is None and peak is None and device == "cuda":
        raise CalibrationError(f"--peak-tflops: GPU {info['device_name'][:60]!r} is not in the catalog; give its "
                               f"dense bf16 peak, e.g. --peak-tflops 989 (known: {', '.join(cat.names('gpus'))})")
    dtype = _dtype_name(device)
    if peak is None and entry is not None:
        peak = entry.flops.get(dtype) or entry.flops.get("bf16") or max(entry.flops.values())
    hbm = entry.hbm_bytes_per_s if entry is not None else (
        _nvml_peak_bandwidth(info.get("uuid", "")) if device == "cuda" else None)
    sw = dict(SWEEPS[(device, bool(quick))], **(sweep or {}))
    world = info["device_count"] if device == "cuda" else 1
    if collectives is None:
        collectives = device == "cuda" and world >= 2
    algos = [None] if info["nccl_algo"] else list(sw["algorithms"])
    n_coll = (len(algos) if collectives else 0)
    total = len(sw["matmul"]) + 3 + len(sw["attention"]) + 1 + n_coll
    done = 0

    def step(label: str) -> None:
        nonlocal done
        if progress:
            progress(done, total, label)
        done += 1

    t_start = time.perf_counter()
    meas: dict[str, Any] = {}
    import torch
    threads = torch.get_num_threads()
    if device == "cpu":  # one thread: steadier on a shared machine, and the pipeline is what is tested
        torch.set_num_threads(1)
    try:
        meas["launch"] = measure_launch(device, sw["launch_ops"], step=step)
        host = measure_host_step(device, step=step)
        meas["launch"].update(host_op_s=host["host_op_s"], host_step_s=host["host_step_s"],
                              host_step_ops=host["host_step_ops"])
        meas["matmul"] = measure_matmul(device, sw["matmul"], sw["target_s"], step=step)
        meas["bandwidth"] = measure_bandwidth(device, sw["bandwidth_bytes"], sw["target_s"], step=step)
        meas["attention"] = measure_attention(device, sw["attention"], sw["target_s"], step=step)
    finally:
        torch.set_num_threads(threads)
    keys, notes = fit_gpu(meas, peak, hbm)
    if info.get("sm_count"):  # the SMs NCCL's CTAs share with the GEMMs (planner/compute.py sm_shares)
        keys["sm_count"] = info["sm_count"]

    link_keys, link_fits, coll = None, {}, {}
    link = cat.interconnect(entry.scale_up_link) if entry is not None else None
    if collectives:
        for algo in algos:
            step(f"collectives on {world} {'GPUs' if device == 'cuda' else 'ranks'}"
                 f"{' NCCL_ALGO=' + algo if algo else ''}")
            ops = COLLECTIVE_OPS if algo is None else ("all_reduce",)
            try:
                coll[algo or "default"] = measure_collectives(device, world, sw["collective_sizes"], ops, algo)
            except Exception as e:  # one algorithm failing (e.g. Tree unavailable) does not lose the rest
                if algo is None:
                    raise
                notes.append(f"NCCL_ALGO={algo}: {' '.join(str(e).split())[:160]}")
        for algo, per_op in coll.items():
            for op, r in per_op.items():
                if r.get("error") or len(r["sizes"]) < 2:
                    continue
                f = fit_collective(op, world, [s for s, _ in r["sizes"]], [t for _, t in r["sizes"]])
                link_fits[f"{algo}/{op}"] = {
                    "busbw_gb_per_s": f.busbw_bytes_per_s / 1e9, "peak_busbw_gb_per_s": f.peak_busbw_bytes_per_s / 1e9,
                    "latency_us": f.latency_s * 1e6, "half_efficiency_size_mib": f.half_bytes / MIB,
                    "large_message_intercept_us": f.intercept_s * 1e6,
                    "rel_rms": f.rel_rms,
                    "busbw_by_size_gb_per_s": [[s, bus_factor(op, world) * s / t / 1e9] for s, t in r["sizes"]]}
        # the catalog's busbw is the ring's (NVLS, in-switch reduction, goes above the line rate)
        main = link_fits.get("Ring/all_reduce") or link_fits.get("default/all_reduce")
        if main is not None and link is not None:
            if "Ring/all_reduce" not in link_fits:
                notes.append("the link keys come from NCCL's default algorithm for all_reduce (the ring was not "
                             "measured: NCCL_ALGO is set)")
            eff = main["busbw_gb_per_s"] * 1e9 / link.line_rate_bytes_per_s
            if eff > 1:
                notes.append(f"all_reduce busbw {main['busbw_gb_per_s']:.4g} GB/s is above {link.name}'s line rate "
                             f"(in-switch reduction, NVLS?): busbw_efficiency_fraction clamped to 1")
            link_keys = {"busbw_efficiency_fraction": _fraction(eff), "latency_us": _sig(main["latency_us"]),
                         "half_efficiency_size_mib": max(_sig(main["half_efficiency_size_mib"]), 0.001)}
    result = {
        **info,
        "quick": bool(quick),
        "dtype": dtype,
        "seconds": time.perf_counter() - t_start,
        "catalog_gpu": entry.name if entry is not None else None,
        "peak_flops": peak,
        "hbm_bytes_per_s": hbm,
        "gpu_keys": keys,
        "interconnect": link.name if (link is not None and link_keys) else None,
        "interconnect_keys": link_keys,
        "collectives": {"world": world, "raw": coll, "fits": link_fits} if collectives else None,
        "measurements": meas,
        "notes": notes,
    }
    if progress:
        progress(total, total, "done")
    return result


# -- the overlay -----------------------------------------------------------------------------------

def _base_of(key: str) -> str:
    for sfx in sorted(UNIT_SUFFIXES, key=len, reverse=True):
        if key.endswith(sfx) and len(key) > len(sfx):
            return key[: -len(sfx)]
    return key


def _replace(data: dict, new: dict, source_line: str, note: str) -> dict:
    """`data` (a catalog entry's YAML mapping) with `new`'s keys replaced (other units of the same key
    dropped), new keys placed before `source`, the measured source line added (older ones dropped)."""
    bases = {_base_of(k) for k in new}
    out: dict[str, Any] = {}
    for k, v in data.items():
        if k == "source":
            for nk, nv in new.items():
                out.setdefault(nk, nv)
            src = [v] if isinstance(v, str) else list(v or [])
            out["source"] = [s for s in src if MEASURED_TAG not in str(s)] + [source_line]
            continue
        if k not in new and _base_of(k) in bases and k != "name":
            continue
        out[k] = new.get(k, v)
    for nk, nv in new.items():
        out.setdefault(nk, nv)
    if "source" not in out:
        out["source"] = [source_line]
    old = str(out.get("notes") or "")
    old = old.split(" Calibrated:")[0].strip()
    out["notes"] = (old + " " if old else "") + note
    return out


def _dump_yaml(data: dict) -> str:
    import yaml

    class _NoAlias(yaml.SafeDumper):  # the catalog refuses anchors and aliases
        def ignore_aliases(self, data):
            return True

    return yaml.dump(data, Dumper=_NoAlias, sort_keys=False, default_flow_style=False, width=120,
                     allow_unicode=True)


def _read_yaml(path: str) -> dict:
    """A catalog entry's YAML through the catalog's guards (size, anchors and aliases, depth)."""
    try:
        data = read_yaml(path)
    except Refused as e:
        raise ValueError(f"{path}: {e}") from None
    return data if isinstance(data, dict) else {}


def _source_line(result: dict, keys: Sequence[str], extra: str = "") -> str:
    cuda = result.get("cuda") or (f"HIP {result['hip']}" if result.get("hip") else "none")
    return (f"{', '.join(keys)}: {MEASURED_TAG} on {result['device_name']}, torch {result['torch']}, "
            f"CUDA {cuda}{extra}, {result['date']}")


def write_overlay(out_dir: str | os.PathLike, result: dict, catalog_dirs: Sequence[str] = ()) -> list[str]:
    """Write `<out>/gpus/<name>.yaml` (and `<out>/interconnects/<link>.yaml` with collectives) from a
    `calibrate` result; check that `load_catalog([out_dir])` reads back the measured values. Returns the
    paths written. A GPU not in the catalog (or the CPU) becomes a new entry, which needs a peak."""

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CalibrationError(f"--out={str(out_dir)[:60]!r} is a file; accepted: a directory (created if missing)")
    keys = dict(result["gpu_keys"])
    if result.get("peak_flops") is None:
        raise CalibrationError("--peak-tflops: needed to write an overlay for a device not in the catalog")
    cat = load_catalog(tuple(catalog_dirs))
    is_cpu = result["device"] == "cpu"
    peak_dtype = "fp16" if result.get("dtype") == "fp16" else "bf16"  # the CPU's pseudo-GPU: bf16
    quick = " (--quick)" if result.get("quick") else ""
    mm = result["measurements"]["matmul_fit"]
    note = (f"Calibrated: {mm['points']} GEMM shapes fit to rel. rms {100 * mm['rel_rms']:.1f}%{quick}"
            + (f"; {'; '.join(result['notes'])}" if result["notes"] else "") + ".")
    if is_cpu:
        note += " These numbers describe the CPU, not a GPU: a pseudo-GPU to test the pipeline."
    if result["catalog_gpu"] is not None:
        entry = cat.gpu(result["catalog_gpu"])
        data = _read_yaml(entry.path)
        name = entry.name
        peak_given = result["peak_flops"]
        if abs(peak_given - (entry.flops.get(peak_dtype) or 0)) > 1e-6 * peak_given:
            keys[f"{peak_dtype}_tflops"] = _sig(peak_given / 1e12, 6)
    else:
        name = catalog_slug(result["device_name"], prefix="cpu" if is_cpu and
                            not result["device_name"].lower().startswith("cpu") else "")
        vendor = "other"
        low = result["device_name"].lower()
        if not is_cpu:
            vendor = "amd" if (result.get("hip") or "amd" in low) else "nvidia" if "nvidia" in low else "other"
        hbm = result.get("hbm_bytes_per_s") or max(result["measurements"]["bandwidth"].values())
        data = {"name": name, "vendor": vendor, "memory_mib": max(1, result["memory_bytes"] // MIB),
                "hbm_bandwidth_gb_per_s": _sig(hbm / 1e9, 6),
                f"{peak_dtype}_tflops": _sig(result["peak_flops"] / 1e12, 6), "scale_up_link": "pcie4",
                "source": [f"memory: {'the machine RAM' if is_cpu else 'torch.cuda.get_device_properties'}; "
                           f"{peak_dtype}_tflops: --peak-tflops; hbm_bandwidth: "
                           + ("NVML max memory clock x 2 x bus width" if result.get("hbm_bytes_per_s")
                              else "the measured bandwidth (so hbm_efficiency_fraction is 1)")
                           + "; scale_up_link: pcie4, an assumption"]}
        if not is_cpu:
            data["aliases"] = [result["device_name"]]
        if cat.names("gpus").count(name) or any(name == a.lower() for g in cat.entries("gpus") for a in g.aliases):
            raise CalibrationError(f"--out: the new entry name {name!r} is already a catalog GPU")
    src = _source_line(result, [k for k in keys if not k.endswith("_tflops")])
    gpu_yaml = _replace(data, keys, src, note)
    gpu_yaml.pop("name", None)
    gpu_yaml = {"name": name, **gpu_yaml}
    written: list[str] = []
    try:
        (out / "gpus").mkdir(parents=True, exist_ok=True)
        p = out / "gpus" / f"{name}.yaml"
        p.write_text(_dump_yaml(gpu_yaml), encoding="utf-8")
        written.append(str(p))
        if result.get("interconnect_keys") and result.get("interconnect"):
            link = cat.interconnect(result["interconnect"])
            c = result["collectives"]
            ring = "Ring" in c["raw"]
            algo = "NCCL_ALGO=Ring" if ring else (f"NCCL_ALGO={result['nccl_algo']}" if result.get("nccl_algo")
                                                  else "NCCL's default algorithm")
            largest = max(x for x, _ in c["raw"]["Ring" if ring else "default"]["all_reduce"]["sizes"])
            ldata = _replace(_read_yaml(link.path), result["interconnect_keys"],
                             _source_line(result, list(result["interconnect_keys"]),
                                          f", NCCL {result.get('nccl')}, {c['world']} GPUs, all_reduce, {algo}"),
                             f"Calibrated: all_reduce ({algo}) on {c['world']} GPUs, sizes up to "
                             f"{largest / MIB:.0f} MiB; small-message latency per ring step, the rest of the "
                             f"intercept as S_half.")
            (out / "interconnects").mkdir(parents=True, exist_ok=True)
            lp = out / "interconnects" / f"{link.name}.yaml"
            lp.write_text(_dump_yaml({"name": link.name, **{k: v for k, v in ldata.items() if k != "name"}}),
                          encoding="utf-8")
            written.append(str(lp))
    except OSError as e:
        raise CalibrationError(f"--out={str(out_dir)[:60]!r}: cannot write ({e.strerror or e}); accepted: a "
                               f"writable directory") from None
    clear_cache()
    check = load_catalog((*catalog_dirs, str(out)))
    g = check.gpu(name)
    want = {"matmul_efficiency_fraction": g.matmul_efficiency, "hbm_efficiency_fraction": g.hbm_efficiency,
            "kernel_overhead_us": g.kernel_overhead_s * 1e6, "host_op_us": g.host_op_s * 1e6,
            "matmul_half_efficiency_gflop": g.matmul_half_efficiency_flop / 1e9,
            "attention_efficiency_fraction": g.attention_efficiency,
            "attention_backward_efficiency_fraction": g.attention_backward_efficiency}
    for k, v in keys.items():
        if k in want and not math.isclose(want[k], v, rel_tol=1e-9):
            raise RuntimeError(f"overlay check: {k} reads back {want[k]}, wrote {v}")  # a bug, not user input
    return written


# -- output ----------------------------------------------------------------------------------------

class TextProgress:
    """A one-line text progress bar on a stream (stderr): redrawn in place on a terminal, one line per
    stage otherwise (logs)."""

    def __init__(self, stream=None, width: int = 24):
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self._stage = None

    def __call__(self, done: int, total: int, label: str) -> None:
        frac = done / total if total else 1.0
        fill = int(round(self.width * frac))
        line = (f"calibrate [{'#' * fill}{'.' * (self.width - fill)}] {100 * frac:3.0f}% "
                f"{time.perf_counter() - self.t0:5.1f}s {label}")
        stage = label.split(" ")[0]
        if self.tty:
            self.stream.write("\r" + line[:100].ljust(100) + ("\n" if done >= total else ""))
        elif stage != self._stage or done >= total:
            self.stream.write(line + "\n")
        self._stage = stage
        self.stream.flush()


def render(result: dict, written: Sequence[str], out_dir: str) -> str:
    """The human-readable summary: the measured keys beside the catalog's, and where the overlay is."""
    lines = [f"device: {result['device_name']} (torch {result['torch']}, CUDA {result.get('cuda') or 'none'}"
             + (f", NCCL {result['nccl']}" if result.get("nccl") else "") + f"), {result['seconds']:.1f} s"
             + (" (--quick)" if result.get("quick") else "")]
    if result["device"] == "cpu":
        lines.append("note: these numbers describe the CPU, not a GPU (--device cpu tests the pipeline)")
    old = load_catalog().gpu(result["catalog_gpu"]) if result["catalog_gpu"] else None
    old_vals = {} if old is None else {
        "matmul_efficiency_fraction": old.matmul_efficiency, "hbm_efficiency_fraction": old.hbm_efficiency,
        "attention_efficiency_fraction": old.attention_efficiency,
        "attention_backward_efficiency_fraction": old.attention_backward_efficiency,
        "matmul_half_efficiency_gflop": old.matmul_half_efficiency_flop / 1e9,
        "kernel_overhead_us": old.kernel_overhead_s * 1e6, "host_op_us": old.host_op_s * 1e6,
        **({"sm_count": old.sm_count} if old.sm_count else {})}
    lines.append(f"catalog gpu: {result['catalog_gpu'] or '(none: a new entry)'}")
    m = result["measurements"]
    lines.append(f"  large GEMM {m['matmul_fit']['rate_flops'] / 1e12:.4g} TFLOP/s, memory "
                 f"{max(m['bandwidth'].values()) / 1e9:.4g} GB/s")
    for k, v in result["gpu_keys"].items():
        was = f"   (catalog: {old_vals[k]:.4g})" if k in old_vals else ""
        lines.append(f"  {k}: {v:g}{was}")
    if result.get("collectives"):
        c = result["collectives"]
        for key, f in c["fits"].items():
            lines.append(f"  {key} on {c['world']}: busbw {f['busbw_gb_per_s']:.4g} GB/s, latency "
                         f"{f['latency_us']:.3g} us/step, S_half {f['half_efficiency_size_mib']:.3g} MiB")
        if result.get("interconnect_keys"):
            lines.append(f"interconnect {result['interconnect']}:")
            for k, v in result["interconnect_keys"].items():
                lines.append(f"  {k}: {v:g}")
    for n in result["notes"]:
        lines.append(f"note: {n}")
    if written:
        lines.append(f"catalog overlay written: {', '.join(written)}")
        lines.append(f"use it: distplan estimate --catalog {out_dir} ...  (or DISTPLAN_CATALOG={out_dir})")
    else:
        lines.append("no overlay written: --device cpu writes a pseudo-GPU only with --peak-tflops")
    return "\n".join(lines)
