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

import datetime as _dt
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from distplan.catalog.loader import UNIT_SUFFIXES, clear_cache, load_catalog
from distplan.planner.comm import bus_factor as _bf, latency_steps as _ls
from distplan.planner.model import ModelSpec

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
SMALL_MAX_BYTES = 64 * 1024
"""Collective sizes up to this measure latency."""
LARGE_MIN_BYTES = MIB
"""Collective sizes from this on measure bandwidth (the busbw fit)."""
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter")


class CalibrationError(ValueError):
    """A user-facing problem (no GPU, a GPU not in the catalog without --peak-tflops, a bad --out): one line."""


# -- pure fits (no torch) -------------------------------------------------------------------------

def linear_fit(xs: Sequence[float], ys: Sequence[float], weights: Sequence[float] | None = None,
               nonneg_intercept: bool = False) -> tuple[float, float]:
    """(intercept, slope) of y = a + b x by weighted least squares (closed form).

    `nonneg_intercept`: a negative intercept is refit through the origin (a = 0).
    """
    if len(xs) != len(ys) or not xs:
        raise ValueError("linear_fit needs equal, non-empty xs and ys")
    w = list(weights) if weights is not None else [1.0] * len(xs)
    W = sum(w)
    Sx = sum(wi * x for wi, x in zip(w, xs))
    Sy = sum(wi * y for wi, y in zip(w, ys))
    Sxx = sum(wi * x * x for wi, x in zip(w, xs))
    Sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = W * Sxx - Sx * Sx
    if len(xs) >= 2 and det > 1e-12 * max(W * Sxx, 1e-300):
        b = (W * Sxy - Sx * Sy) / det
        a = (Sy - b * Sx) / W
    else:  # one point, or all x equal: through the origin
        a, b = 0.0, Sxy / Sxx if Sxx > 0 else 0.0
    if nonneg_intercept and a < 0:
        a, b = 0.0, Sxy / Sxx if Sxx > 0 else 0.0
    return a, b


def _rel_rms(pred: Sequence[float], meas: Sequence[float]) -> float:
    return math.sqrt(sum((p / m - 1.0) ** 2 for p, m in zip(pred, meas)) / len(meas)) if meas else 0.0


@dataclass(frozen=True)
class MatmulFit:
    """t(F) = overhead + (F + half_flop) / rate for a GEMM of F = 2mnk FLOPs."""

    rate_flops: float
    """Large-GEMM FLOP/s (the asymptote)."""
    half_flop: float
    """GEMM size (FLOP) at which the rate is half the asymptote."""
    rel_rms: float
    """Root-mean-square relative error of the fit over the sweep."""
    points: int


def fit_matmul(flops: Sequence[float], seconds: Sequence[float], overhead_s: float = 0.0) -> MatmulFit:
    """Fit rate(F) = R x F / (F + G) to GEMM times: (t - overhead) = F / R + G / R, weighted by 1/t^2
    (relative errors), G >= 0. Pure Python."""
    if len(flops) < 2 or len(flops) != len(seconds):
        raise ValueError("fit_matmul needs at least two (flops, seconds) pairs")
    ys = [max(t - overhead_s, 0.5 * t) for t in seconds]
    a, b = linear_fit(list(flops), ys, [1.0 / (y * y) for y in ys], nonneg_intercept=True)
    if b <= 0:  # noise: fall back to the best observed rate
        rate = max(f / y for f, y in zip(flops, ys))
        a, b = 0.0, 1.0 / rate
    pred = [overhead_s + a + b * f for f in flops]
    return MatmulFit(rate_flops=1.0 / b, half_flop=a / b, rel_rms=_rel_rms(pred, seconds), points=len(flops))


def bus_factor(op: str, n: int) -> float:
    """nccl-tests doc/PERFORMANCE.md factors (the planner's, distplan.planner.comm.bus_factor)."""
    return _bf(op, n)


def latency_steps(op: str, n: int) -> int:
    """Ring steps of a collective (the planner's, distplan.planner.comm.latency_steps)."""
    return _ls(op, n)


