"""Where a device's kernels keep other tensors than another's: the one place the activation formulas
(planner/activations.py, activations_attention.py) and the allocation writers (block_trace.py) ask, keyed on the
planned device ("cuda" or "cpu"; planner/front_end.py `planned_device`). Each rule cites the PyTorch source it
follows; the trace's CUDA target (planner/workload/trace_modes.py `_cuda_kernels`, cuda_autocast.py) runs the
same choices on fake tensors, and tests/test_analytic_vs_trace_cuda.py checks the two agree.

- dropout: CUDA's fused `native_dropout` keeps a bool mask, the CPU's `_dropout_impl` the scaled noise
  (`dropout_elem`);
- LayerNorm's saved mean and rstd: fp32 on CUDA, the input's dtype on the CPU (`layer_norm_stat_bytes`);
- SDPA's backend: flash, memory-efficient or the math composite (`sdpa_backend`), and the log-sum-exp the
  fused kernels keep (`logsumexp_bytes`);
- autocast's lists: on CUDA `pow` runs in fp32 (autocast_mode.h `AT_FORALL_FP32`), on the CPU in 16 bits,
  which changes what GPT-2's written-out GELU keeps (`gelu_new_elem_bytes`).
"""

from __future__ import annotations

DEVICES = ("cuda", "cpu")


def dropout_elem(device: str, elem: int) -> int:
    """Bytes per element a dropout keeps: CUDA's fused `native_dropout` a bool mask, CPU's
    `_dropout_impl` the scaled noise in the input's dtype (aten/src/ATen/native/Dropout.cpp,
    `is_fused_kernel_acceptable`: CUDA inputs only)."""
    return 1 if device == "cuda" else elem


def layer_norm_stat_bytes(device: str, elem: int) -> int:
    """Bytes per token of each of `native_layer_norm`'s saved statistics (mean, rstd): CUDA's are in the
    accumulate type, fp32 for 16-bit inputs (aten/src/ATen/native/cuda/layer_norm_kernel.cu
    `layer_norm_cuda`: `at::empty({M}, X->options().dtype(acc_type))`); the CPU's in the input's dtype
    (aten/src/ATen/native/layer_norm.cpp `layer_norm_cpu`: `at::empty({M}, X->options())`)."""
    return 4 if device == "cuda" else elem


def sdpa_backend(device: str, low_precision: bool, mask: bool, grouped: bool, dropout: bool,
                 head_dim: int) -> str:
    """'flash', 'efficient' or 'math': the kernel `scaled_dot_product_attention` runs for a call with these
    properties (`low_precision`: 16-bit inputs; `grouped`: `enable_gqa` with fewer K/V heads than q heads).

    CUDA (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp `select_sdp_backend`, flash tried first):
    FlashAttention-2 takes fp16/bf16 only (`check_tensor_dtype` with `flash_dtypes`), no attention mask
    (`check_for_attn_mask`) and head_dim <= 256 (`check_head_dim_size_flash`), grouped K/V heads and dropout
    allowed; the memory-efficient kernel takes fp32 and a mask but not grouped K/V heads
    (`check_batch_size_and_num_heads_dense<false>` in `can_use_mem_efficient_attention`); else the math
    composite. The CPU (aten/src/ATen/native/transformers/sdp_utils_cpp.cpp `select_sdp_backend_cpp`):
    its flash kernel, except with dropout, measured (torch 2.13) to run the math composite."""
    if device != "cuda":
        return "math" if dropout else "flash"
    if low_precision and not mask and head_dim <= 256:
        return "flash"
    return "math" if grouped else "efficient"


def logsumexp_bytes(device: str, backend: str, batch: int, heads: int, seq: int) -> int:
    """The fp32 log-sum-exp a fused SDPA kernel keeps for backward. Flash: (B, heads, S)
    (flash_attn/flash_api.cpp `mha_fwd`: `softmax_lse` of `{batch_size, num_heads, seqlen_q}`, kFloat; the
    CPU's flash kernel the same). CUDA's memory-efficient kernel: its last dimension rounded up to a multiple
    of 32 (transformers/cuda/attention.cu `_efficient_attention_forward`: `ceil_div(max_seqlen_q, 32) * 32`;
    the meta function `meta__scaled_dot_product_efficient_attention`, torch/_meta_registrations.py, too)."""
    s = -(-seq // 32) * 32 if device == "cuda" and backend == "efficient" else seq
    return batch * heads * s * 4


def sdpa_mask_bytes(device: str, backend: str, batch: int, seq: int, elem: int) -> int:
    """The additive (B, 1, S, S) mask a fused SDPA kernel keeps, converted from transformers' bool mask to q's
    dtype (transformers/attention.cpp `convert_boolean_attn_mask`). CUDA's memory-efficient kernel wants its
    rows aligned to 8 elements: an unaligned mask is padded and sliced back (attention.cpp `preprocess_mask`,
    `pad_bias<8>`), so its storage holds S rounded up to 8 per row."""
    row = -(-seq // 8) * 8 if device == "cuda" and backend == "efficient" and seq % 8 else seq
    return batch * seq * row * elem


def gelu_new_elem_bytes(device: str, regime: str) -> list[int]:
    """Bytes per element of the MLP's hidden width (n x f) of each tensor transformers' `NewGELUActivation`
    (`0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * torch.pow(x, 3))))`) and the output projection keep, in
    the order forward makes them: 0.5*x (saved by the last mul), pow's input, tanh's output, 1 + tanh (the last
    mul), and the product as the projection saves it.

    In one dtype (fp32, pure 16-bit, the CPU's autocast: `pow` on none of its lists) all five are in the fc
    output's dtype, x itself for pow. CUDA's autocast runs `pow` in fp32 (aten/src/ATen/autocast_mode.h
    `AT_FORALL_FP32`: `pow`, Tensor_Scalar): pow saves its fp32 cast of x, and the fp32 result promotes
    what follows (`x + ...`, tanh, 1 + tanh, the product: fp32); 0.5*x stays 16-bit and the projection's
    Linear saves its own 16-bit cast of the fp32 product."""
    e = 4 if regime == "fp32" else 2
    if regime == "autocast" and device == "cuda":
        return [2, 4, 4, 4, 2]
    return [e] * 5
