"""The analytic formulas planned for CUDA (`activations_in(train, regime, "cuda")`, planner/kernel_rules.py) against
the trace's CUDA target (`profile_hf(..., device="cuda")`: fake tensors run under CUDA's autocast lists, SDPA's
CUDA backend and fused dropout, planner/workload/trace_modes.py `_cuda_kernels`): the twin of
tests/test_analytic_vs_trace.py (the CPU target), per decoder layer and outside the layers, byte for byte, for
every model type the analytic front end reads, fp32, pure bf16 (FSDP's mixed precision) and bf16 autocast
(DDP's); then the whole step's peak allocated of the two front ends over the strategies and checkpointing."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from distplan.planner.module_plan import module_spec_plan  # noqa: E402
from distplan.planner.module_twin import analytic_twins  # noqa: E402

from test_analytic_vs_trace import DTYPES, EXAMPLES, MODEL_TYPES, VARIANTS, _compare  # noqa: E402

GAPS: dict = {}
"""(model type, dtype) -> why the CUDA trace and the formulas still differ (strict xfail, measured numbers)."""
FAST = {("gpt2", "float32"), ("gpt2", "bfloat16"), ("gpt2", "autocast-bfloat16"), ("phi3", "float32"),
        ("llama", "autocast-bfloat16")}
"""The fast tier's cases: every CUDA rule (GPT-2: the fused dropout's bool masks, LayerNorm's fp32 statistics,
gelu_new's fp32 pow under autocast; Phi-3 in fp32: the memory-efficient kernel's output layout; Llama under
autocast: flash with grouped K/V heads); the other model types, slow."""


def _cuda_compare(path, micro_batch: int, seq_len: int, dtype: str,
                  attention: str = "sdpa") -> tuple[tuple[int, int], tuple[int, int]]:
    """tests/test_analytic_vs_trace.py `_compare`, both front ends planned for CUDA."""
    return _compare(path, micro_batch, seq_len, dtype, attention, device="cuda")


def _case(model_type: str, dtype: str, slow: bool = False):
    marks = [pytest.mark.slow] if slow or (model_type, dtype) not in FAST else []
    if (model_type, dtype) in GAPS:
        marks.append(pytest.mark.xfail(strict=True, reason=GAPS[model_type, dtype]))
    return pytest.param(model_type, dtype, marks=marks, id=f"{model_type}-{dtype}")


# 2 x 64 tokens (every code path); 1 x 100 (one sequence, no multiple of 32: the memory-efficient kernel's
# log-sum-exp rounded up), slow
@pytest.mark.parametrize("model_type, dtype", [_case(t, d) for t in MODEL_TYPES for d in sorted(DTYPES)])
def test_cuda_analytic_equals_trace(model_type, dtype):
    (t_blk, a_blk), (t_out, a_out) = _cuda_compare(EXAMPLES / f"{model_type}-8l.json", 2, 64, dtype)
    print(f"{model_type}/{dtype}: layer {t_blk} vs {a_blk}, outside {t_out} vs {a_out}")
    assert (a_blk, a_out) == (t_blk, t_out)


@pytest.mark.slow
@pytest.mark.parametrize("model_type, dtype", [_case(t, d) for t in MODEL_TYPES for d in sorted(DTYPES)])
def test_cuda_analytic_equals_trace_one_sequence(model_type, dtype):
    (t_blk, a_blk), (t_out, a_out) = _cuda_compare(EXAMPLES / f"{model_type}-8l.json", 1, 100, dtype)
    assert (a_blk, a_out) == (t_blk, t_out)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("model_type", ("llama", "gpt2", "qwen2", "mistral", "phi3", "qwen3"))
def test_cuda_eager_attention_equals_trace(model_type, dtype):
    if (model_type, dtype) in GAPS:
        pytest.xfail(GAPS[model_type, dtype])
    (t_blk, a_blk), (t_out, a_out) = _cuda_compare(EXAMPLES / f"{model_type}-8l.json", 2, 64, dtype, "eager")
    assert (a_blk, a_out) == (t_blk, t_out)


@pytest.mark.slow
@pytest.mark.parametrize("point", ((2, 64), (1, 100)), ids=["b2s64", "b1s100"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cuda_config_variants(tmp_path, variant, point):
    """The config variants that take other code paths (tests/test_analytic_vs_trace.py VARIANTS) on CUDA: a
    materialized mask sends 16-bit SDPA to the memory-efficient kernel (at 100 tokens its rows padded to 104:
    kernel_rules.sdpa_mask_bytes), attention dropout stays in the fused kernel (the CPU's runs the math
    composite), dropout masks are bools."""
    base, changes, dtype = VARIANTS[variant]
    cfg = json.loads((EXAMPLES / f"{base}-8l.json").read_text()) | changes
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    (t_blk, a_blk), (t_out, a_out) = _cuda_compare(path, *point, dtype)
    assert (a_blk, a_out) == (t_blk, t_out)


STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op")
GRID_GAPS = {
    ("gpt2", "fp32", "full"): (
        "not a CUDA rule (the CPU target's walk has the same bytes): a checkpointed GPT-2 block's backward, "
        "gelu_new's chain keeps about one more n x f tensor than block_backward.py's GELU instant; the formulas "
        "-1,049,596 B under the trace (measured: zero1 -0.59%, zero2 -0.82%, zero3 -0.93%, fsdp -0.96%)"),
    ("gpt2", "bf16-mixed", "full"): (
        "as gpt2 fp32 full: zero1 -1,044,476 B (-0.59%), zero3 -524,796 B (-0.53%), the other strategies exact"),
    ("gemma2", "fp32", "full"): (
        "not a CUDA rule (the CPU target's walk reads the same bytes): Gemma-2 with full checkpointing, the "
        "formulas +625,920 B over the trace under zero3 (+0.58%) and fsdp (+0.60%), zero1 +334,592 B (+0.20%)"),
    ("gpt2", "fp32", "every-2"): (
        "GPT-2's checkpointed blocks again (gelu_new's backward): zero3 -881,276 B (-0.66%), the other strategies "
        "within 0.001%; the CPU target's walk is under there too (-684,668 B, -0.84%)"),
}
"""(model type, precision, checkpointing) -> why the whole step's peaks differ by more than 0.5% (strict xfail)."""