@dataclass(frozen=True)
class CollectiveFit:
    """One collective on one group: t(S) = steps x latency + factor x (S + half_bytes) / busbw."""

    op: str
    n: int
    busbw_bytes_per_s: float
    """Large-message bus bandwidth (the fit's slope)."""
    latency_s: float
    """Per ring step: the fastest small message / steps."""
    half_bytes: float
    """What the large-message intercept leaves after the latency, in bytes of S (>= 1 KiB)."""
    rel_rms: float
    """Relative error of the fitted model over the large sizes."""
    intercept_s: float
    """The large-message fit's time at S = 0 (latency terms of the bandwidth protocol, launch included)."""
    peak_busbw_bytes_per_s: float
    """The largest measured busbw (nccl-tests definition)."""


def fit_collective(op: str, n: int, sizes: Sequence[float], seconds: Sequence[float]) -> CollectiveFit:
    """busbw, per-step latency and half-efficiency size of one collective from (S, t) pairs (S: nccl-tests'
    size, the full buffer). Sizes >= LARGE_MIN_BYTES give busbw and the intercept (weighted by 1/t^2),
    sizes <= SMALL_MAX_BYTES the latency; without small sizes the whole intercept is latency."""
    if n < 2:
        raise ValueError("fit_collective needs a group of 2 or more ranks")
    factor, steps = bus_factor(op, n), latency_steps(op, n)
    pairs = sorted(zip(sizes, seconds))
    large = [(s, t) for s, t in pairs if s >= LARGE_MIN_BYTES] or pairs[-2:]
    small = [(s, t) for s, t in pairs if s <= SMALL_MAX_BYTES]
    xs, ys = [s for s, _ in large], [t for _, t in large]
    a, b = linear_fit(xs, ys, [1.0 / (t * t) for t in ys], nonneg_intercept=True)
    peak = max(factor * s / t for s, t in pairs)
    if b <= 0:
        a, b = 0.0, factor / peak
    busbw = factor / b
    latency = min(t for _, t in small) / steps if small else a / steps
    half = max((a - steps * latency) / b, 1024.0)
    pred = [steps * latency + factor * (s + half) / busbw for s in xs]
    return CollectiveFit(op=op, n=n, busbw_bytes_per_s=busbw, latency_s=latency, half_bytes=half,
                         rel_rms=_rel_rms(pred, ys), intercept_s=a, peak_busbw_bytes_per_s=peak)


def attention_flops(b: int, heads: int, s: int, head_dim: int, causal: bool = True) -> float:
    """Forward FLOPs of attention: QK^T and AV, 4 x b x heads x s^2 x head_dim, halved when causal
    (the flash kernels skip masked tiles). Backward: 2.5x this (FlashAttention-2 sec. 3.1)."""
    f = 4.0 * b * heads * s * s * head_dim
    return f / 2 if causal else f


def _fraction(x: float) -> float:
    """A measured efficiency as the catalog accepts it: (0, 1], 4 significant digits."""
    return min(1.0, max(float(f"{x:.4g}"), 1e-4))


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def fit_gpu(meas: dict, peak_flops: float | None, hbm_bytes_per_s: float | None) -> tuple[dict, list[str]]:
    """The catalog GPU keys (YAML units) from a `measure_gpu` dict, and notes (clamped values).

    Without `peak_flops` the efficiencies are left out (the rates are still in `meas`); without
    `hbm_bytes_per_s` the measured bandwidth is taken as the peak (hbm_efficiency_fraction 1.0).
    """
    notes: list[str] = []
    keys: dict[str, float] = {}
    k_over = meas["launch"]["kernel_overhead_s"]
    mm = meas["matmul"]
    fit = fit_matmul([2.0 * m * n * k for m, n, k, _ in mm], [t for *_, t in mm], k_over)
    meas["matmul_fit"] = {"rate_flops": fit.rate_flops, "half_flop": fit.half_flop, "rel_rms": fit.rel_rms,
                          "points": fit.points}
    bw = max(meas["bandwidth"].values())
    if hbm_bytes_per_s:
        if bw > hbm_bytes_per_s:
            notes.append(f"measured bandwidth {bw / 1e9:.4g} GB/s is above the peak {hbm_bytes_per_s / 1e9:.4g} "
                         f"GB/s: hbm_efficiency_fraction clamped to 1")
        keys["hbm_efficiency_fraction"] = _fraction(bw / hbm_bytes_per_s)
    else:
        keys["hbm_efficiency_fraction"] = 1.0
    att = meas["attention"]
    if peak_flops:
        for key, rate in (("matmul_efficiency_fraction", fit.rate_flops),
                          ("attention_efficiency_fraction", max(a["fwd_flops"] / a["fwd_s"] for a in att)),
                          ("attention_backward_efficiency_fraction",
                           max(2.5 * a["fwd_flops"] / a["bwd_s"] for a in att))):
            if rate > peak_flops:
                notes.append(f"{key}: measured {rate / 1e12:.4g} TFLOP/s is above the peak "
                             f"{peak_flops / 1e12:.4g} TFLOP/s (check --peak-tflops): clamped to 1")
            keys[key] = _fraction(rate / peak_flops)
    keys["matmul_half_efficiency_gflop"] = max(_sig(fit.half_flop / 1e9), 1e-3)
    keys["kernel_overhead_us"] = _sig(k_over * 1e6)
    keys["host_op_us"] = _sig(meas["launch"]["host_op_s"] * 1e6)
    return keys, notes


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


