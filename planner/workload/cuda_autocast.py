"""CUDA's autocast policy applied to a trace that runs on fake CPU tensors (trace.py, the "cuda" target).

`torch.autocast("cuda")` disables itself where no GPU is present, and backward on fake "cuda" tensors asks
autograd's engine for a CUDA context; so a trace for a GPU runs on fake CPU tensors under the CPU's autocast
context (which carries the enabled flag and the lower-precision dtype, and which `torch.utils.checkpoint`
restores around a recomputation), while `cuda_autocast` casts each call's arguments by CUDA's lists
instead of the CPU's:

- the lists are those the installed torch registers for the `Autocast` (CUDA) dispatch key
  (`aten/src/ATen/autocast_mode.cpp`, `TORCH_LIBRARY_IMPL(aten, Autocast, m)`: the macros
  `AT_FORALL_LOWER_PRECISION_FP`, `AT_FORALL_FP32`, `AT_FORALL_FP32_SET_OPT_DTYPE`,
  `AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`, `AT_FORALL_PROMOTE` of `aten/src/ATen/autocast_mode.h`),
  read from the header the wheel installs (`torch/include/ATen/autocast_mode.h`), so the target follows the
  installed release; the CPU's (`TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)`) differ: on CUDA `pow`, `exp`,
  `rsqrt`, `softmax`, `log_softmax`, `layer_norm`, `rms_norm`, `sum`, ... run in fp32;
- each policy casts as the wrappers of `autocast_mode.h` do (`WrapFunction_`): `lower_precision_fp` and
  `fp32` cast every eligible tensor argument (`cached_cast`: floating point, not float64), `fp32_set_opt_dtype`
  sets the output dtype to fp32 where the first argument is eligible and no dtype was given,
  `fp32_append_dtype` (`norm`) the same, `promote` casts to the widest eligible dtype;
- lower-precision casts of fp32 leaves that require grad (the parameters) are cached until the outermost
  autocast region exits (`cached_cast` and `clear_cache`, autocast_mode.cpp; `torch.autocast.__exit__` calls
  `torch.clear_autocast_cache()`), so a weight used twice is cast once and its copy lives as long.

The casts are made at the Python surface (a TorchFunctionMode), above autograd as autocast's are ("Option 2"
of autocast_mode.h: casts recorded by autograd, inputs saved in the cast dtype), and the call then runs with
the CPU's autocast kernels excluded. A composite whose own aten calls CUDA casts (`cross_entropy` calls
`log_softmax` and `nll_loss`: `cross_entropy_loss`, aten/src/ATen/native/LossNLL.cpp) is cast as those are.
"""

from __future__ import annotations

import contextlib
import os
import re

POLICY_MACROS = {
    "lower_precision_fp": "AT_FORALL_LOWER_PRECISION_FP",
    "fp32": "AT_FORALL_FP32",
    "fp32_set_opt_dtype": "AT_FORALL_FP32_SET_OPT_DTYPE",
    "promote": "AT_FORALL_PROMOTE",
}
"""Each CUDA cast policy and the macro of `aten/src/ATen/autocast_mode.h` that lists its ops."""

COMPOSITE_POLICY = {"cross_entropy": "fp32"}
"""Python-surface composites whose internal aten ops CUDA casts: `F.cross_entropy` -> `cross_entropy_loss`
(on no CUDA list) -> `log_softmax` (fp32_set_opt_dtype) and `nll_loss` (fp32), LossNLL.cpp."""

_POLICIES: list = []
"""The installed torch's CUDA policy, {op name: policy}, read once (`cuda_policy`)."""


def _header_path(torch) -> str:
    return os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "autocast_mode.h")


def parse_policy(header_text: str) -> dict[str, str]:
    """{aten op name (no overload): CUDA cast policy} from the text of `autocast_mode.h`: each `#define
    AT_FORALL_...(_)` list's `_(op[, overload])` entries; `norm` (`AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`)
    is fp32_append_dtype."""
    policy: dict[str, str] = {}
    for name, macro in POLICY_MACROS.items():
        m = re.search(r"#define\s+" + macro + r"\(_\)(.*?)(?:\n\s*\n|#define|#else|#endif)", header_text, re.S)
        if not m:
            continue
        for op in re.findall(r"_\(\s*(\w+)", m.group(1)):
            policy.setdefault(op, name)
    if "AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE" in header_text and "ADD_NS(norm)" in header_text:
        policy.setdefault("norm", "fp32_append_dtype")
    return policy


