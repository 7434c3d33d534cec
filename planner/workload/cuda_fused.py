"""Two CUDA kernels whose saved tensors the CPU's kernels of the same call do not keep, run on fake CPU tensors as
autograd Functions that save what the CUDA kernel's autograd node saves (trace_modes.py `_cuda_kernels`, the
"cuda" target of a trace; planner/kernel_rules.py is the formulas' side of the same rules):

- the memory-efficient attention kernel (`aten._scaled_dot_product_efficient_attention`, whose meta function
  torch/_meta_registrations.py `meta__scaled_dot_product_efficient_attention` traces it): its output laid out
  (B, S, heads, head_dim) (attention.cu `_efficient_attention_forward`, returned transposed), its fp32
  log-sum-exp with the sequence rounded up to a multiple of 32 (the CPU's flash kernel, which the trace ran
  before, keeps the output in q's layout and an unrounded log-sum-exp). The philox seed and offset it returns
  are left out: with dropout they are host tensors outside CUDA graph capture (attention.cu
  `_efficient_attention_forward`: `at::scalar_tensor(..., at::dtype(at::kLong))`); without dropout two 0-dim
  int64 tensors on the device (`at::empty({}, at::dtype(at::kLong).device(device))`), 8 bytes each (a 512-byte
  block each in the caching allocator) that neither the trace nor the formulas count: a known gap of 1 KiB per
  layer (recent flash_api.cpp versions make their flash kernel's seed and offset on the device too);
- `native_layer_norm` on 16-bit inputs: CUDA keeps its mean and rstd in fp32 (layer_norm_kernel.cu
  `layer_norm_cuda`: `X->options().dtype(acc_type)`), the CPU in the input's dtype (layer_norm.cpp).

Built on the first call (`cuda_functions(torch)`): the planner never imports torch at import time."""

from __future__ import annotations

_FUNCTIONS: dict = {}


def cuda_functions(torch) -> tuple:
    """(efficient_attention(q, k, v, bias, dropout_p, is_causal, scale), layer_norm(x, shape, weight, bias, eps))."""
    if not _FUNCTIONS:
        _FUNCTIONS["f"] = (_efficient_attention_function(torch).apply, _layer_norm_function(torch).apply)
    return _FUNCTIONS["f"]


def _efficient_attention_function(torch):
    aten = torch.ops.aten

    class EfficientAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, bias, dropout_p, is_causal, scale):
            out, lse, _seed, _offset = aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, True, dropout_p, is_causal, scale=scale)
            ctx.save_for_backward(q, k, v, bias, out, lse)
            ctx.args = (dropout_p, is_causal, scale)
            return out

        @staticmethod
        def backward(ctx, grad):
            q, k, v, bias, out, lse = ctx.saved_tensors
            dropout_p, is_causal, scale = ctx.args
            need = list(ctx.needs_input_grad[:3]) + [bias is not None and ctx.needs_input_grad[3]]
            seed = torch.zeros((), dtype=torch.long)  # a host tensor on CUDA: see the module's docstring
            gq, gk, gv, gb = aten._scaled_dot_product_efficient_attention_backward(
                grad, q, k, v, bias if bias is not None else torch.empty(0, dtype=q.dtype), out, lse, seed, seed,
                dropout_p, need, is_causal, scale=scale)
            return gq, gk, gv, gb if need[3] else None, None, None, None

    return EfficientAttention


def _layer_norm_function(torch):
    aten = torch.ops.aten

    class LayerNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shape, weight, bias, eps):
            out, mean, rstd = aten.native_layer_norm(x, shape, weight, bias, eps)
            mean, rstd = mean.float(), rstd.float()
            ctx.save_for_backward(x, weight, bias, mean, rstd)
            ctx.shape = shape
            return out

        @staticmethod
        def backward(ctx, grad):
            x, weight, bias, mean, rstd = ctx.saved_tensors
            need = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2],
                    bias is not None and ctx.needs_input_grad[3]]
            gx, gw, gb = aten.native_layer_norm_backward(grad, x, ctx.shape, mean, rstd, weight, bias, need)
            return gx, None, gw, gb, None

    return LayerNorm