def _grid_case(model_type: str, precision: str, checkpointing: str, slow: bool = True):
    marks = [pytest.mark.slow] if slow else []
    if (model_type, precision, checkpointing) in GRID_GAPS:
        marks.append(pytest.mark.xfail(strict=True, reason=GRID_GAPS[model_type, precision, checkpointing]))
    return pytest.param(model_type, precision, checkpointing, marks=marks,
                        id=f"{model_type}-{precision}-{checkpointing}")


GRID = [_grid_case(t, p, c, slow=(t, p, c) != ("gpt2", "bf16-mixed", "none"))
        for t in MODEL_TYPES for p in ("fp32", "bf16-mixed") for c in ("none", "full", "every-2")]


@pytest.mark.parametrize("model_type, precision, checkpointing", GRID)
def test_cuda_step_peak_trace_vs_formulas(model_type, precision, checkpointing):
    """`estimate --hf-config` planned for CUDA by the trace front end against the analytic front end's twin of
    the same run (module_twin.analytic_twins, `--front-end analytic --device cuda`): the whole step's peak
    allocated within 0.5% for every strategy (8 H100s, 1 x 256 tokens), without checkpointing, with full
    checkpointing and every 2nd layer's (transformers' models have no op-level selective checkpointing in the
    formulas). Measured 2026-12-06 (torch 2.13 CPU), 7 model types x 2 precisions x 6 strategies per
    checkpointing: without it 84 of 84 cells within 0.5% (82 within 0.002%; Phi-3's ZeRO-1 +0.16%); with full
    or every-2 checkpointing 158 of 168 (the 10 others in GRID_GAPS, none from a CUDA rule)."""
    kw = dict(hf_config=str(EXAMPLES / f"{model_type}-8l.json"), seq_len=256, micro_batch=1, precision=precision,
              activation_checkpointing=checkpointing)
    p = module_spec_plan(dict(kw, gpus=8, gpu="h100-sxm", detect_local=False), STRATEGIES)
    twin, why = analytic_twins(kw, p.cluster)
    assert why is None
    errs = {r.name: round(100 * (twin(r.name, 1).peak_allocated / r.memory.peak_allocated - 1), 3) for r in p.results}
    print(model_type, precision, checkpointing, errs)
    assert set(errs) == set(STRATEGIES)
    assert all(abs(e) <= 0.5 for e in errs.values()), errs


def test_kernel_rules_by_device():
    """The device rules themselves (planner/kernel_rules.py), where CUDA and the CPU part."""
    from distplan.planner.kernel_rules import (dropout_elem, gelu_new_elem_bytes, layer_norm_stat_bytes,
                                               logsumexp_bytes, sdpa_backend, sdpa_mask_bytes)
    assert (dropout_elem("cuda", 2), dropout_elem("cpu", 2)) == (1, 2)
    assert (layer_norm_stat_bytes("cuda", 2), layer_norm_stat_bytes("cpu", 2)) == (4, 2)
    # sdp_utils.cpp: flash for 16-bit without a mask (grouped K/V allowed), efficient for fp32 or a mask unless
    # grouped, math otherwise; the CPU's flash kernel unless dropout
    assert sdpa_backend("cuda", True, False, True, True, 128) == "flash"
    assert sdpa_backend("cuda", True, True, False, False, 128) == "efficient"
    assert sdpa_backend("cuda", False, False, False, False, 128) == "efficient"
    assert sdpa_backend("cuda", False, False, True, False, 128) == "math"
    assert sdpa_backend("cuda", True, False, False, False, 512) == "efficient"
    assert (sdpa_backend("cpu", False, False, True, False, 64), sdpa_backend("cpu", True, False, False, True, 64)) \
        == ("flash", "math")
    assert logsumexp_bytes("cuda", "efficient", 2, 4, 100) == 2 * 4 * 128 * 4
    assert logsumexp_bytes("cuda", "flash", 2, 4, 100) == logsumexp_bytes("cpu", "efficient", 2, 4, 100) == 2 * 4 * 100 * 4
    assert sdpa_mask_bytes("cuda", "efficient", 1, 100, 2) == 100 * 104 * 2
    assert sdpa_mask_bytes("cuda", "efficient", 1, 96, 2) == 96 * 96 * 2  # aligned rows: no padding
    assert sdpa_mask_bytes("cpu", "flash", 1, 100, 2) == 100 * 100 * 2
    assert sum(gelu_new_elem_bytes("cuda", "autocast")) == 16 and gelu_new_elem_bytes("cpu", "autocast") == [2] * 5
    assert gelu_new_elem_bytes("cuda", "fp32") == [4] * 5 and gelu_new_elem_bytes("cuda", "lowp") == [2] * 5