def cuda_policy(torch) -> dict[str, str]:
    """The installed torch's CUDA autocast lists ({op: policy}, `parse_policy` of its header). Raises
    ValueError if the wheel holds no header to read."""
    if not _POLICIES:
        path = _header_path(torch)
        try:
            with open(path, encoding="utf-8") as f:
                policy = parse_policy(f.read())
        except OSError:
            policy = {}
        if not policy.get("linear") or not policy.get("pow"):
            raise ValueError(f"--device=cuda: found no CUDA autocast lists in {path} (the installed torch's "
                             f"aten/src/ATen/autocast_mode.h); use --device cpu")
        policy.update(COMPOSITE_POLICY)
        _POLICIES.append(policy)
    return _POLICIES[0]


def op_name(func) -> str:
    """The aten name of a Python-surface torch function: `Tensor.__rpow__` -> pow, `__matmul__` -> matmul."""
    name = getattr(func, "__name__", "") or ""
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith("r") and name[1:] in ("pow", "matmul"):
            name = name[1:]
    return name


class _Caster:
    """Casts arguments as autocast_mode.h's wrappers do, with `cached_cast`'s cache."""

    def __init__(self, torch, lower):
        self.torch, self.lower = torch, lower
        self.cache: dict = {}

    def eligible(self, t) -> bool:
        """`is_eligible` (autocast_mode.h): a floating-point tensor, not float64."""
        torch = self.torch
        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64

    def cast(self, t, dtype):
        """`cached_cast(to_type, arg)`: lower-precision casts of fp32 leaves that require grad are cached."""
        if not self.eligible(t) or t.dtype == dtype:
            return t
        torch = self.torch
        cacheable = (dtype == self.lower and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
                     and not t._is_view() and torch.is_autocast_cache_enabled())
        if not cacheable:
            return t.to(dtype)
        hit = self.cache.get(id(t))
        if hit is None or hit[0] is not t:
            hit = self.cache[id(t)] = (t, t.to(dtype))
        return hit[1]

    def cast_all(self, args, kwargs, dtype) -> tuple:
        """Every argument cast, the last first: the wrappers call `(*F)(cached_cast(to_type, args,
        device_type)...)`, whose arguments GCC (PyTorch's Linux wheels) evaluates right to left; the order
        of the casts is the order of their ToCopyBackward nodes, hence of the gradients' accumulation, which
        DDP's buckets follow (the H100 module records' collectives, tests/test_gpu_results.py, match it)."""
        def one(a):
            if isinstance(a, (list, tuple)) and any(isinstance(x, self.torch.Tensor) for x in a):
                return type(a)(reversed([one(x) for x in reversed(a)]))
            return self.cast(a, dtype)
        new_kwargs = {k: one(kwargs[k]) for k in reversed(list(kwargs))}
        new_args = [one(a) for a in reversed(args)]
        return tuple(reversed(new_args)), {k: new_kwargs[k] for k in kwargs}

    def widest(self, args, kwargs):
        """`promote_type` (autocast_mode.h): the widest dtype of the eligible arguments, from the lower one."""
        dtype = self.lower
        for a in list(args) + list(kwargs.values()):
            if self.eligible(a):
                dtype = self.torch.promote_types(dtype, a.dtype)
        return dtype


def _first_tensor(args):
    return args[0] if args else None


def _with_policy(caster: _Caster, policy: str, args: tuple, kwargs: dict) -> tuple:
    """(args, kwargs) as CUDA's wrapper for `policy` passes them on (autocast_mode.h `WrapFunction_`)."""
    torch = caster.torch
    if policy == "lower_precision_fp":
        return caster.cast_all(args, kwargs, caster.lower)
    if policy == "fp32":
        return caster.cast_all(args, kwargs, torch.float32)
    if policy == "promote":
        return caster.cast_all(args, kwargs, caster.widest(args, kwargs))
    # fp32_set_opt_dtype / fp32_append_dtype: an explicit dtype is respected
    given = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)
    if caster.eligible(_first_tensor(args)) and not given:
        kwargs = dict(kwargs, dtype=torch.float32)
    return args, kwargs


@contextlib.contextmanager
def cuda_autocast(torch):
    """While active, calls under the CPU's autocast context are cast by CUDA's policy (module docstring)."""
    from torch.overrides import TorchFunctionMode
    policy = cuda_policy(torch)
    no_cpu_autocast = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    casters: dict = {}

    class CudaAutocast(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not torch.is_autocast_enabled("cpu"):
                return func(*args, **kwargs)
            lower = torch.get_autocast_dtype("cpu")
            caster = casters.get(lower) or casters.setdefault(lower, _Caster(torch, lower))
            rule = policy.get(op_name(func))
            if rule is not None:
                args, kwargs = _with_policy(caster, rule, args, kwargs)
            with torch._C._ExcludeDispatchKeyGuard(no_cpu_autocast):
                return func(*args, **kwargs)

    clear = torch.clear_autocast_cache

    def clear_both():
        for c in casters.values():
            c.cache.clear()
        clear()

    torch.clear_autocast_cache = clear_both
    try:
        with CudaAutocast():
            yield
    finally:
        torch.clear_autocast_cache = clear
        casters.clear()
