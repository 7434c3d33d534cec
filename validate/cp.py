"""Context parallelism in the probes: ring attention over a `cp` process group, as torchtitan runs it.

torchtitan (`torchtitan/distributed/utils.py` `create_context_parallel_ctx`) shards every sequence of
the batch over the cp ranks with `torch.distributed.tensor.experimental.context_parallel`, which
(a) splits the sequence dimension of the inputs, the targets and the RoPE table with the head-tail load
balancer (`_context_parallel/_load_balancer.py` `_HeadTailLoadBalancer`: 2 * cp chunks, rank r keeps
chunks r and 2 * cp - 1 - r, so every rank has the same share of the causal mask), and (b) replaces
SDPA's flash / memory-efficient / cuDNN kernels by ring attention
(`_context_parallel/_attention.py` `_templated_ring_attention` and `_templated_ring_attention_backward`,
reached through the DTensor dispatcher).

That dispatcher handles the CUDA kernels only; on the CPU, SDPA runs
`aten._scaled_dot_product_flash_attention_for_cpu`, which it does not intercept. `RingAttention` calls
the same two templated functions directly with the CPU flash kernel and its backward, so a CPU probe
runs PyTorch's own ring-attention code: the same K/V all-gather (`_AllGatherRotater`, the default
`_cp_options.rotate_method`), the same fp32 merge of the partial outputs (`_SDPAMerger`), the same ring
of fp32 dK/dV (`_AllToAllRotater` -> `_functional_collectives.permute_tensor`), the same saved tensors
(query, key, value, output, logsumexp, as the flash kernel's autograd node saves them).

Known limitation: GPU probes with cp > 1 are not wired (they would use `context_parallel` itself).
"""

from __future__ import annotations

import functools

import torch

from .measure import Tracker


def head_tail_indices(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Positions rank `rank` of `cp` keeps: chunk `rank` and chunk 2 * cp - 1 - rank of 2 * cp chunks
    (`_HeadTailLoadBalancer._generate_indices`)."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len}: must be a multiple of 2 * cp = {2 * cp} (head-tail load balancing)")
    k = seq_len // (2 * cp)
    first = torch.arange(rank * k, (rank + 1) * k, device=device)
    last = torch.arange((2 * cp - 1 - rank) * k, (2 * cp - rank) * k, device=device)
    return torch.cat((first, last))


