"""The CUDA target of the trace (issue 60): CUDA's autocast lists applied to fake CPU tensors
(planner/workload/cuda_autocast.py), the `--device` flag and PyTorch's optimizer default per target."""

from __future__ import annotations

import contextlib
import json

import pytest
from click.testing import CliRunner

from distplan.planner.cli import main
from distplan.planner.front_end import check_flags, default_optimizer_impl, planned_device
from distplan.planner.workload.cuda_autocast import cuda_autocast, cuda_policy, op_name, parse_policy

torch = pytest.importorskip("torch")


def test_policy_is_the_installed_torchs_cuda_lists():
    p = cuda_policy(torch)
    for op in ("pow", "exp", "rsqrt", "layer_norm", "rms_norm", "nll_loss", "mse_loss"):
        assert p[op] == "fp32", op
    for op in ("softmax", "log_softmax", "sum", "cumsum"):
        assert p[op] == "fp32_set_opt_dtype", op
    for op in ("linear", "matmul", "mm", "bmm", "scaled_dot_product_attention", "einsum"):
        assert p[op] == "lower_precision_fp", op
    assert p["addcmul"] == "promote" and p["norm"] == "fp32_append_dtype"
    assert "silu" not in p and "mul" not in p and "embedding" not in p  # run in their inputs' dtype


def test_parse_policy_reads_each_macro():
    text = ("#define AT_FORALL_LOWER_PRECISION_FP(_) \\\n  _(linear) \\\n  _(conv_transpose2d, input)\n\n"
            "#define AT_FORALL_FP32(_) \\\n  _(pow, Tensor_Scalar) \\\n  _(exp)\n\n"
            "#define AT_FORALL_FP32_SET_OPT_DTYPE(_) \\\n  _(softmax, int)\n\n"
            "#define AT_FORALL_PROMOTE(_) \\\n  _(addcdiv)\n#else\n")
    assert parse_policy(text) == {"linear": "lower_precision_fp", "conv_transpose2d": "lower_precision_fp",
                                  "pow": "fp32", "exp": "fp32", "softmax": "fp32_set_opt_dtype",
                                  "addcdiv": "promote"}


def test_op_names_of_operators():
    assert op_name(torch.Tensor.__pow__) == "pow" and op_name(torch.Tensor.__rpow__) == "pow"
    assert op_name(torch.Tensor.__matmul__) == "matmul" and op_name(torch.Tensor.__rmatmul__) == "matmul"
    assert op_name(torch.nn.functional.linear) == "linear"


def _dtypes(cuda: bool) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    F = torch.nn.functional
    with FakeTensorMode():
        w = torch.nn.Parameter(torch.randn(8, 8))
        x = torch.randn(4, 8)
        with cuda_autocast(torch) if cuda else contextlib.nullcontext(), torch.autocast("cpu", dtype=torch.bfloat16):
            y = F.linear(x, w)
            out = {"linear": y, "pow": y.pow(2), "**": y ** 3, "exp": y.exp(), "rsqrt": torch.rsqrt(y),
                   "softmax": F.softmax(y, -1), "log_softmax": torch.log_softmax(y, -1),
                   "layer_norm": F.layer_norm(y, (8,)), "sum": y.sum(), "silu": F.silu(y),
                   "softmax_bf16_asked": F.softmax(y, -1, dtype=torch.bfloat16),
                   "int_cumsum": torch.ones(4, dtype=torch.long).cumsum(0),
                   "cross_entropy": F.cross_entropy(y, torch.zeros(4, dtype=torch.long))}
            with torch.autocast("cpu", enabled=False):  # (transformers' rotary tables: autocast off)
                out["pow_autocast_off"] = y.pow(2)
        (out["pow"].sum() + out["layer_norm"].sum()).backward()  # the casts are autograd's
        return {k: v.dtype for k, v in out.items()}


def test_cuda_autocast_casts_as_cuda_does():
    f32, bf16 = torch.float32, torch.bfloat16
    got = _dtypes(cuda=True)
    assert got["linear"] == bf16 and got["silu"] == bf16 and got["pow_autocast_off"] == bf16
    for op in ("pow", "**", "exp", "rsqrt", "softmax", "log_softmax", "layer_norm", "sum", "cross_entropy"):
        assert got[op] == f32, op
    assert got["softmax_bf16_asked"] == bf16  # an explicit dtype is respected (fp32_set_opt_dtype)
    assert got["int_cumsum"] == torch.long  # not eligible: integers


def test_cpu_autocast_unchanged_outside_the_cuda_target():
    got = _dtypes(cuda=False)
    assert got["pow"] == torch.bfloat16 and got["layer_norm"] == torch.bfloat16  # the CPU's lists
    assert torch.clear_autocast_cache.__name__ == "clear_autocast_cache"  # restored after a CUDA trace


def test_device_default_and_optimizer_default():
    assert planned_device({}) == "cuda" and planned_device({"device": "cpu"}) == "cpu"
    with pytest.raises(ValueError, match=r"^--device='tpu': accepted values are cuda, cpu$"):
        planned_device({"device": "tpu"})
    assert default_optimizer_impl("cuda") == "foreach" and default_optimizer_impl("cpu") == "for-loop"
    kw = {"device": "cpu", "module": "pkg.mod:factory"}
    check_flags(kw)
    assert kw["optimizer_impl"] == "for-loop"
    kw = {}
    check_flags(kw)
    assert kw["optimizer_impl"] == "foreach"


def test_cli_device_flag():
    r = CliRunner().invoke(main, ["estimate", "--model", "llama3-8b", "--gpus", "8", "--device", "tpu"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == ["Error: Invalid value for '--device': 'tpu' is not one of 'cuda', 'cpu'."]
    r = CliRunner().invoke(main, ["estimate", "--model", "llama3-8b", "--gpus", "8", "--device", "cpu"])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "--device=cpu" in r.output
    r = CliRunner().invoke(main, ["estimate", "--model", "llama3-8b", "--gpus", "8"])
    assert r.exit_code == 0 and "target: cuda" in r.output
    r = CliRunner().invoke(main, ["estimate", "--model", "llama3-8b", "--gpus", "8", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["inputs"]["device"] == "cuda"
