"""The contexts a trace runs the model under (planner/workload/trace.py): fake-tensor errors kept quiet,
CUDA's kernels where the CPU's keep other tensors (`KERNEL_DEVICES`), and the grouped GEMM's Meta kernel
taking every dtype while a trace runs."""

from __future__ import annotations

import contextlib
import warnings

from .cuda_autocast import cuda_autocast
from .cuda_fused import cuda_functions


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """A kernel that rejects its fake inputs (e.g. `_grouped_mm` in fp32) is also logged at ERROR, with its
    traceback, by torch's fake-tensor dispatch (`torch/_subclasses/fake_tensor.py`); the trace reports the
    failure in one line itself, so that log is silenced while the model runs."""
    import logging
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


KERNEL_DEVICES = ("cpu", "cuda")
"""Whose kernels a trace keeps the bytes of (`device` of `profile`). The trace always runs on the CPU, on fake
tensors; "cuda" makes the two calls whose CPU kernel saves other tensors than CUDA's run as on a GPU
(`_cuda_kernels`), so a plan for GPUs is the trace of what a GPU keeps."""


@contextlib.contextmanager
def _cuda_kernels(torch, autocast: bool = False):
    """While tracing for a GPU, the choices where CPU and CUDA kernels keep different tensors (`autocast`:
    under autocast, CUDA's cast lists instead of the CPU's: cuda_autocast.py), and the two kernels:

    - `scaled_dot_product_attention`: CUDA picks flash (16-bit, no mask, head_dim <= 256, grouped KV heads
      allowed) or memory-efficient attention (any dtype and a mask, but no grouped KV heads:
      `check_batch_size_and_num_heads_dense<false>` in `can_use_mem_efficient_attention`,
      aten/src/ATen/native/transformers/cuda/sdp_utils.cpp), else the math composite. A fused kernel keeps
      its output and log-sum-exp (and, with dropout, the RNG seed and offset), never the probabilities:
      CPU's flash kernel keeps the same but takes no dropout, where the CPU would run the math composite
      and keep the probabilities and the dropout mask; so the trace runs it without dropout. Where CUDA
      runs the math composite (fp32 with grouped KV heads, which transformers passes as `enable_gqa`), the
      trace runs that composite too (`sdpa_kernel(MATH)`), keeping what CUDA keeps.
    - `dropout` (`nn.Dropout`, `F.dropout`): CUDA's fused `native_dropout` keeps a bool mask; the CPU's
      composite keeps the scaled mask in the input's dtype. The trace calls `native_dropout`.

    Where CUDA picks the memory-efficient kernel (fp32, or a mask), the trace runs it as its aten op
    (cuda_fused.py: its output's layout and its log-sum-exp rounded up to 32 tokens, as CUDA keeps them).
    - `layer_norm` on 16-bit inputs (outside autocast, which casts them to fp32 on CUDA): CUDA keeps the
      statistics in fp32 (cuda_fused.py)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional
    sdpa, dropout, layer_norm = F.scaled_dot_product_attention, F.dropout, F.layer_norm
    lowp = (torch.float16, torch.bfloat16)
    efficient, layer_norm_16 = cuda_functions(torch)

    def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        grouped = bool(enable_gqa) and query.size(-3) != key.size(-3)
        # under autocast (CPU's context carries CUDA's: cuda_autocast.py), CUDA casts SDPA's inputs to the
        # 16-bit dtype (`scaled_dot_product_attention` is in autocast_mode.h's AT_FORALL_LOWER_PRECISION_FP)
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
        flash = dtype in lowp and attn_mask is None and query.size(-1) <= 256
        if grouped and not flash:  # no fused CUDA kernel takes it: the math composite, as on a GPU
            with sdpa_kernel([SDPBackend.MATH]):
                return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        if not flash:  # CUDA's memory-efficient kernel, with the inputs autocast casts and the mask as a bias
            if dtype != query.dtype or dtype != key.dtype or dtype != value.dtype:
                query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
            return efficient(query, key, value, _attn_bias(torch, attn_mask, query, key), dropout_p, is_causal,
                             scale)
        return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    def cuda_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
        if input.dtype in lowp and not torch.is_autocast_enabled("cpu"):
            return layer_norm_16(input, list(normalized_shape), weight, bias, eps)
        return layer_norm(input, normalized_shape, weight, bias, eps)

    def cuda_dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return input
        return torch.native_dropout(input, p, True)[0]

    F.scaled_dot_product_attention, F.dropout, F.layer_norm = cuda_sdpa, cuda_dropout, cuda_layer_norm
    try:
        with cuda_autocast(torch) if autocast else contextlib.nullcontext():
            yield
    finally:
        F.scaled_dot_product_attention, F.dropout, F.layer_norm = sdpa, dropout, layer_norm


def _attn_bias(torch, mask, query, key):
    """The mask as CUDA's SDPA hands it to the memory-efficient kernel (aten/src/ATen/native/transformers/
    attention.cpp `scaled_dot_product_attention`): a bool mask converted to q's dtype (`convert_boolean_attn_mask`:
    `at::where(attn_mask, 0.0, -inf)`), padded to rows of a multiple of 8 elements and sliced back where they are
    not (`preprocess_mask`, `pad_bias<8>`), then expanded to (B, heads, S, S_k)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, torch.full((), float("-inf"), dtype=query.dtype))
    if mask.stride(-1) != 1 or any(st % 8 for st in mask.stride()[:-1]):
        last = mask.size(-1)
        mask = torch.nn.functional.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