# -- measurement (torch inside) --------------------------------------------------------------------

def check_device(device: str) -> None:
    """CalibrationError unless torch is installed and `device` ('cuda' or 'cpu') is usable here."""
    if device not in ("cuda", "cpu"):
        raise CalibrationError(f"--device={str(device)[:40]!r}: accepted: cuda, cpu")
    try:
        import torch
    except ImportError:
        raise CalibrationError("distplan calibrate needs torch: pip install 'distplan[validate]'") from None
    if device == "cuda" and not torch.cuda.is_available():
        why = "this torch has no CUDA" if torch.version.cuda is None and not getattr(torch.version, "hip", None) \
            else "no GPU is visible"
        raise CalibrationError(f"--device cuda: no GPU found ({why}, torch {torch.__version__}); "
                               f"accepted here: --device cpu (measures the CPU, to test the pipeline)")


class _Clock:
    """Times a callable on one device: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: str):
        import torch
        self.torch = torch
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def run(self, fn: Callable[[], Any], reps: int) -> float:
        """Seconds per call of `reps` back-to-back calls."""
        if self.cuda:
            start = self.torch.cuda.Event(enable_timing=True)
            end = self.torch.cuda.Event(enable_timing=True)
            self.sync()
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e-3 / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps

    def best(self, fn: Callable[[], Any], target_s: float, trials: int = 3, max_reps: int = 1000) -> float:
        """Fastest of `trials` timings of about `target_s` each, after one warm-up call."""
        fn()
        self.sync()
        one = self.run(fn, 1)
        reps = max(1, min(max_reps, int(target_s / max(one, 1e-7))))
        return min(self.run(fn, reps) for _ in range(trials))


def _dtype(device: str):
    """bf16 on a GPU that has it (fp16 on one without, e.g. V100, T4), fp32 on the CPU."""
    import torch
    if device != "cuda":
        return torch.float32
    try:
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # older torch: no including_emulation
        bf16 = torch.cuda.is_bf16_supported()
    return torch.bfloat16 if bf16 else torch.float16


def _dtype_name(device: str) -> str:
    import torch
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[_dtype(device)]


def measure_matmul(device: str, shapes: Sequence[tuple[int, int, int]], target_s: float = 0.02,
                   step: Callable[[str], None] | None = None) -> list[tuple[int, int, int, float]]:
    """(m, n, k, seconds) of `torch.matmul` of an (m, k) by a (k, n) matrix, bf16 on a GPU, fp32 on the CPU."""
    import torch
    clock, dt, out = _Clock(device), _dtype(device), []
    for m, n, k in shapes:
        if step:
            step(f"matmul {m}x{n}x{k}")
        a = torch.randn(m, k, device=device, dtype=dt)
        b = torch.randn(k, n, device=device, dtype=dt)
        c = torch.empty(m, n, device=device, dtype=dt)
        out.append((m, n, k, clock.best(lambda: torch.matmul(a, b, out=c), target_s)))
        del a, b, c
    return out


def measure_bandwidth(device: str, nbytes: int, target_s: float = 0.02,
                      step: Callable[[str], None] | None = None) -> dict[str, float]:
    """Bytes read + written per second: 'copy' (`Tensor.copy_`, 2 x nbytes) and 'add'
    (`torch.add(a, b, out=c)`, 3 x nbytes), fp32 tensors of `nbytes` each."""
    import torch
    clock, n = _Clock(device), max(1, nbytes // 4)
    a = torch.ones(n, device=device)
    b = torch.ones(n, device=device)
    c = torch.empty(n, device=device)
    if step:
        step("memory bandwidth: copy")
    t_copy = clock.best(lambda: c.copy_(a), target_s)
    if step:
        step("memory bandwidth: add")
    t_add = clock.best(lambda: torch.add(a, b, out=c), target_s)
    return {"copy": 2 * 4 * n / t_copy, "add": 3 * 4 * n / t_add}


def measure_attention(device: str, shapes: Sequence[tuple[int, int, int, int]], target_s: float = 0.02,
                      step: Callable[[str], None] | None = None) -> list[dict]:
    """Forward and backward seconds of causal `scaled_dot_product_attention` at (b, heads, s, head_dim),
    flash backend where it runs (else the default choice, said in 'backend'). Backward = (forward +
    backward) - forward, the forward run with gradients enabled as in training."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    clock, dt, out = _Clock(device), _dtype(device), []
    for b, h, s, d in shapes:
        if step:
            step(f"attention b={b} heads={h} s={s} d={d}")
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dt, requires_grad=True) for _ in range(3))
        g = torch.randn(b, h, s, d, device=device, dtype=dt)

        def fwd():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd():
            torch.autograd.grad(fwd(), (q, k, v), g)

        backend = "flash"
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                t_f = clock.best(fwd, target_s)
                t_fb = clock.best(fwd_bwd, target_s)
        except RuntimeError:  # no flash kernel for this device/dtype: the default choice
            backend = "default"
            t_f = clock.best(fwd, target_s)
            t_fb = clock.best(fwd_bwd, target_s)
        out.append({"b": b, "heads": h, "s": s, "head_dim": d, "backend": backend,
                    "fwd_flops": attention_flops(b, h, s, d), "fwd_s": t_f, "bwd_s": max(t_fb - t_f, 1e-9)})
        del q, k, v, g
    return out


