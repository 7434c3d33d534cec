"""The trace's kernel census (`_KernelCensus`): per segment and phase, the kernels a training step launches,
by FLOPs or bytes moved (`CENSUS_FIELDS`), what the planner times a traced step by."""

from __future__ import annotations

CENSUS_FIELDS = ("gemm_flops", "gemms", "attention_flops", "bytes", "kernels", "ops", "fp32_gemm_flops")
"""What `_KernelCensus` adds up per segment and phase: the FLOPs of the matmuls and convolutions (counted by
`torch.utils.flop_counter`'s formulas) and how many ran; the FLOPs of the fused attention kernels (causal ones
halved: the kernels skip masked tiles; a backward at 2.5x its forward's: Dao 2023, FlashAttention-2, sec.
3.1); the bytes every other kernel reads and writes; the kernels launched (ATen ops that are not views);
the ATen ops dispatched (views included: the host issues them all); and of the first, the FLOPs of the
matmuls whose inputs are fp32 (under autocast, the ops on no autocast list: a MoE's grouped GEMMs, which
transformers runs in the fp32 weight's dtype, time at the fp32 rate, not the 16-bit one)."""

_NO_KERNEL = frozenset(("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "lift_fresh",
                        "_unsafe_view", "alias", "_local_scalar_dense", "set_", "resize_", "_reshape_alias"))
"""ATen ops that launch no kernel though `OpOverload.is_view` is False: allocation, metadata and reshapes."""
_WRITE_ONLY = frozenset(("zeros", "ones", "full", "arange", "zeros_like", "ones_like", "full_like", "new_zeros",
                         "new_ones", "new_full", "zero_", "fill_", "scalar_tensor", "rand_like", "randn_like",
                         "bernoulli_", "uniform_", "normal_", "randint", "randint_like"))
"""Kernels that only write their output (a tensor argument gives its shape, not data)."""
_GATHERS = frozenset(("embedding", "index_select", "gather", "index", "nll_loss_forward", "nll_loss2d_forward"))
"""Kernels that read only the rows they gather (as many bytes as they write), not their whole source."""


def _grouped_mm_flops(a, b, out) -> float:
    """FLOPs of `torch._grouped_mm(a, b, offs)`: the groups split the rows of a 2-D `a` over a 3-D `b`'s
    experts (a MoE forward: each token meets its expert's K x N), or the shared K of two 2-D operands
    (the weights' gradients), or pair up two 3-D batches; 2 x M x K x N in each case."""
    if a.dim() == 2 and b.dim() == 2:
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    if a.dim() == 2 and b.dim() == 3:
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 3 and b.dim() == 3:
        return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    return 2.0 * out.numel() * a.shape[-1]


_GROUPED_MM = frozenset(("_grouped_mm", "grouped_mm", "grouped_mm_fallback"))
"""The grouped GEMMs of a MoE's experts: ATen's `_grouped_mm` (what `torch.nn.functional.grouped_mm` and
transformers' `grouped_mm` experts run) and transformers' own `torch.ops.transformers.grouped_mm_fallback`
(`integrations/moe.py`, where ATen's cannot run)."""


class _KernelCensus:
    """Per segment and phase, the kernels a training step launches, as the time model reads them
    (`CENSUS_FIELDS`): every ATen op the forward and the backward dispatch on the fake tensors is one kernel
    (a view, an allocation or a reshape none), timed by the planner from its FLOPs (matmuls, convolutions,
    fused attention) or from the bytes it reads and writes (everything else: norms, activations, adds, casts,
    the loss, copies). A tensor's bytes are its elements' or, for a broadcast view, its storage's. CUDA and
    the CPU dispatch the same ATen ops for a transformers model, except where SDPA picks another backend
    (the CPU runs the math composite when dropout_p > 0, CUDA a fused kernel) and where CPU autocast casts
    other ops than CUDA's (a known limitation: `profile_workload`)."""

    def __init__(self, torch):
        from torch.utils._pytree import tree_leaves
        from torch.utils.flop_counter import flop_registry

        self._torch, self._leaves, self._flops = torch, tree_leaves, flop_registry
        self.counts: dict = {}  # (segment, phase) -> [CENSUS_FIELDS]

    def _bytes(self, t) -> int:
        n = t.numel() * t.element_size()
        try:
            return min(n, int(t.untyped_storage().nbytes()))
        except Exception:  # pragma: no cover - a tensor without storage
            return n

    def count(self, seg, phase: str, func, args, kwargs, out) -> None:
        if func.namespace != "aten":  # prim.device and other metadata queries
            return
        c = self.counts.setdefault((seg, phase), [0] * len(CENSUS_FIELDS))
        c[5] += 1
        name = func._overloadpacket.__name__
        if func.is_view or name in _NO_KERNEL:
            return
        c[4] += 1
        Tensor = self._torch.Tensor
        if "attention" in name and ("scaled_dot_product" in name or name.startswith(("_flash", "_efficient"))):
            names = [a.name for a in func._schema.arguments]
            given = dict(zip(names, args), **kwargs)
            q, k = given.get("query", given.get("q")), given.get("key", given.get("k"))
            if isinstance(q, Tensor) and isinstance(k, Tensor) and q.dim() == 4:
                # (batch, heads, seq, head_dim); the flash-forward family takes (batch, seq, heads, dim)
                b, hq, sq, d = q.shape if "scaled_dot_product" in name else (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
                sk = k.shape[2] if "scaled_dot_product" in name else k.shape[1]
                f = 4.0 * b * hq * sq * sk * d
                causal = bool(given.get("is_causal", False)) or given.get("custom_mask_type", 0) == 1
                c[2] += f * (0.5 if causal else 1.0) * (2.5 if name.endswith("backward") else 1.0)
                return
        formula = self._flops.get(func._overloadpacket)
        grouped = formula is None and name in _GROUPED_MM  # a MoE's experts in one kernel: no flop_counter formula
        if formula is not None or grouped:
            f = _grouped_mm_flops(args[0], args[1], out) if grouped else formula(*args, **kwargs, out_val=out)
            c[0] += f
            c[1] += 1
            if isinstance(args[0], Tensor) and args[0].dtype == self._torch.float32:
                c[6] += f
            return
        outs = [t for t in self._leaves(out) if isinstance(t, Tensor)]
        written = sum(map(self._bytes, outs))
        ins = [t for t in self._leaves((args, kwargs)) if isinstance(t, Tensor)]
        if name in _WRITE_ONLY:
            c[3] += written
        elif name in _GATHERS:
            c[3] += 2 * written + sum(self._bytes(t) for t in ins if not t.is_floating_point())
        elif name in ("nll_loss_backward", "nll_loss2d_backward", "copy_"):
            # the input gradient is written whole (zeros, then the targets' entries); `self` only gives it
            # its shape; copy_ reads its source and writes its destination
            src = ins[1:] if name == "copy_" else [t for t in ins if not t.is_floating_point()] + ins[:1]
            c[3] += written + sum(map(self._bytes, src))
        else:
            c[3] += written + sum(map(self._bytes, ins))

    def of(self, seg, phase: str) -> list:
        return list(self.counts.get((seg, phase), [0] * len(CENSUS_FIELDS)))