class RingAttention(torch.autograd.Function):
    """Causal ring attention of local (B, nh, S/cp, hd) query / (B, nkv, S/cp, hd) key and value."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        out, lse = _templated_ring_attention(group, 2, op, q, k, v, is_causal=True)[:2]
        ctx.group = group
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _templated_ring_attention_backward)

        q, k, v, out, lse = ctx.saved_tensors
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        dq, dk, dv = _templated_ring_attention_backward(ctx.group, 2, op, dout, "grad_out", q, k, v, out, lse,
                                                        True, dropout_p=0.0)[:3]
        return dq, dk, dv, None


def ring_attention(q, k, v, group):
    if q.device.type != "cpu":
        raise NotImplementedError("cp > 1: the probes run ring attention on the CPU only (gloo or fake)")
    return RingAttention.apply(q, k, v, group)


def hf_context_parallel(model, group, rank: int, cp: int, seq_len: int) -> None:
    """Run a transformers causal LM (SDPA) with context parallelism over `group` (rank `rank` of `cp`), as
    torchtitan's `context_parallel` runs it: each rank keeps the head-tail positions of every sequence
    (`model.cp_positions`: `HFWorkload.loss` passes them as `position_ids`, so the rotary tables are those of
    the global positions, and the probe feeds those tokens), and the SDPA call of transformers' attention
    (`integrations/sdpa_attention.py`, `torch.nn.functional.scaled_dot_product_attention`, causal, no mask,
    K/V at their own heads with `enable_gqa`) becomes ring attention over the group (`ring_sdpa`), as
    `context_parallel` swaps SDPA's kernels for `_templated_ring_attention` on CUDA. transformers' mask
    helpers see positions that do not start at 0 and are not contiguous and would build a mask for packed
    sequences; the probe's batches are one sequence per row, so `model.cp_context()` tells them so
    (`masking_utils.find_packed_sequence_indices`: none; `_ignore_causal_mask_sdpa`: causal, no mask) and
    installs `ring_sdpa` for the forward and backward."""
    import contextlib

    if model.config._attn_implementation != "sdpa":
        raise ValueError(f"cp={cp}: the context-parallel probe runs transformers' SDPA attention, not "
                         f"{model.config._attn_implementation!r}")
    model.cp_positions = head_tail_indices(seq_len, cp, rank)

    @contextlib.contextmanager
    def cp_context():
        import torch.nn.functional as F
        from transformers import masking_utils

        saved = (F.scaled_dot_product_attention, masking_utils.find_packed_sequence_indices,
                 masking_utils._ignore_causal_mask_sdpa)
        F.scaled_dot_product_attention = functools.partial(ring_sdpa, group=group)
        masking_utils.find_packed_sequence_indices = lambda position_ids: None
        masking_utils._ignore_causal_mask_sdpa = lambda *a, **k: True
        try:
            yield
        finally:
            (F.scaled_dot_product_attention, masking_utils.find_packed_sequence_indices,
             masking_utils._ignore_causal_mask_sdpa) = saved

    model.cp_context = cp_context


def ring_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              *, group):
    """`torch.nn.functional.scaled_dot_product_attention` as ring attention over `group`: causal, no mask,
    no dropout, the default scale (what transformers' SDPA path passes for a decoder's training batch)."""
    if attn_mask is not None or not is_causal or dropout_p or (scale is not None and
                                                                abs(scale - query.shape[-1] ** -0.5) > 1e-12):
        raise ValueError("cp > 1: ring attention runs causal attention without a mask, dropout or a custom scale")
    if torch.is_autocast_enabled(query.device.type):
        # what autocast does to SDPA's inputs (CPU and CUDA autocast cast them to the lower precision), which
        # an autograd Function called directly would not get
        dt = torch.get_autocast_dtype(query.device.type)
        query, key, value = (x.to(dt) for x in (query, key, value))
    return ring_attention(query, key, value, group)


SHAPES = ((1, 8, 8, 64, 16, "float32"), (2, 8, 2, 128, 16, "float32"), (1, 8, 8, 64, 16, "bfloat16"),
          (2, 16, 4, 256, 8, "bfloat16"), (1, 4, 4, 128, 32, "bfloat16"), (1, 16, 2, 64, 16, "float32"),
          (1, 16, 2, 64, 16, "bfloat16"))
"""(batch, heads, kv heads, tokens per sequence on the rank, head dim, dtype) of the ring-backward measurement."""


def measure_ring_backward(cp: int, rank: int, shapes=SHAPES) -> list[dict]:
    """The storage tracker's peak (validate/measure.py) over one `RingAttention` backward per shape, as
    rank `rank` of a fake process group of `cp` ranks (one process: the group is initialised here), minus
    what is alive when it starts (q, k, v, the incoming gradient, the output, the logsumexp). What `planner.cp
    .ring_backward_bytes` models (tests/test_cp.py; committed rows in tests/data/cp_ring_backward_cpu.json)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore


    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
    rows = []
    for b, heads, kv_heads, s, d, dt in shapes:
        dtype = getattr(torch, dt)
        n = b * s
        tracker = Tracker()
        with tracker:  # every storage made inside: a view of an untracked one would count as new
            q = torch.randn(b, s, heads, d, dtype=dtype).transpose(1, 2).requires_grad_()  # (B, nh, S/cp, hd)
            k = torch.randn(b, s, kv_heads, d, dtype=dtype).transpose(1, 2).requires_grad_()
            v = torch.randn(b, s, kv_heads, d, dtype=dtype).transpose(1, 2).requires_grad_()
            g = torch.randn(b, heads, s, d, dtype=dtype)
            out = ring_attention(q, k, v, dist.group.WORLD)
            tracker.reset_peak()
            before = sum(rec[0] for rec in tracker.live.values())  # inputs, gradient, output, logsumexp
            tracker.phase = "backward"
            out.backward(g)
        e = q.element_size()
        rows.append({"cp": cp, "rank": rank, "tokens": n, "q_width": heads * d, "kv_width": kv_heads * d,
                     "elem_bytes": e, "heads": heads, "backward_transient_bytes": tracker.peak_bytes - before})
    dist.destroy_process_group()
    return rows


if __name__ == "__main__":  # python -m distplan.validate.cp CP RANK: one JSON line of rows
    import json
    import sys
    print(json.dumps(measure_ring_backward(int(sys.argv[1]), int(sys.argv[2]))))