def measure_launch(device: str, ops: int = 256, trials: int = 5,
                   step: Callable[[str], None] | None = None) -> dict[str, float]:
    """Per-op host time and per-kernel GPU time of tiny eager ops (`x = x * 1.0001` on one element).

    GPU: a `torch.cuda._sleep` kernel holds the GPU while the host queues `ops` tiny kernels, so CUDA
    events around them measure back-to-back kernels (no CUDA graph), and perf_counter around the loop the
    host's issue time. The sleep is doubled until it outlasts the issue. CPU: both are the op's time.
    The catalog's `host_op_us` comes from `measure_host_step` (a whole step's ops cost the host more than
    a loop of one tiny op); `calibrate` keeps this one's `kernel_overhead_s`.
    """
    import torch
    if step:
        step("launch overhead")
    x = torch.ones(1, device=device)
    if device != "cuda":
        def loop():
            y = x
            for _ in range(ops):
                y = y * 1.0001
        loop()
        per = min(_timeit(loop) for _ in range(trials)) / ops
        return {"kernel_overhead_s": per, "host_op_s": per}
    (x * 1.0001).sum().item()  # the kernels loaded, the allocator warm
    cycles, gpu_best, host_best = 1_000_000, math.inf, math.inf
    for _ in range(trials + 8):
        s0, s1, s2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize()
        h0 = time.perf_counter()
        s0.record()
        torch.cuda._sleep(cycles)
        s1.record()
        y = x
        h1 = time.perf_counter()
        for _ in range(ops):
            y = y * 1.0001
        h2 = time.perf_counter()
        s2.record()
        s2.synchronize()
        slept = s0.elapsed_time(s1) * 1e-3
        if slept < 1.5 * (h2 - h0):  # the GPU may have caught up with the host: sleep longer, again
            cycles *= 2
            continue
        gpu_best = min(gpu_best, s1.elapsed_time(s2) * 1e-3 / ops)
        host_best = min(host_best, (h2 - h1) / ops)
    if not math.isfinite(gpu_best):
        raise RuntimeError("launch overhead: the sleep kernel never outlasted the host's issue time")
    return {"kernel_overhead_s": gpu_best, "host_op_s": host_best}


