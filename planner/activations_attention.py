"""Attention's saved tensors (planner/activations.py's attention terms, split out by topic): the reference
decoder's SDPA and eager attention, transformers' SDPA (`integrations/sdpa_attention.py`) and eager functions,
the SDPA backend each device's dispatcher picks, and what each backend keeps for backward. The device's rules
(dropout masks, the backend's choice, the fused kernels' log-sum-exp) come from planner/kernel_rules.py."""

from __future__ import annotations

from .config import TrainConfig
from .kernel_rules import dropout_elem, logsumexp_bytes, sdpa_backend, sdpa_mask_bytes


def _hf_mask(train: TrainConfig) -> bool:
    """transformers materializes the causal mask (`masking_utils._ignore_causal_mask_sdpa` returns
    False) when a sliding window is not longer than the sequence; otherwise SDPA gets `is_causal`."""
    w = train.model.sliding_window
    return bool(w) and train.seq_len >= w


def _hf_sdpa_backend(train: TrainConfig, regime: str, device: str) -> str:
    """'math', 'efficient' or 'flash' for a transformers model's SDPA call (kernel_rules.sdpa_backend): a mask
    where a sliding window makes one (`_hf_mask`), `enable_gqa` where transformers passes it
    (`integrations/sdpa_attention.py` `use_gqa_in_sdpa`: no mask, head_dim <= 256, fewer K/V heads)."""
    m = train.model
    mask = _hf_mask(train)
    gqa = not mask and m.head_dim <= 256 and m.kv_heads < m.heads
    return sdpa_backend(device, regime != "fp32", mask, gqa, m.attn_dropout > 0, m.head_dim)


def _hf_attention_saved(train: TrainConfig, regime: str, n: int, device: str) -> int:
    """SDPA attention of a transformers model (`integrations/sdpa_attention.py` sdpa_attention_forward),
    from the q/k/v projections' outputs to o_proj's input (`_hf_attention_parts`, added up); the module
    docstring lists the terms."""
    return sum(_hf_attention_parts(train, regime, n, device))


