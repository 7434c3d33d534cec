"""The reference decoder in torch: the model the planner describes exactly.

Parameter names, shapes and registration order match `distplan.planner.model.ModelSpec.param_inventory`
(a test asserts it for every catalog architecture at small scale), and the forward pass is the one the
planner's activation table (`distplan.planner.activations`) was derived from, op by op.

Activation checkpointing per block: `full` is `torch.utils.checkpoint` (non-reentrant), `every-K` the same
on blocks 0, K, 2K, ... (transformers' `every_n_layers`); `selective` is
op-level selective checkpointing that saves the outputs of mm/addmm and SDPA and recomputes the rest;
`selective-op` is torchtitan's op policy (torchtitan/models/llama3/infra/parallelize.py
`_apply_ac_to_transformer_block`, `selective_ac_option = "op"`): save the outputs of `aten.mm` and SDPA,
except every second mm of the block, which is recomputed (addmm is not in its save list).

Blocks: pre-norm (RMSNorm or LayerNorm), attention with GQA (SDPA with `enable_gqa`, or eager
matmul-softmax-matmul with repeated K/V), rotary or learned positions, SwiGLU or GELU MLP. The loss is
cross-entropy on fp32 logits, as Hugging Face and torchtitan compute it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .cp import head_tail_indices, ring_attention


def _save_matmuls_policy(ctx, op, *args, **kwargs):
    """Selective checkpointing: keep the outputs of matmuls and SDPA, recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_save_matmuls_policy)


def _every_other_mm_contexts():
    """torchtitan's op policy, one counter per checkpointed block and per mode (forward / recompute)."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    meta: dict = defaultdict(int)

    def policy(ctx, op, *args, **kwargs):
        key = "recompute_mm" if ctx.is_recompute else "forward_mm"
        if op == _aten.mm.default:
            meta[key] += 1
        save = op in _SAVED_OPS and op != _aten.addmm.default and not (op == _aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


_aten = torch.ops.aten
_SAVED_OPS = {
    _aten.mm.default, _aten.addmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
}


class Norm(nn.Module):
    def __init__(self, dim: int, kind: str, eps: float = 1e-5):
        super().__init__()
        self.kind = kind
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        if kind == "layernorm":
            self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        if self.kind == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        # Hugging Face LlamaRMSNorm, written out so that every device saves the same tensors.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_tables(seq_len: int, head_dim: int, device=None, base: float = 10000.0, positions=None):
    """cos, sin of the rotary embedding for positions 0..seq_len-1, or for `positions` (context
    parallelism: the positions this rank keeps)."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    t = (torch.arange(seq_len, device=device, dtype=torch.float32) if positions is None
         else positions.to(device=device, dtype=torch.float32))
    freqs = torch.outer(t, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()  # (S, hd)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec, attention: str):
        super().__init__()
        h, kv = spec.hidden, spec.kv_dim
        qkvb = spec.linear_bias or spec.qkv_bias
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        self.rope = spec.position == "rope"
        self.attention = attention
        self.cp_group = None
        """Set by `Decoder.context_parallel`: ring attention over this process group (validate/cp.py)."""
        self.wq = nn.Linear(h, h, bias=qkvb)
        self.wk = nn.Linear(h, kv, bias=qkvb)
        self.wv = nn.Linear(h, kv, bias=qkvb)
        self.wo = nn.Linear(h, h, bias=spec.linear_bias)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, S, hd)
        k = self.wk(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, S, hd)
        v = self.wv(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        if self.cp_group is not None:
            y = ring_attention(q, k, v, self.cp_group)
        elif self.attention == "sdpa":
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        else:
            rep = self.heads // self.kv_heads
            if rep > 1:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, nh, S, S)
            mask = torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
            y = torch.softmax(scores, dim=-1) @ v
        y = y.transpose(1, 2).reshape(B, S, -1)  # (B, S, h)
        return self.wo(y)