HOST_STEP_MODEL = dict(layers=4, hidden=256, heads=4, kv_heads=2, ffn_hidden=704, vocab=2048, max_positions=128,
                       mlp="swiglu", norm="rmsnorm", position="rope", tie_embeddings=False, linear_bias=False,
                       qkv_bias=False, name="calibrate-host-step")
"""A Llama-style reference decoder small enough that its training step is host-bound on any GPU."""


def count_aten_ops(fn: Callable[[], Any]) -> tuple[Any, int]:
    """(fn's result, the ATen ops it dispatched), counted with a TorchDispatchMode: every op the
    dispatcher runs, views and reshapes included, as the planner's host floor counts them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.ops += func.namespace == "aten"
            return func(*args, **(kwargs or {}))

    with _Count():
        out = fn()
    return out, _Count.ops


def reference_step(shape: dict, device: str = "cpu", precision: str = "fp32", checkpointing: str = "none",
                   tokens: tuple[int, int] = (2, 32)) -> tuple[Callable[[], Any], Callable[[], Any], Callable[[], None]]:
    """The reference decoder (`shape`: ModelSpec fields) wrapped as the `single` probe runs it (foreach
    AdamW), after three warm-up steps: (forward -> loss, backward(loss), optimizer step + zero_grad)."""
    import torch


    from .model import Decoder
    from .wrap import wrap

    spec = ModelSpec(**shape)
    dev = torch.device(device)
    b, s = tokens
    train = dict(seq_len=s, micro_batch=b, grad_accum=1, precision=precision, optimizer="adamw",
                 optimizer_impl="foreach", checkpointing=checkpointing, attention="sdpa")
    torch.manual_seed(0)
    model, opt, ctx = wrap(Decoder(spec, "sdpa", checkpointing).to(dev), "single", train, 1, 1, dev)
    x = torch.randint(0, spec.vocab, (b, s), device=dev)
    y = torch.randint(0, spec.vocab, (b, s), device=dev)

    def forward():
        with ctx.autocast():
            return model(x, y)

    def optimizer():
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):  # optimizer state, the allocator's pools, lazy kernels
        forward().backward()
        optimizer()
    return forward, lambda loss: loss.backward(), optimizer


def measure_host_step(device: str, steps: int = 7, step: Callable[[str], None] | None = None) -> dict[str, float]:
    """Host time per dispatched ATen op of a whole eager training step, as the planner's host floor
    counts it (`planner.kernels.host_ops`, `optimizer_host_ops`): the reference decoder (HOST_STEP_MODEL,
    fp32, 2 x 128 tokens, foreach AdamW, no checkpointing) stepped `steps` times; one step's ATen ops
    counted (`count_aten_ops`), the median step timed without the counter. The GPU work of this model
    is a small fraction of its host time, so the step measures the host: Python, the dispatcher, autograd
    and the launches, which a tiny-op loop (`measure_launch`) undercounts."""
    import statistics

    import torch

    if step:
        step("host time per op (a host-bound training step)")
    forward, backward, optimizer = reference_step(HOST_STEP_MODEL, device, tokens=(2, 128))

    def one():
        backward(forward())
        optimizer()

    _, ops = count_aten_ops(one)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        one()
        sync()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"host_op_s": med / max(1, ops), "host_step_s": med, "host_step_ops": ops}


def _timeit(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _device_info(device: str) -> dict:
    import platform

    import torch
    info = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
            "hip": getattr(torch.version, "hip", None), "date": _dt.date.today().isoformat()}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(device_name=torch.cuda.get_device_name(0), memory_bytes=int(p.total_memory),
                    device_count=torch.cuda.device_count(), uuid=str(getattr(p, "uuid", "") or ""),
                    sm_count=int(p.multi_processor_count))
        try:
            info["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # no NCCL in this build (ROCm: RCCL reports the same way, or not)
            info["nccl"] = None
    else:
        name = platform.processor() or platform.machine() or "cpu"
        try:
            with open("/proc/cpuinfo") as fh:
                for line in fh:
                    if line.startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        try:
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            mem = 16 * 2**30
        info.update(device_name=f"CPU {name}", memory_bytes=int(mem), device_count=1, nccl=None)
    info["nccl_algo"] = os.environ.get("NCCL_ALGO")
    return info


def _nvml_peak_bandwidth(uuid: str) -> float | None:
    """Peak memory bandwidth from NVML: max memory clock x 2 (double data rate) x bus width / 8."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            u = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
            h = pynvml.nvmlDeviceGetHandleByUUID(u) if uuid else pynvml.nvmlDeviceGetHandleByIndex(0)
            mhz = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
            bits = pynvml.nvmlDeviceGetMemoryBusWidth(h)
        finally:
            pynvml.nvmlShutdown()
        return 2.0 * mhz * 1e6 * bits / 8 if mhz and bits else None
    except Exception:
        return None