def _hf_attention_parts(train: TrainConfig, regime: str, n: int, device: str) -> list[int]:
    """The tensors `_hf_attention_saved` counts, one entry per tensor in the order forward makes them."""
    m = train.model
    h, a, kv = attention_widths(train)
    e = 4 if regime == "fp32" else 2
    b, s = train.micro_batch, train.seq_len
    probs = b * a * s * s
    mask = _hf_mask(train)
    backend = _hf_sdpa_backend(train, regime, device)
    if backend == "math":
        # `_scaled_dot_product_attention_math`: 16-bit inputs upcast on CPU; q, k scaled (k repeated
        # for GQA), v contiguous (repeated), softmax output; dropout noise and the dropped
        # probabilities; then the (B, nh, S, hd) output's `.transpose(1, 2).contiguous()` for o_proj.
        c = 4 if device != "cuda" else e
        # v reaches bmm through a reshape to (B*nh, S, hd): a view for one sequence without upcast or
        # repeat, which then keeps a fused projection's whole output; else a copy.
        v_view = train.micro_batch == 1 and m.kv_heads == m.heads and c == e and m.fused_qkv
        parts = [n * h * c, n * h * c, n * e * (h + 2 * kv) if v_view else n * h * c, probs * c]
        if m.attn_dropout > 0:
            parts += [probs * dropout_elem(device, c), probs * c]
        return parts + [n * h * e]
    repeated = mask and kv < h  # `repeat_kv`: new K/V tensors at all heads
    kv_s = h if repeated else kv
    if m.fused_qkv and not repeated:
        # v (and, without RoPE, q and k) are views of the fused projection's output: its storage stays;
        # with RoPE, the rotated q and k are new
        parts = [n * e * (h + 2 * kv)] + ([n * e * h, n * e * kv] if m.position == "rope" else [])
    else:
        parts = [n * e * h, n * e * kv_s, n * e * kv_s]
    parts += [n * e * h, logsumexp_bytes(device, backend, b, a, n // b)]  # output and logsumexp
    if mask:
        parts.append(sdpa_mask_bytes(device, backend, b, s, e))  # the bool mask in q's dtype, kept by the kernel
    # the output in q's (B, nh, S, hd) layout: `.transpose(1, 2).contiguous()` copies it for o_proj (Phi-3, see
    # `hf_output_copied`); under context parallelism the ring's merged output is a new (B, nh, S, hd) tensor
    # (see `_attention_saved`)
    if hf_output_copied(train, device, backend) or (train._cp_local and train.cp > 1):
        parts.append(n * e * h)
    return parts


def hf_output_copied(train: TrainConfig, device: str, backend: str) -> bool:
    """Whether SDPA's output reaches o_proj through a copy (`.transpose(1, 2).contiguous()`): Phi-3's
    concatenating RoPE makes q (B, nh, S, hd)-contiguous and the kernel's output follows it, except CUDA's
    memory-efficient kernel, whose output is (B, S, nh, hd) already."""
    return train.model.hf_model_type == "phi3" and not (device == "cuda" and backend == "efficient")


def hf_eager(train: TrainConfig) -> bool:
    """Whether the blocks run transformers' `eager_attention_forward` of the Llama family (Llama, Mistral,
    Qwen2, Qwen3, Phi-3, Gemma-2; `_hf_eager_attention_saved`): asked for (`attention="eager"`), or
    Gemma-2's, which has no SDPA path. GPT-2's own eager function is `_gpt2_eager_attention_saved`."""
    m = train.model
    return m.hf_model_type == "gemma2" or (bool(m.hf_model_type) and m.hf_model_type != "gpt2"
                                           and train.attention == "eager")


def _hf_eager_attention_saved(train: TrainConfig, regime: str, n: int, device: str) -> int:
    """transformers' eager attention of the Llama family (`modeling_llama.py` eager_attention_forward; Mistral,
    Qwen2, Qwen3, Phi-3 and Gemma-2 have the same function, Gemma-2's with logit soft-capping), from the
    q/k/v projections' outputs to o_proj's input: q after RoPE, K and V repeated to every head
    (`repeat_kv`; a copy with GQA, the rotated k itself without) as the two matmuls save them, Gemma-2's
    soft-capped scores (`tanh` saves its output; the divisions and products by Python scalars save
    nothing), the softmax's fp32 output (`dtype=torch.float32`), its cast back to q's dtype that the
    second matmul saves (none in fp32: `.to` returns the same tensor), and the
    `.transpose(1, 2).contiguous()` copy o_proj reads. The additive mask is not saved (`add` keeps no
    input), so no (S, S) term per block, where the reference decoder keeps its bool mask."""
    m = train.model
    q, a, _ = attention_widths(train)
    e = 4 if regime == "fp32" else 2
    probs = train.micro_batch * a * train.seq_len ** 2
    saved = 3 * n * e * q + n * e * q  # q, K and V at all heads; o_proj's input copy
    if m.attn_softcap:
        saved += probs * e
    saved += probs * 4
    if m.attn_dropout > 0:
        # the dropout's mask (CUDA) or noise, and the dropped probabilities the second matmul saves
        saved += probs * (dropout_elem(device, e) + e)
    elif e != 4:
        saved += probs * e
    return saved


def _eager_masks_kept(train: TrainConfig, regime: str, every: int) -> int:
    """The additive masks checkpointed layers of a transformers model keep as inputs under eager attention:
    the model's forward makes one (B, 1, S, S) mask per layer type in the embeddings' dtype
    (`masking_utils` eager masks), and a layer `torch.utils.checkpoint` wraps keeps the one it was given
    until its backward. Gemma-2 has two types, layer i sliding when i is even (`Gemma2Config`
    layer_types); the other models the analytic front end reads, one (a Qwen2 window on some layers only is
    refused by hf_config). `every` (0: full) picks the layers."""
    m = train.model
    layers = range(0, m.layers, every) if every > 1 else range(m.layers)
    kinds = len({i % 2 for i in layers}) if m.hf_model_type == "gemma2" else 1
    return kinds * train.micro_batch * train.seq_len ** 2 * (2 if regime == "lowp" else 4)


def attention_widths(train: TrainConfig) -> tuple[int, int, int]:
    """(q width, heads, k/v width) of one tensor-parallel rank: the whole model's divided by tp
    (`TrainConfig` checks that tp divides heads and kv_heads)."""
    m, t = train.model, train.tp
    return m.q_dim // t, m.heads // t, m.kv_dim // t


def _attention_saved(train: TrainConfig, regime: str, n: int, device: str) -> int:
    m = train.model
    if hf_eager(train):
        return _hf_eager_attention_saved(train, regime, n, device)
    if m.hf_model_type and train.attention == "sdpa":
        return _hf_attention_saved(train, regime, n, device)
    h, a, kv = attention_widths(train)
    e = 4 if regime == "fp32" else 2
    b, s = train.micro_batch, train.seq_len
    if train.attention == "sdpa" and not sdpa_math(train, regime, device):
        # q, k, v, the output and the fp32 logsumexp (the flash kernel's saved tensors); wo's input is a view
        # of the output, which the kernel lays out as (B, S, nh, hd). Context parallelism (cp.py): the ring's
        # merged output is a new (B, nh, S, hd) tensor on every rank that `_partial_update`s it (all but
        # the last of the cp group: `torch.cat`), so wo's input is a contiguous copy, saved as well.
        cp_copy = n * e * h if train._cp_local and train.cp > 1 else 0
        backend = "efficient" if device == "cuda" and regime == "fp32" else "flash"  # no fp32 flash on CUDA
        return n * e * (2 * h + 2 * kv) + logsumexp_bytes(device, backend, b, a, n // b) + cp_copy
    probs = b * a * s * s
    if train.attention == "sdpa":
        # `_scaled_dot_product_attention_math`: q and k scaled by sqrt(scale) (saved by the first
        # matmul, k repeated to all heads), the fp32 softmax (saved by softmax and the second matmul),
        # v repeated (saved by the second matmul), and the contiguous copy of the (B, nh, S, hd) output
        # that wo's input needs.
        return n * e * 4 * h + probs * e
    if m.hf_model_type:
        return _gpt2_eager_attention_saved(train, regime, n, device)
    saved = n * e * (h + 2 * h + h) + s * s  # q, K/V repeated, y copy for wo; bool causal mask
    if regime == "autocast" and device == "cuda":
        saved += probs * (4 + 2)  # softmax in fp32 on CUDA autocast, then cast for the matmul
    else:
        saved += probs * e
    if m.attn_dropout > 0:
        # dropout on the probabilities (GPT-2 attn_dropout): its mask (CUDA) or noise, and the dropped
        # probabilities, which the second matmul saves instead of the softmax output softmax keeps
        saved += probs * (dropout_elem(device, e) + e)
    return saved


def _gpt2_eager_attention_saved(train: TrainConfig, regime: str, n: int, device: str) -> int:
    """GPT-2's eager attention (`modeling_gpt2.py` eager_attention_forward, from c_attn's output to c_proj's
    input): q and k saved by the first matmul and v by the second (the matmuls fold the transposed
    (B, nh, S, hd) views into bmm through copies: n*h each), the softmax's output, the dropout's noise or
    mask and its output (which the second matmul saves), or without dropout the probabilities cast to v's
    dtype, and the contiguous copy c_proj reads. Under autocast the scores are fp32 once the additive mask
    (made in the embeddings' dtype, fp32) is added, so the softmax's output is fp32 on the CPU as on CUDA;
    `attn_weights.type(value.dtype)` casts it back (a copy the dropout's `mul` does not save). The mask
    itself is not saved (`add` keeps no input). Measured by the trace, tests/test_analytic_vs_trace.py."""
    m = train.model
    h, a, _ = attention_widths(train)
    e = 4 if regime == "fp32" else 2
    probs = train.micro_batch * a * train.seq_len ** 2
    soft = 4 if regime == "autocast" else e
    saved = n * e * 4 * h + probs * soft
    if m.attn_dropout > 0:
        saved += probs * (dropout_elem(device, e) + e)
    elif soft != e:
        saved += probs * e
    return saved


def sdpa_math(train: TrainConfig, regime: str, device: str) -> bool:
    """Whether `F.scaled_dot_product_attention` falls back to its math backend here.

    On CUDA the flash kernel takes only fp16/bf16 and the memory-efficient kernel does not take
    `enable_gqa` (`aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`), so fp32 with grouped-query
    attention runs the math composite; on CPU the flash kernel takes fp32 and GQA. Measured on an H100
    (torch 2.11): the qwen-small matrix shape in fp32 saves the (B, nh, S, S) probabilities.
    """
    m = train.model
    if m.hf_model_type and train.attention == "sdpa":
        return _hf_sdpa_backend(train, regime, device) == "math"
    return train.attention == "sdpa" and device == "cuda" and regime == "fp32" and m.kv_heads < m.heads