class MLP(nn.Module):
    def __init__(self, spec):
        super().__init__()
        h, f, b = spec.hidden, spec.ffn_hidden, spec.linear_bias
        self.kind = spec.mlp
        if spec.mlp == "swiglu":
            self.w_gate = nn.Linear(h, f, bias=b)
            self.w_up = nn.Linear(h, f, bias=b)
            self.w_down = nn.Linear(f, h, bias=b)
        else:
            self.fc = nn.Linear(h, f, bias=b)
            self.proj = nn.Linear(f, h, bias=b)

    def forward(self, x):
        if self.kind == "swiglu":
            return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, spec, attention: str):
        super().__init__()
        self.attn_norm = Norm(spec.hidden, spec.norm)
        self.attn = Attention(spec, attention)
        self.mlp_norm = Norm(spec.hidden, spec.norm)
        self.mlp = MLP(spec)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Token ids (B, S) and targets (B, S) -> scalar mean cross-entropy loss."""

    def __init__(self, spec, attention: str = "sdpa", checkpointing: str = "none"):
        super().__init__()
        self.spec = spec
        self.checkpointing = checkpointing
        self.loss_parallel = False
        """Set by `validate.tp_probe.parallelize_decoder`: the LM head is a `ColwiseParallel` module whose
        logits stay sharded over the vocabulary (a DTensor); the loss then runs under `loss_parallel()`."""
        self.cp_positions = None
        """Set by `context_parallel`: the sequence positions this rank keeps (its tokens are those)."""
        self.tok_embeddings = nn.Embedding(spec.vocab, spec.hidden)
        if spec.position == "learned":
            self.pos_embeddings = nn.Embedding(spec.max_positions, spec.hidden)
        self.layers = nn.ModuleList(Block(spec, attention) for _ in range(spec.layers))
        self.norm = Norm(spec.hidden, spec.norm)
        if not spec.tie_embeddings:
            self.output = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, tokens, targets):
        B, S = tokens.shape
        x = self.tok_embeddings(tokens)  # (B, S, h)
        cos = sin = None
        if self.spec.position == "learned":
            x = x + self.pos_embeddings(torch.arange(S, device=tokens.device))
        else:
            cos, sin = rope_tables(S, self.spec.head_dim, device=tokens.device, positions=self.cp_positions)
        every = int(self.checkpointing.split("-")[1]) if self.checkpointing.startswith("every-") else 0
        for i, block in enumerate(self.layers):
            if self.checkpointing == "full" or (every and i % every == 0):  # every-K: blocks 0, K, 2K, ...
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            elif self.checkpointing == "selective":
                x = checkpoint(block, x, cos, sin, use_reentrant=False, context_fn=_selective_contexts)
            elif self.checkpointing == "selective-op":
                x = checkpoint(block, x, cos, sin, use_reentrant=False, context_fn=_every_other_mm_contexts)
            else:
                x = block(x, cos, sin)
        x = self.norm(x)
        if self.loss_parallel:  # tensor parallelism: the head's module (its hooks) gives Shard(-1) logits
            logits = self.output(x)  # (B, S, V/tp) local, a DTensor
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        weight = self.tok_embeddings.weight if self.spec.tie_embeddings else self.output.weight
        logits = F.linear(x, weight)  # (B, S, V)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))

    def context_parallel(self, group, rank: int, cp: int, seq_len: int) -> None:
        """Run with context parallelism over `group` (rank `rank` of `cp`): every attention becomes ring
        attention and the forward takes the (B, 2 * seq_len / (2 * cp)) tokens of the head-tail positions
        `validate.cp.head_tail_indices` gives; the loss is the mean over those tokens, as torchtitan's."""

        if self.spec.position != "rope":
            raise ValueError("cp > 1: context parallelism runs the RoPE decoder (learned positions are not sharded)")
        self.cp_positions = head_tail_indices(seq_len, cp, rank)
        for block in self.layers:
            block.attn.cp_group = group
