"""The peak inside one transformer block's backward (`_block_backward_peak`): which saved tensors are freed
by then, what transients are alive, and the weight-gradient elements made, for the MLP's instant, the
eager attention's softmax and context parallelism's ring backward (cp.py). Used by the memory walk
(memory.py), the allocation events (alloc_trace.py) and the pipeline stages (pp.py)."""

from __future__ import annotations

from .activations import _gemma_norm_body, _mlp_saved, _norm_saved, sp_tokens
from .activations_attention import hf_eager, sdpa_math
from .config import TrainConfig
from .cp import ring_backward_bytes


def _block_backward_peak(train: TrainConfig, regime: str, n: int, device: str = "cuda") -> tuple[int, int, int]:
    """(saved bytes already freed, transient bytes, weight-gradient elements) at a block's backward peak.

    The peak inside a block's backward is in the MLP (or, for eager attention with long sequences, at the
    softmax): SwiGLU `w_down` backward makes d(prod) (n*f) and its weight gradient and frees `prod`; the
    product's backward then makes d(silu) and d(up) (n*f each) while d(prod) is alive. GELU: d(gelu) and
    d(fc) (n*f each). The gradient of the residual stream (n*h) is alive throughout.
    """
    m = train.model
    t = train.tp
    h, f = m.hidden, m.ffn_hidden // t  # one tensor-parallel rank's MLP columns
    e = 4 if regime == "fp32" else 2
    r = 4 if regime in ("fp32", "autocast") else 2
    resid = sp_tokens(train, n) * h * r
    if m.mlp == "swiglu":
        mlp = (n * f * e, resid + 3 * n * f * e, h * f)
    else:
        mlp = (n * f * e, resid + 2 * n * f * e, h * f)
    def mlp_freed() -> int:
        """At the attention's backward: the MLP's saved tensors and its norm's, freed (their backward ran first)."""
        consumers = 2 if m.mlp == "swiglu" and not m.fused_gate_up else 1
        return _mlp_saved(train, regime, n, device) + _norm_saved(train, regime, n, consumers, device)
    if hf_eager(train):
        # transformers' eager attention backward (Llama family, Gemma-2), at the softmax's: the score gradient
        # in q's dtype and the fp32 one (`softmax(..., dtype=torch.float32)`), the MLP, its norm (Gemma-2:
        # its two norms and the post-attention norm) and o_proj's input already freed by then (their
        # backward ran first)
        probs = train.micro_batch * (m.heads // t) * train.seq_len ** 2
        freed = mlp_freed() + n * (m.q_dim // t) * e
        if m.sandwich_norms:
            body, const = _gemma_norm_body(h)
            freed += 2 * (sp_tokens(train, n) * body + const)
        att = (freed, resid + probs * (4 + e), h * f * 3 + h * m.q_dim // t)
        if att[1] - att[0] > mlp[1] - mlp[0]:
            return att
    elif train.attention == "eager" or sdpa_math(train, regime, device):
        probs = train.micro_batch * (m.heads // t) * train.seq_len ** 2 * e
        # At the softmax's backward: the MLP's saved tensors and its norm's are freed (their backward ran
        # first), as in Gemma-2's branch above; the MLP's and o_proj's weight gradients are made by then,
        # so the two instants are compared with them (in the compute dtype). Measured against the trace
        # (CUDA's fp32 math composite for grouped KV heads): Mistral-7B's blocks at 2 x 1024 tokens under
        # zero3, -5.6% before (the MLP's saved tensors held and the MLP's instant picked), -0.33% now.
        att = (mlp_freed(), resid + 2 * probs, h * f * (3 if m.mlp == "swiglu" else 2) + h * m.q_dim // t)
        if att[1] - att[0] + att[2] * e > mlp[1] - mlp[0] + mlp[2] * e:
            return att
    if train.cp > 1:
        # Context parallelism: inside the attention's ring backward (cp.py), the MLP's saved tensors freed,
        # the output projection's input gradient (n x h/t) and weight gradient alive.
        ring = ring_backward_bytes(train, regime)
        att = (_mlp_saved(train, regime, n, device), resid + n * (m.q_dim // t) * e + ring, h * m.q_dim // t)
        if att[1] - att[0] > mlp[1] - mlp[0]:  # what each instant adds to the saved activations
            return att
    return mlp