_TRACING = [0]
"""How many traces are running (`_grouped_mm_any_dtype`): while one is, the grouped GEMM's Meta kernel takes
every dtype its device kernels take."""
_GROUPED_MM_META: list = []
"""The Library that holds the grouped GEMM's Meta kernel (`_grouped_mm_any_dtype`): registered once per process."""


@contextlib.contextmanager
def _grouped_mm_any_dtype(torch):
    """While tracing: the grouped GEMM of a MoE's experts (`aten._grouped_mm`, transformers' `grouped_mm`
    experts implementation) in the dtype of its inputs, as its device kernels run it. The CPU kernel loops
    over the groups in any dtype (`_grouped_mm`, aten/src/ATen/native/Blas.cpp: `_grouped_mm_fallback`); CUDA's
    (`_grouped_mm_cuda`, aten/src/ATen/native/cuda/GroupedBlas.cpp) takes its CUTLASS fast path for bf16
    inputs on sm90/sm100 and `_grouped_mm_fallback` (mm/bmm per group) for every other dtype. So fp32 runs
    on both: an fp32 plan, and DDP's autocast, where transformers casts the experts' input to the fp32
    weight's dtype (`integrations/moe.py` `_grouped_mm`: the op is on no autocast list). But the meta
    function of torch 2.13 (`_meta_grouped_mm_common`, torch/_meta_registrations.py) refuses anything but
    bf16, so a fake-tensor trace would fail where the run does not (torch 2.15's takes fp32). During a trace
    the Meta kernel takes the inputs' dtype (the kernels' output dtype) with the meta's shape rules; outside
    one it is torch's own. The kernel is registered once per process and reads `_TRACING` (with torch 2.13 a
    registration removed again by `Library._destroy` restored direct meta calls, but fake tensors kept
    running the removed kernel), and FakeTensorMode's dispatch cache, which every trace of the process
    shares, is cleared on the way in and out so that no result of one rule stands in for the other."""
    try:
        from torch._meta_registrations import meta_grouped_mm
    except ImportError:
        yield
        return
    if not _GROUPED_MM_META:
        bf16 = torch.bfloat16

        def grouped_mm_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
            if not _TRACING[0] or (mat_a.dtype == bf16 and mat_b.dtype == bf16):
                return meta_grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
            out = meta_grouped_mm(mat_a.to(bf16), mat_b.to(bf16), offs=offs, bias=bias)
            return out.to(out_dtype or torch.promote_types(mat_a.dtype, mat_b.dtype))

        try:
            lib = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
                lib.impl("_grouped_mm", grouped_mm_meta, "Meta")
            _GROUPED_MM_META.append(lib)
        except (AttributeError, RuntimeError, ValueError):
            _GROUPED_MM_META.append(None)  # not this torch's op: traced as torch has it

    def forget_cached_results():
        mode = getattr(getattr(torch._subclasses, "fake_tensor", None), "FakeTensorMode", None)
        if mode is not None and hasattr(mode, "cache_clear"):
            mode.cache_clear()

    forget_cached_results()
    _TRACING[0] += 1
    try:
        yield
    finally:
        _TRACING[0] -= 1
        forget_cached_results()
