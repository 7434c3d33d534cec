"""`distplan calibrate`'s fits of the measurements to the catalog's keys: pure arithmetic, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from distplan.planner.comm import bus_factor as _bf, latency_steps as _ls

MIB = 2**20
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