# -- collectives: one process per rank ------------------------------------------------------------

def _free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_worker(rank: int, world: int, port: int, backend: str, sizes: list, ops: list,
                       algo: str | None, out_path: str) -> None:
    """One rank: init on 127.0.0.1, time each op at each size (max over ranks), rank 0 writes JSON."""
    if algo:
        os.environ["NCCL_ALGO"] = algo
    import datetime

    import torch
    import torch.distributed as dist
    kw = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        kw["device_id"] = dev
    else:
        dev = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), **kw)
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
    results: dict[str, Any] = {}
    try:
        for op in ops:
            rows, error = [], None
            for size in sizes:
                elems = max(world, (size // 4) // world * world)
                big = torch.ones(elems, device=dev)
                part = torch.ones(elems // world, device=dev)
                if op == "all_reduce":
                    fn = lambda: dist.all_reduce(big)  # noqa: E731
                elif op == "all_gather":
                    fn = lambda: dist.all_gather_into_tensor(big, part)  # noqa: E731
                else:
                    fn = lambda: dist.reduce_scatter_tensor(part, big)  # noqa: E731
                try:
                    for _ in range(3):
                        fn()
                except (RuntimeError, ValueError, NotImplementedError) as e:  # e.g. gloo without this op
                    error = " ".join(str(e).split())[:200]
                    break
                reps = max(3, min(100, int(2**27 // (elems * 4))))
                sync()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                sync()
                t = torch.tensor([(time.perf_counter() - t0) / reps], device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                rows.append([elems * 4, float(t.item())])
                del big, part
            results[op] = {"sizes": rows, "error": error}
    finally:
        if rank == 0:
            Path(out_path).write_text(json.dumps(results))
        dist.destroy_process_group()


def measure_collectives(device: str, world: int, sizes: Sequence[int], ops: Sequence[str] = COLLECTIVE_OPS,
                        algo: str | None = None, timeout_s: float = 300.0) -> dict:
    """{op: {"sizes": [[S, seconds], ...], "error": str|None}} over `world` spawned ranks on 127.0.0.1:
    NCCL on GPUs 0..world-1 ('cuda'), gloo on the CPU ('cpu'). `algo` sets NCCL_ALGO in the ranks."""
    import tempfile

    import torch.multiprocessing as mp
    backend = "nccl" if device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="distplan-calibrate-") as tmp:
        out_path = os.path.join(tmp, "collectives.json")
        ctx = mp.start_processes(_collective_worker, args=(world, _free_port(), backend, list(sizes), list(ops),
                                                           algo, out_path),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"collectives did not finish in {timeout_s:.0f} s")
        finally:
            for p in ctx.processes:  # only the ranks started here
                if p.is_alive():
                    p.terminate()
        return json.loads(Path(out_path).read_text())


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
    import yaml
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
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
