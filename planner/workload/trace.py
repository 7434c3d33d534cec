"""Profile any `nn.Module` from a factory without allocating it: parameters, saved activations, FLOPs.

`profile_module("pkg.mod:factory", (128, 1, 28, 28), "float32")` imports `pkg.mod` (the working
directory is put on `sys.path` first, so `examples.mnist_cnn:make_model` works from the repository
root), calls `factory()` under `torch._subclasses.fake_tensor.FakeTensorMode` (no real allocation, no
weights touched), and runs one forward pass plus the loss on a fake input of that shape:

- parameters: every tensor of `named_parameters()` (shared weights once), with its shape, grouped by
  the top-level child that owns it. Those children are the wrapping units FSDP would get from an
  auto-wrap policy on the module's direct children; parameters owned by the root itself form `root`.
  Buffers (BatchNorm statistics) are counted apart, with their dtypes (DDP broadcasts them).
- activations: the bytes autograd saves for backward (`torch.autograd.graph.saved_tensors_hooks`),
  counted once per storage (views of one tensor share it), excluding the parameters', the buffers' and
  the input batch's own storages (the batch is `batch_bytes`, a temporary).
  Casts of parameters (autocast's weight cache, a 16-bit copy) are not parameters and are counted.
- loss: cross-entropy against class 0 when the output is 2-D (N, C) (a classifier), else the sum of
  all outputs. What the loss saves (log_softmax's output) is part of the activations; the output's
  bytes are returned apart (`output_bytes`) because the planner counts them as a temporary.
- FLOPs of the forward pass, from the census below: matmuls and convolutions by `torch.utils.flop_counter`'s
  formulas, a MoE's grouped GEMMs, fused attention (halved when causal).
- per segment, the kernels its forward and backward launch (`census`; `unit_census`: the unit's own
  forward), by FLOPs or bytes moved (`_KernelCensus`): what the planner times a traced step by.
- per segment, what its forward and its backward hold at their peaks (`forward_bytes`;
  `backward_bytes`, `backward_grad_bytes`, `backward_saved_bytes`): the backward runs too, on the same
  fake tensors, and a dispatch mode follows every storage created (`_SegmentTracker`).
- per segment, its convolutions (`kernels`): the call's arguments and what is alive when it runs, for
  the cuDNN workspace measured on a GPU (`planner/workload/kernel_workspace.py`); `linear_bias`: an addmm ran.

`dtype`: "float32"; "bfloat16"/"float16" cast the module and the input (pure 16-bit training);
"autocast-bfloat16"/"autocast-float16" keep fp32 parameters and run the forward under CPU `torch.autocast`
(the DDP mixed-precision recipe). CPU autocast's op lists are close to, not identical with, CUDA's (CUDA
runs softmax/log_softmax in fp32 too) -- a known limitation. "fsdp-bfloat16"/"fsdp-float16": FSDP's mixed
precision: the parameters (and a module's buffers: FSDP1's `buffer_dtype`) cast, the batch made in fp32 and
cast to 16 bits at the root's forward, as FSDP1's `_root_pre_forward` (`cast_root_forward_inputs`) and
FSDP2's `_pre_forward` (`cast_forward_inputs`) do: the fp32 batch stays the caller's, the 16-bit copy is
what the first ops save. "fsdp1-bfloat16"/"fsdp1-float16": the same for FSDP1 with an auto-wrap policy
where the modules of `MixedPrecision._module_classes_to_ignore` (BatchNorm) keep fp32 parameters and
buffers, each its own FSDP unit (listed first in `units`, named in `fp32_units`), and run in fp32 between
casts of their input and output (`_common_utils._override_module_mixed_precision`, whose hooks the trace
registers).

Known limitations: one forward of one input tensor (models that take several inputs, dicts or integer
token ids need a small wrapper factory); data-dependent control flow sees fake values; the segment a
backward op belongs to is found by gradient hooks on the segments' inputs, so a segment whose input
needs no gradient (the first) takes the ops after the last hook.
"""

from __future__ import annotations

import contextlib
import time
import warnings

from .traced_model import FactoryWorkload, HFWorkload, load_factory, parse_shape

_DTYPES = ("float32", "bfloat16", "float16", "autocast-bfloat16", "autocast-float16", "fsdp-bfloat16",
           "fsdp-float16", "fsdp1-bfloat16", "fsdp1-float16")


def _storage_key(t):
    try:
        return t.untyped_storage()._cdata
    except Exception:  # pragma: no cover - tensors without storage (sparse, nested)
        return id(t)


def _storage_nbytes(t) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:  # pragma: no cover
        return int(t.numel() * t.element_size())


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
def _cuda_kernels(torch):
    """While tracing for a GPU, the two choices where CPU and CUDA kernels keep different tensors:

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

    The LayerNorm statistics remain the CPU's (16-bit under 16-bit inputs, fp32 on CUDA): 4 bytes per token
    per LayerNorm under pure bf16, a known limitation (planner/activations.py `_norm_saved`)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional
    sdpa, dropout = F.scaled_dot_product_attention, F.dropout
    lowp = (torch.float16, torch.bfloat16)

    def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        grouped = bool(enable_gqa) and query.size(-3) != key.size(-3)
        # under autocast (CPU's stands in for CUDA's), CUDA casts SDPA's inputs to the 16-bit dtype
        # (`scaled_dot_product_attention` is in autocast_mode.cpp's lower_precision_fp list)
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
        flash = dtype in lowp and attn_mask is None and query.size(-1) <= 256
        if grouped and not flash:  # no fused CUDA kernel takes it: the math composite, as on a GPU
            with sdpa_kernel([SDPBackend.MATH]):
                return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    def cuda_dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return input
        return torch.native_dropout(input, p, True)[0]

    F.scaled_dot_product_attention, F.dropout = cuda_sdpa, cuda_dropout
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.dropout = sdpa, dropout


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


class _SegmentTracker:
    """What the forward and the backward hold, per segment, measured on fake tensors.

    Forward (`forward_mode`): after each op, the bytes alive of every storage the forward created, the
    highest per segment (`fwd_peak`); the convolutions' arguments and that figure when each runs; whether
    an addmm ran. Backward, below.

    A dispatch mode sees every op of the backward; each new output storage is kept as a weak reference
    (`StorageWeakRef`), so after every op the bytes autograd still references are known, as the
    allocator would see them. The segment an op belongs to: backward runs the segments in reverse, and a
    gradient hook on each segment's input (`mark_input`) fires when that segment's backward is done.
    Storages still alive when the backward ends are the parameters' gradients. After each op, three
    figures of the current segment: `transient` (the other storages the backward created and still
    holds: gradients of activations), `grads` (this segment's parameter gradients created so far) and
    `saved` (this segment's saved tensors not yet freed). Per segment the instant where their sum is
    highest is kept: the planner's walk adds the segments before (their saved tensors, the gradients
    already reduced) and the strategy's own buffers to it."""

    def __init__(self, torch):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        self._torch, self._ref = torch, StorageWeakRef
        self.census = _KernelCensus(torch)
        self.live: dict = {}  # storage key -> (weak ref, bytes, unique id)
        self.born: dict = {}  # unique id -> segment it was created in
        self.saved: dict = {}  # segment -> [(weak ref, bytes)] of the storages it saved for backward
        self.timeline: list = []  # (segment, [(unique id, bytes) alive], saved bytes of it alive, started)
        self.segment = None  # None: the loss (the last segment) until its input's hook fires
        self.started: set = set()  # segments whose unit's output gradient is ready (`mark_output`)
        self.survivors: set = set()
        self.accumulated_at: dict = {}  # unique id of a parameter's gradient -> timeline length when it was
        # accumulated (`Tensor.register_post_accumulate_grad_hook`: after its AccumulateGrad)
        self._uid = 0
        self._log_uid = 0
        # The step's allocations in host order, as the caching allocator would see them (the planner's
        # allocator replay of a module, module_plan.logged_module_events): [1, id, bytes] when an op's
        # output storage is new, [0, id] when a storage the step made is gone (found after each op: what the
        # previous one's callers dropped), [2, key] where a convolution's cuDNN workspace is taken and given
        # back (its size is measured on a GPU). Parameters, buffers and the input batch are not in it.
        # Where FSDP's hooks run (module_plan's FSDP2 events, alloc_trace.logged_fsdp2_events): [3, unit] a
        # unit's forward starts (its pre-forward hook: the unshard), [4, unit] it ends (the reshard after
        # forward), [5, unit] its outputs' gradient is ready (pre-backward: unshard and prefetch), [6, unit]
        # its inputs' gradient is (post-backward: reshard and reduce-scatter), [7, unit] every gradient of its
        # parameters is accumulated (FSDP1's post-backward hook, on its flat parameter's AccumulateGrad).
        self.log: list = []
        self.grad_names: dict = {}  # log id of a parameter's gradient (as AccumulateGrad keeps it) -> its name
        self.logging = True
        self._log_live: dict = {}  # storage key -> (weak ref, id)
        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker.census.count(tracker.segment if tracker.segment is not None else tracker._last, "backward",
                                     func, args, kwargs or {}, out)
                outs, ins = tree_leaves(out), tree_leaves((args, kwargs))
                tracker._log(outs, ins)
                tracker._after(outs, ins)
                if func is torch.ops.aten.convolution_backward.default:
                    tracker._kernel(conv_args(args, "backward"))
                    if tracker.logging:
                        tracker.log.append([2, conv_key(conv_args(args, "backward"))])
                return out

        self._mode = _Mode()
        self.kernels: dict = {}  # segment -> [{"phase", "args", "at"}]: convolutions (cuDNN workspaces)
        self.linear_bias = False  # an addmm in forward: cuBLASLt's workspace on CUDA
        self.forward_segment = lambda: 0

        self.fwd_live: dict = {}  # storage key -> (weak ref, bytes): what the forward created
        self.fwd_peak: dict = {}  # segment -> highest bytes alive of what the forward created
        self.not_activations: set = set()  # parameters and the input batch

        class _Forward(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten.addmm.default:
                    tracker.linear_bias = True
                out = func(*args, **(kwargs or {}))
                tracker.census.count(tracker.forward_segment(), "forward", func, args, kwargs or {}, out)
                outs, ins = tree_leaves(out), tree_leaves((args, kwargs))
                tracker._log(outs, ins)
                alive = tracker._forward_after(outs, ins)
                if func is torch.ops.aten.convolution.default:  # with its output alive, as cuDNN runs
                    tracker.kernels.setdefault(tracker.forward_segment(), []).append(
                        {"phase": "forward", "args": conv_args(args, "forward"), "at": alive})
                    if tracker.logging:
                        tracker.log.append([2, conv_key(conv_args(args, "forward"))])
                return out

        self.forward_mode = _Forward()

    def _created(self, outs, ins, live: dict):
        """(key, storage) of each output storage an op allocated: not one of its inputs' (views, detach
        -- how saved tensors come back -- and in-place ops return an input's storage) and not already
        alive. `live` is pruned of freed storages first: a freed storage's address (the key) comes back."""
        Tensor = self._torch.Tensor
        for k in [k for k, v in live.items() if v[0].expired()]:
            del live[k]
        aliased = {t.untyped_storage()._cdata for t in ins if isinstance(t, Tensor)}
        for t in outs:
            if isinstance(t, Tensor):
                st = t.untyped_storage()
                k = st._cdata
                if k not in live and k not in aliased:
                    yield k, st

    def _log_frees(self) -> None:
        for k in [k for k, v in self._log_live.items() if v[0].expired()]:
            self.log.append([0, self._log_live.pop(k)[1]])

    def _log(self, outs, ins) -> None:
        """After each op of the step: the storages gone since the last one, then the op's new outputs."""
        if not self.logging:
            return
        self._log_frees()
        aliased = {t.untyped_storage()._cdata for t in ins if isinstance(t, self._torch.Tensor)}
        for t in outs:
            if isinstance(t, self._torch.Tensor):
                st = t.untyped_storage()
                k = st._cdata
                # (a zero-byte storage takes no block: CUDA's allocator returns no memory for it)
                if (k not in self._log_live and k not in aliased and k not in self.not_activations
                        and st.nbytes()):
                    self._log_uid += 1
                    self._log_live[k] = (self._ref(st), self._log_uid)
                    self.log.append([1, self._log_uid, int(st.nbytes())])

    def close_log(self) -> dict:
        """The step's log once its tensors are dropped: {"events": the log, "kept": the ids still alive
        (the parameters' gradients, which `zero_grad(set_to_none=True)` drops after the optimizer step),
        "grads": [[id, parameter name], ...] of those}."""
        self._log_frees()
        return {"events": _post_backward_first(_frees_in_order(self.log)), "kept": sorted(v[1] for v in self._log_live.values()),
                "grads": sorted([i, n] for i, n in self.grad_names.items())}

    def log_marker(self, kind: int, unit: str | None) -> None:
        """A unit's hook point in the log (kinds 3-6, see `log`), after the frees of the op before."""
        if self.logging and unit is not None:
            self._log_frees()
            self.log.append([kind, unit])

    def _forward_after(self, outs, ins) -> int:
        """After each forward op: the bytes alive of every storage the forward created (saved or not:
        the probes' tracker counts them all as activations while the forward runs)."""
        for k, st in self._created(outs, ins, self.fwd_live):
            if k not in self.not_activations:
                self.fwd_live[k] = (self._ref(st), int(st.nbytes()))
        seg = self.forward_segment()
        alive = sum(v[1] for v in self.fwd_live.values())
        self.fwd_peak[seg] = max(self.fwd_peak.get(seg, 0), alive)
        return alive

    def mark_input(self, args, index: int, unit: str | None = None) -> None:
        fired = []

        def done(_grad, index=index):
            self.segment = index - 1
            if not fired:  # once, at the first input's gradient (FSDP2's RegisterPostBackwardFunction)
                fired.append(1)
                self.log_marker(6, unit)
        for a in args:
            if isinstance(a, self._torch.Tensor) and a.requires_grad:
                a.register_hook(done)

    def mark_output(self, outs, index: int, unit: str | None = None) -> None:
        """A gradient hook on the outputs of segment `index`'s unit: it fires when their gradient is
        ready, where FSDP's pre-backward hook (registered on the same outputs) unshards the unit and
        prefetches the next; the segment's ops before it (functional ops after the unit's forward:
        ReLU, pooling) run without them."""
        def started(_grad, index=index):
            if index not in self.started:
                self.log_marker(5, unit)
            self.started.add(index)
        for a in outs:
            if isinstance(a, self._torch.Tensor) and a.requires_grad:
                a.register_hook(started)

    def mark_accumulated(self, param, name: str | None = None) -> None:
        """A parameter's AccumulateGrad has run (its post-accumulate-grad hook): the timeline entries before
        this instant are those where its new gradient was made and not yet accumulated."""
        g = param.grad
        if g is None:
            return
        logged = self._log_live.get(g.untyped_storage()._cdata)
        if logged is not None and name is not None:
            self.grad_names.setdefault(logged[1], name)
        hit = self.live.get(g.untyped_storage()._cdata)
        if hit is not None:
            self.accumulated_at.setdefault(hit[2], len(self.timeline))

    def mark_saved(self, storage, nbytes: int, index: int) -> None:
        self.saved.setdefault(index, []).append((self._ref(storage), nbytes))

    def _after(self, outs, ins) -> None:
        seg = self.segment if self.segment is not None else self._last
        for k, st in self._created(outs, ins, self.live):
            self._uid += 1
            self.live[k] = (self._ref(st), int(st.nbytes()), self._uid)
            self.born[self._uid] = seg
        saved = sum(n for ref, n in self.saved.get(seg, ()) if not ref.expired())
        self.timeline.append((seg, [(v[2], v[1]) for v in self.live.values()], saved, seg in self.started))

    def _kernel(self, args: dict) -> None:
        """A backward convolution: where it runs and what is alive then (its outputs included; cuDNN
        takes its workspace while they exist)."""
        seg, alive, saved, _ = self.timeline[-1]
        self.kernels.setdefault(seg, []).append({"phase": "backward", "args": args, "at": (alive, saved)})

    def run(self, loss, n_segments: int) -> None:
        self._last = n_segments - 1
        with self._mode:
            loss.backward()
        self.survivors = {v[2] for v in self.live.values() if not v[0].expired()}

    def _split(self, seg, alive, saved) -> tuple:
        trans = sum(n for uid, n in alive if uid not in self.survivors)
        grads = sum(n for uid, n in alive if uid in self.survivors and self.born[uid] == seg)
        return trans, grads, saved

    def segment_peaks(self, started: bool | None = None) -> dict:
        """{segment index: (transient, grads, saved) at the instant of its backward where their sum
        is highest}; with `started` only among the instants after (True) or before (False) the
        segment's unit output gradient is ready (`mark_output`)."""
        peaks: dict = {}
        for seg, alive, saved, s in self.timeline:
            if started is not None and s != started:
                continue
            t = self._split(seg, alive, saved)
            if seg not in peaks or sum(t) > sum(peaks[seg]):
                peaks[seg] = t
        return peaks

    def segment_peaks_accumulating(self, started: bool | None = None) -> dict:
        """As `segment_peaks` for a micro-step after the first of gradient accumulation, where every
        parameter already has a .grad and AccumulateGrad adds each new gradient into it in place
        (torch/csrc/autograd/functions/accumulate_grad.h `accumulateGrad`: `variable_grad += new_grad`
        outside grad mode) and frees it: {segment index: (transient, fresh, saved)} at the instant where
        their sum is highest, `fresh` being the bytes of the parameters' gradients made and not yet
        accumulated at that instant (all of them: a tied LM head's, summed with the embedding's in
        autograd's input buffer, is accumulated only after the embedding's backward). The kept .grad
        itself is the walk's (every unit's, from the first micro-step on)."""
        peaks: dict = {}
        never = len(self.timeline) + 1
        for i, (seg, alive, saved, s) in enumerate(self.timeline):
            if started is not None and s != started:
                continue
            trans = fresh = 0
            for uid, n in alive:
                if uid not in self.survivors:
                    trans += n
                elif self.accumulated_at.get(uid, never) > i:
                    fresh += n
            t = (trans, fresh, saved)
            if seg not in peaks or sum(t) > sum(peaks[seg]):
                peaks[seg] = t
        return peaks

    def segment_grads(self) -> dict:
        """{segment index: bytes of the parameters' gradients (the storages alive when the backward ends)
        made in its backward}: its unit's own, and those of the root's ops that ran after the unit in
        forward (a decoder's final norm and LM head join the last block's segment)."""
        made: dict = {}
        for _, n, uid in self.live.values():
            if uid in self.survivors:
                made[self.born[uid]] = made.get(self.born[uid], 0) + n
        return made

    def segment_ends(self) -> dict:
        """{segment index: transient bytes alive when its backward is over}, read at the next segment's
        first op: the gradient it passes on, plus whatever waits in autograd's buffers (a tied LM head's
        gradient until the embedding's half arrives)."""
        ends: dict = {}
        prev = None
        for seg, alive, saved, _ in self.timeline:
            if prev is not None and seg != prev and prev not in ends:
                # the next segment's first op: what is still alive of the earlier ones (a storage
                # the last op of `prev` replaced is gone by now, as when FSDP's post-backward runs)
                ends[prev] = sum(n for uid, n in alive if uid not in self.survivors and self.born[uid] != seg)
            prev = seg
        if self.timeline and prev not in ends:
            # the last segment (the root's first ops) has no next one: what is alive at its first op
            _, alive, saved, _ = next(e for e in self.timeline if e[0] == prev)
            ends[prev] = self._split(prev, alive, saved)[0]
        return ends

    def segment_kernels(self, seg: int, saved_before: int) -> list:
        """The segment's convolutions: {"phase", "key", "args", "at"}: in backward (transient, grads,
        saved) as `segment_peaks`; in forward [bytes alive of what the forward created, less the
        earlier segments' saved tensors (`saved_before`)], as the segments' `forward_bytes`."""
        out = []
        for k in self.kernels.get(seg, ()):
            if k["phase"] == "forward":
                at = [max(0, k["at"] - saved_before)]
            else:
                at = list(self._split(seg, *k["at"]))
            out.append({"phase": k["phase"], "key": conv_key(k["args"]), "args": k["args"], "at": at})
        return out


def conv_args(args, phase: str) -> dict:
    """The arguments of aten.convolution (forward) or aten.convolution_backward that pick cuDNN's
    kernel, as plain data: enough to run the same call on a GPU (`planner/workload/kernel_workspace.py`)."""
    if phase == "forward":
        x, w, b, stride, padding, dilation, transposed, out_pad, groups = args[:9]
        mask = None
    else:
        _g, x, w, b, stride, padding, dilation, transposed, out_pad, groups, mask = args[:11]
        b = b is not None
        mask = [bool(m) for m in mask]
    return {"phase": phase, "input": list(x.shape), "weight": list(w.shape), "bias": bool(b is not None
            if phase == "forward" else b), "stride": list(stride), "padding": list(padding),
            "dilation": list(dilation), "transposed": bool(transposed), "output_padding": list(out_pad),
            "groups": int(groups), "dtype": str(x.dtype).replace("torch.", ""), "output_mask": mask}


def _ints(v) -> str:
    return ",".join(map(str, v))


def conv_key(args: dict) -> str:
    """One line naming a convolution call: the key of its measured workspace."""
    a = args
    return (f"conv {a['phase']} x={'x'.join(map(str, a['input']))} w={'x'.join(map(str, a['weight']))} "
            f"s={_ints(a['stride'])} p={_ints(a['padding'])} d={_ints(a['dilation'])} g={a['groups']}"
            f"{' T' + _ints(a['output_padding']) if a['transposed'] else ''} {a['dtype']}"
            + (f" mask={''.join('1' if m else '0' for m in a['output_mask'])}" if a["output_mask"] else ""))


def _fsdp1_full_precision_classes(torch) -> tuple:
    """`MixedPrecision._module_classes_to_ignore` of the installed torch (default `(_BatchNorm,)`)."""
    from torch.distributed.fsdp import MixedPrecision

    return tuple(MixedPrecision(param_dtype=torch.bfloat16)._module_classes_to_ignore)


def _fsdp1_full_precision_modules(torch, model) -> list:
    """(qualified name, module) of the modules FSDP1's mixed precision leaves in full precision, each its own
    unit: instances of `MixedPrecision._module_classes_to_ignore` (default `(_BatchNorm,)`) that own
    parameters, as `_auto_wrap` wraps them (`_wrap_utils.py`; the probes pass an auto-wrap policy)."""
    classes = _fsdp1_full_precision_classes(torch)
    return [(name, m) for name, m in model.named_modules()
            if name and isinstance(m, classes) and any(True for _ in m.parameters(recurse=False))]


def profile_module(factory_path: str, input_shape, dtype: str = "float32") -> dict:
    """`profile_workload` of `factory_path` (PKG.MOD:FACTORY) on one input of `input_shape`."""

    load_factory(factory_path)  # a bad path is a ValueError naming --module
    return profile_workload(FactoryWorkload(factory_path, parse_shape(input_shape)), dtype)


def profile_hf(hf_config: str, micro_batch: int, seq_len: int, dtype: str = "float32",
               layers: int | None = None, device: str = "cpu", attention: str = "sdpa",
               checkpoint_every: int = 0) -> dict:
    """`profile_workload` of a Hugging Face causal LM's config.json at micro_batch x seq_len tokens
    (`attention`: the attn_implementation, workload.HFWorkload; `checkpoint_every`: transformers' own
    checkpointing of every k-th layer, for the step's allocation log)."""

    work = HFWorkload(hf_config, micro_batch, seq_len, layers, attention)
    depth = work.depth()
    if depth <= TRACE_LAYERS:
        return profile_workload(work, dtype, device=device, checkpoint_every=checkpoint_every)
    if checkpoint_every >= 2:  # two kinds of layer: a deeper trace whose log repeats a period of them
        traced = periodic_trace_layers(depth, checkpoint_every)
        if traced >= depth:
            return profile_workload(work, dtype, device=device, checkpoint_every=checkpoint_every)
        shallow = HFWorkload(hf_config, micro_batch, seq_len, traced, attention)
        return _periodic_log(profile_workload(shallow, dtype, device=device, checkpoint_every=checkpoint_every),
                             depth, checkpoint_every, traced)
    shallow = HFWorkload(hf_config, micro_batch, seq_len, TRACE_LAYERS, attention)
    return expand_layers(profile_workload(shallow, dtype, device=device, checkpoint_every=checkpoint_every),
                         depth, work, checkpoint_every)


def profile(work, dtype: str = "float32", device: str = "cpu", checkpoint_every: int = 0) -> dict:
    """The profile of a workload: a Hugging Face model through `profile_hf` (traced at TRACE_LAYERS
    layers and expanded), anything else through `profile_workload`; keeping the bytes `device`'s kernels
    keep (KERNEL_DEVICES). `checkpoint_every`: a module's units checkpointed as the probes do
    (workload.FactoryWorkload.enable_checkpointing), for the step's allocation log; its names as without."""
    if work.kind == "hf":
        return profile_hf(work.hf_config, work.micro_batch, work.seq_len, dtype, work.layers, device,
                          work.attention, checkpoint_every)
    prof = profile_workload(work, dtype, device=device, checkpoint_every=checkpoint_every)
    return _without_wrapper_names(prof) if checkpoint_every else prof


def _without_wrapper_names(prof: dict) -> dict:
    """A checkpointed trace's names as the module's own: `checkpoint_wrapper`'s
    `_checkpoint_wrapped_module.` taken out of its parameters', units' and log markers' names (what
    `ActivationWrapper.named_parameters` does for the wrapper's own)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    def bare(name):
        return name.replace(_CHECKPOINT_PREFIX, "") if isinstance(name, str) else name
    for u in prof["units"]:
        u["name"] = bare(u["name"])
        u["params"] = [[bare(n), s] for n, s in u["params"]]
    prof["fp32_units"] = [bare(n) for n in prof.get("fp32_units", ())]
    prof["construct_names"] = [bare(n) for n in prof.get("construct_names", ())]
    prof["construct_paths"] = [bare(n) for n in prof.get("construct_paths", ())]
    log = prof.get("alloc_log") or {}
    log["events"] = [[e[0], bare(e[1]), *e[2:]] if e[0] >= 3 else e for e in log.get("events", ())]
    log["grads"] = [[i, bare(n)] for i, n in log.get("grads", ())]
    return prof


TRACE_LAYERS = 4
"""Decoder layers traced for a deeper Hugging Face model: the first (it saves the rotary tables the
others share), two middle layers (every middle layer saves what the first of them saves, byte for
byte; the second shows what each layer adds to what the forward holds without saving it: autocast's
cached casts of biases) and the last (the final norm, LM head and loss join its segment);
`expand_layers` repeats the middle one."""


def periodic_trace_layers(depth: int, every: int) -> int:
    """Layers to trace for a `depth`-deep model's allocation log under every-K checkpointing (K = `every`):
    layers 0 .. K, a window of K layers (K + 1 .. 2K) and at least one after it, the last traced one of the
    deep last layer's kind (`_expanded_log`'s `period`)."""
    last = depth - 1
    first_after = 2 * every + 1
    return first_after + (last - first_after) % every + 1


def _layer_names(prefix: str):
    """(renamed(text, old, new): `prefix`.old renumbered to `prefix`.new in a name; layer_of(text): the layer
    number a name has under `prefix`, or None) for the decoder layers' names ("model.layers")."""
    import re

    pat = re.compile(re.escape(prefix) + r"\.(\d+)(?=\.|$)")

    def renamed(text: str, old: int, new: int) -> str:
        return pat.sub(lambda m: f"{prefix}.{new}" if int(m.group(1)) == old else m.group(0), text)

    def layer_of(text: str):
        m = pat.search(text)
        return int(m.group(1)) if m else None
    return renamed, layer_of


def _periodic_log(prof: dict, depth: int, every: int, traced: int) -> dict:
    """The `traced`-deep profile whose allocation log is the `depth`-deep model's under every-K checkpointing
    (`_expanded_log` with period K), for `ModuleDesc.with_checkpointed_log`, which reads only the log; the
    log dropped where it cannot be expanded."""
    layer_units = [u for u in prof["units"] if u["name"] != "root"]
    out = dict(prof)
    out.pop("alloc_log", None)
    if len(layer_units) != traced:
        return out
    renamed, layer_of = _layer_names(layer_units[0]["name"].rsplit(".", 1)[0])
    log = _expanded_log(prof.get("alloc_log") or {}, depth, layer_of, renamed, every, traced)
    if log is not None:
        out["alloc_log"] = log
    return out


def expand_layers(prof: dict, depth: int, work, checkpoint_every: int = 0) -> dict:
    """A TRACE_LAYERS-deep profile as the `depth`-deep model's: the middle layer's unit, segment,
    gradient-ready entries and FLOPs repeated (depth - 2) times, names renumbered. Equal to tracing
    every layer (tests/test_hf_trace.py compares both), at a fraction of the time.

    `checkpoint_every` (the step's allocation log was traced with every k-th layer checkpointed): with k >= 2
    the deep model's middle layers are of two kinds (layer t checkpointed where t % k == 0) while the traced
    middle layer is of one, so the log is not expanded here (with k = 4 the 4 traced layers checkpoint layer 0
    only); `profile_hf` traces such a log deeper and repeats a period of layers (`_periodic_log`)."""
    import copy

    units = prof["units"]
    layer_units = [u for u in units if u["name"] != "root"]
    if len(layer_units) != TRACE_LAYERS or any(s.get("kernels") for s in prof["segments"]):
        return prof
    renamed, layer_of = _layer_names(layer_units[0]["name"].rsplit(".", 1)[0])  # "model.layers"

    last = depth - 1
    # traced layer -> the layers it stands for; traced layer 2 only measures the per-layer growth
    mapping = {0: [0], 1: list(range(1, last)), 2: [], 3: [last]}
    fwd = {layer_of(sg["unit"]): sg["forward_bytes"] for sg in prof["segments"]
           if sg["unit"] not in ("root", "loss")}
    grow = fwd[2] - fwd[1]  # autocast's cache of bias casts: one more layer's each layer
    ufwd = {layer_of(sg["unit"]): sg.get("unit_forward_bytes", 0) for sg in prof["segments"]
            if sg["unit"] not in ("root", "loss")}
    ugrow = ufwd[2] - ufwd[1]  # the same cache, in the unit's own forward peak

    def shifted(sgm: dict, j: int, i: int) -> dict:
        layers = (i - 1) if j == 1 else ((depth - TRACE_LAYERS) if j == 3 else 0)
        out_ = {**sgm, "unit": renamed(sgm["unit"], j, i), "forward_bytes": sgm["forward_bytes"] + layers * grow}
        if "unit_forward_bytes" in sgm:
            out_["unit_forward_bytes"] = sgm["unit_forward_bytes"] + layers * ugrow
        return out_

    out = copy.deepcopy(prof)
    new_units = []
    for u in units:
        j = layer_of(u["name"]) if u["name"] != "root" else None
        if j is None:
            new_units.append(u)
            continue
        for i in mapping[j]:
            new_units.append({**u, "name": renamed(u["name"], j, i),
                              "params": [[renamed(n, j, i), sh] for n, sh in u["params"]]})
    out["units"] = new_units
    segs = []
    for sgm in prof["segments"]:
        j = layer_of(sgm["unit"]) if sgm["unit"] not in ("root", "loss") else None
        if j is None:
            segs.append(sgm)
        else:
            segs.extend(shifted(sgm, j, i) for i in mapping[j])
    out["segments"] = segs
    ready, run = [], []

    def flush():
        if run:
            j = layer_of(run[0][0])
            for i in sorted(mapping[j], reverse=True):  # backward reaches deeper layers first
                ready.extend([renamed(n, j, i), k] for n, k in run)
            run.clear()
    for n, k in prof.get("grad_ready", ()):
        j = layer_of(n)
        if j is None:
            flush()
            ready.append([n, k])
        else:
            if run and layer_of(run[0][0]) != j:
                flush()
            run.append([n, k])
    flush()
    out["grad_ready"] = ready
    # the construction and the step's allocations, the middle layer's repeated (`_expanded_log`)
    construct = [(p, n, nm, b) for p, n, nm, b in zip(prof.get("construct_paths", ()), prof.get("construct_bytes", ()),
                                                     prof.get("construct_names", ()), prof.get("construct_built", ()))]
    expanded_construct = []
    runs: list = []  # consecutive entries of one layer (`Module._apply` moves a child's tensors together)
    for entry in construct:
        j = layer_of(entry[0])
        if runs and runs[-1][0] == j:
            runs[-1][1].append(entry)
        else:
            runs.append((j, [entry]))
    for j, run in runs:
        expanded_construct.extend(run if j is None else [(renamed(p, j, i), n, renamed(nm, j, i), b)
                                                         for i in mapping[j] for p, n, nm, b in run])
    log = _expanded_log(prof.get("alloc_log") or {}, depth, layer_of, renamed) if checkpoint_every < 2 else None
    if log is not None and [(e[1], e[3]) for e in construct if layer_of(e[0]) == 1] == [
            (e[1], e[3]) for e in construct if layer_of(e[0]) == 2]:
        for key, k in (("construct_paths", 0), ("construct_bytes", 1), ("construct_names", 2), ("construct_built", 3)):
            out[key] = [e[k] for e in expanded_construct]
        out["alloc_log"] = log
    else:  # (not a stack of identical layers: no allocation log, the plan's reserved peak is the margin's)
        for key in ("construct_paths", "construct_bytes", "construct_names", "construct_built", "alloc_log"):
            out.pop(key, None)
    extra = depth - TRACE_LAYERS
    out["params"] = prof["params"] + extra * layer_units[1]["numel"]
    out["activation_bytes"] = sum(s["activation_bytes"] for s in segs)
    out["forward_flops"] = prof["forward_flops"] + extra * prof.get("layer_flops", 0)
    out["workload"] = work.to_spec()
    out["factory"] = work.label
    out["traced_layers"] = TRACE_LAYERS
    return out


def _frees_in_order(events: list) -> list:
    """`events` with each run of consecutive frees in allocation (id) order. Which op's end finds a storage
    gone can differ between fake and real tensors (the same frees, one op apart); the caching allocator's
    state after a run of frees does not depend on their order (a freed block merges with its free
    neighbours, whichever went first), so a log is kept in this one order."""
    out: list = []
    run: list = []
    for e in events:
        if e[0] == 0:
            run.append(e)
            continue
        out.extend(sorted(run, key=lambda f: f[1]))
        run = []
        out.append(e)
    out.extend(sorted(run, key=lambda f: f[1]))
    return out


def _post_backward_first(events: list) -> list:
    """`events` with a unit's inputs' gradient ([6, unit]) ahead of the unit before it's outputs' gradient
    ([5, unit]) where the two are one tensor's (nothing between them). The trace hooks both on that tensor,
    the earlier unit's first; FSDP2 passes a unit's inputs through `RegisterPostBackwardFunction`
    (_fully_shard/_fsdp_state.py `_pre_forward` -> _fsdp_param_group.py `_register_post_backward_hook`), whose
    backward runs before the gradient reaches the tensor's own hooks, so its post-backward comes first."""
    out = list(events)
    for i in range(len(out) - 1):
        if out[i][0] == 5 and out[i + 1][0] == 6:
            out[i], out[i + 1] = out[i + 1], out[i]
    return out


def _expanded_log(log: dict, depth: int, layer_of, renamed, period: int = 1,
                  traced: int = TRACE_LAYERS) -> dict | None:
    """A TRACE_LAYERS-deep step's allocation log (`_SegmentTracker.log`) as the `depth`-deep model's, or None
    where it cannot be said so. Each event belongs to a layer's region -- its forward from its pre-forward to
    its post-forward marker ([3, unit] .. [4, unit]), its backward from its outputs' gradient ([5, unit]) to
    the next layer's (the first layer's: to its inputs' gradient, [6, unit]) -- or to the root's ops between
    them (a layer's forward runs on to the next one's, the last one's to the root's post-forward: the final
    norm, the head and the loss). Traced layer 2's regions are repeated for layers 2 .. depth - 2 (deeper layers first in backward),
    layer 3's stand for the last. A tensor is named by its layer and its place among that region's
    allocations; an event of a region that frees (or a marker that names) another layer's tensor names the
    one at the same offset from the region's layer as traced (a layer's backward frees the input the
    layer before it passed it, and the gradient the layer after it passed back). The root's ops free every
    copy of a middle layer's tensor (autocast's cache at the end of the forward). Ids are renumbered in
    allocation order and each run of frees is in that order, as `close_log` lists them; equal to tracing
    every layer (tests/test_hf_trace.py). None when the repeated layers' allocations differ in size, or a
    repeated region frees a tensor of the root or names a layer past the ends.

    `period` P, `traced` T (every-K checkpointing, P = K: the deep model's layers are of P kinds by t % P):
    the T traced layers are layers 0 .. P kept as they are, a window of P layers W = P + 1 .. 2P repeated
    periodically (deep layer t >= P + 1 is window layer P + 1 + (t - P - 1) % P, the same kind), the traced
    layers after the window only as its neighbours, and the last traced layer (of the deep last layer's kind)
    as the last. P = 1, T = 4 is the scheme above."""
    events = log.get("events")
    if not events:
        return None
    x = _LogExpansion(depth, layer_of, renamed, period, traced)
    x.tag_regions(events)
    if not x.repeats_alike():
        return None
    if not x.group_blocks():
        return None
    try:
        out = x.deep_events()
    except (LookupError, KeyError):
        return None
    return x.renumbered(out, log)


class _LogExpansion:
    """`_expanded_log`'s state: the layer scheme (`period`, `traced`, the deep model's `last` layer), each
    event's region, each traced allocation's owner (region and place, or the root) and each region's
    allocation sizes in order."""

    def __init__(self, depth: int, layer_of, renamed, period: int, traced: int):
        self.layer_of, self.renamed, self.period = layer_of, renamed, period
        self.last = depth - 1
        self.w0, self.m_last = period + 1, traced - 1  # the window's first traced layer, the last traced layer
        # traced layer -> its layer in the deep model (the window's: w0 .. last - 1, by kind)
        self.target = {**{j: j for j in range(self.w0)}, self.m_last: self.last}

    def tmpl(self, j: int) -> int:  # the window layer a traced (or deep) layer j >= w0 repeats, by its kind
        return self.w0 + (j - self.w0) % self.period

    def tag_regions(self, events: list) -> None:
        """`tagged`: (region (kind, traced layer) or None, event) of each event; `owner`: traced id -> (kind,
        traced layer, place) or ("root", id); `sizes`: (kind, traced layer) -> the region's allocation sizes in order."""
        region = None
        tagged = []  # (region (kind, traced layer) or None, event)
        backward = False  # (a checkpointed layer's recomputation runs its forward hooks again inside its backward)
        for e in events:
            j = self.layer_of(e[1]) if e[0] >= 3 and isinstance(e[1], str) else None
            backward = backward or e[0] == 5
            if e[0] == 3 and j is not None and not backward:
                region = ("F", j)
            elif e[0] == 5 and j is not None:
                region = ("B", j)
            if e[0] == 4 and e[1] == "root":
                region = None
            tagged.append((region, e))
            if e[0] == 6 and j == 0:
                region = None
        owner: dict = {}  # traced id -> (kind, traced layer, place) or ("root", id)
        sizes: dict = {}  # (kind, traced layer) -> the region's allocation sizes in order
        for r, e in tagged:
            if e[0] == 1:
                if r is None:
                    owner[e[1]] = ("root", e[1])
                else:
                    got = sizes.setdefault(r, [])
                    owner[e[1]] = (r[0], r[1], len(got))
                    got.append(e[2])
        self.tagged, self.owner, self.sizes = tagged, owner, sizes

    def repeats_alike(self) -> bool:
        """Whether the repeated layers' allocations are alike in size."""
        sizes, w0, period, m_last = self.sizes, self.w0, self.period, self.m_last
        for kind in ("F", "B"):  # (the last layer's forward goes on with the root's ops after it: the head, the loss)
            for j in range(w0, w0 + period):  # each window layer as the layer of its kind one period before
                middle = sizes.get((kind, j))
                if not middle or sizes.get((kind, j - period)) != middle:
                    return False
            if any(sizes.get((kind, u)) != sizes.get((kind, self.tmpl(u))) for u in range(w0 + period, m_last)):
                return False
            middle = sizes[(kind, self.tmpl(m_last))]
            if sizes.get((kind, m_last), [])[:len(middle)] != middle:
                return False
        return True

    def layers(self, j: int) -> list:  # the deep model's layers traced layer j stands for, in forward order
        if j < self.w0 or j == self.m_last:
            return [self.target[j]]
        return [t for t in range(self.w0, self.last) if self.tmpl(t) == j] if j < self.w0 + self.period else []

    def source(self, t: int) -> int:  # the traced layer whose tensors layer t's are
        return t if t < self.w0 else self.m_last if t == self.last else self.tmpl(t)

    def name(self, x, t: int):  # the deep model's tensor: x (traced) of layer t
        o = self.owner[x]
        if o[0] == "root":
            return o
        src = self.sizes.get((o[0], self.source(t)), ())
        if not 0 <= t <= self.last or o[2] >= len(src) or src[o[2]] != self.sizes[(o[0], o[1])][o[2]]:
            raise LookupError
        return (o[0], t, o[2])

    def group_blocks(self) -> bool:
        """`blocks`: (region, its events), consecutive; `by_region`: region -> its block. False where a
        region's events are not one run."""
        blocks: list = []  # (region, its events), consecutive
        for r, e in self.tagged:
            if blocks and blocks[-1][0] == r:
                blocks[-1][1].append(e)
            else:
                blocks.append((r, [e]))
        by_region: dict = {}
        for r, block in blocks:
            if r is not None:
                if r in by_region:
                    return False
                by_region[r] = block
        self.blocks, self.by_region = blocks, by_region
        return True

    def emitted(self, r) -> list:
        """(region, deep layer, events) to write where region r's events stand: a layer kept as traced or the
        last as itself; at the window's first region in run order (forward: its first layer; backward, which
        reaches deeper layers first: its last), every window copy in deep-layer order, each its kind's region;
        the window's other regions and the neighbours after it nothing."""
        kind, j = r
        w0, last = self.w0, self.last
        if j < w0 or j == self.m_last:
            return [(r, self.target[j], self.by_region[r])]
        if j != (w0 if kind == "F" else w0 + self.period - 1):
            return []
        deep = range(w0, last) if kind == "F" else range(last - 1, w0 - 1, -1)
        return [((kind, self.tmpl(t)), t, self.by_region[(kind, self.tmpl(t))]) for t in deep]

    def run(self):  # (region, deep layer, event) in the deep model's order
        for r0, block0 in self.blocks:
            for r, t, block in (self.emitted(r0) if r0 is not None else [(None, None, block0)]):
                for e in block:
                    yield r, t, e

    def deep_events(self) -> list:
        """The deep model's events, tensors named (kind, deep layer, place) or ("root", id); raises
        LookupError where a repeated region frees a tensor of the root or names a layer past the ends."""
        layer_of, renamed, owner, name = self.layer_of, self.renamed, self.owner, self.name
        out: list = []
        for r, t, e in self.run():
            shift = 0 if r is None else t - r[1]
            if e[0] == 1:
                out.append((1, name(e[1], t) if r is not None else owner[e[1]], e[2]))
            elif e[0] == 0:
                o = owner.get(e[1])
                if o is None:  # (not made in the step: never logged)
                    continue
                if o[0] == "root":
                    if r is not None and self.w0 <= r[1] < self.w0 + self.period:  # (a repeated region)
                        raise LookupError
                    out.append((0, o))
                elif r is None:  # every copy's, where a middle layer's
                    out.extend((0, name(e[1], t_)) for t_ in self.layers(o[1]))
                else:
                    out.append((0, name(e[1], o[1] + shift)))
            elif e[0] >= 3 and isinstance(e[1], str) and layer_of(e[1]) is not None and r is not None:
                m = layer_of(e[1]) + shift
                if not 0 <= m <= self.last:
                    raise LookupError
                out.append((e[0], renamed(e[1], layer_of(e[1]), m)))
            elif e[0] >= 3 and isinstance(e[1], str) and layer_of(e[1]) is not None:
                out.append((e[0], renamed(e[1], layer_of(e[1]), self.target.get(layer_of(e[1]), layer_of(e[1])))))
            else:
                out.append(tuple(e))
        return out

    def renumbered(self, out: list, log: dict) -> dict:
        """{"events", "kept", "grads"} as `close_log`'s, ids renumbered in allocation order."""
        layer_of, renamed = self.layer_of, self.renamed
        ids: dict = {}
        for e in out:
            if e[0] == 1:
                ids[e[1]] = len(ids) + 1
        events_out = _frees_in_order([[1, ids[e[1]], e[2]] if e[0] == 1 else [0, ids[e[1]]] if e[0] == 0 else list(e)
                                      for e in out])

        def every(x):  # the deep model's tensors of traced id x that outlive the step (each middle layer's)
            o = self.owner.get(x)
            if o is None or o[0] == "root":
                return [(o, None)] if o is not None else []
            return [((o[0], t, o[2]), t) for t in self.layers(o[1])]
        kept = sorted(ids[n] for x in log.get("kept", ()) for n, _ in every(x) if n in ids)
        grads = sorted([ids[n], renamed(g, layer_of(g), t) if t is not None and layer_of(g) is not None else g]
                       for x, g in log.get("grads", ()) for n, t in every(x) if n in ids)
        return {"events": events_out, "kept": kept, "grads": grads}


def user_code_error(flag: str, label: str, what: str, exc: BaseException) -> ValueError:
    """The one-line error for user code (a factory, a module's forward) that raised or ended the
    process: `sys.exit()` there must not end distplan silently."""
    if isinstance(exc, SystemExit):
        return ValueError(f"{flag}={label!r}: {what} called sys.exit({exc.code!r})")
    text = str(exc).splitlines()[0] if str(exc) else ""
    return ValueError(f"{flag}={label!r}: {what} raised {type(exc).__name__}: {text}"[:400])


def check_factory(factory_path: str, input_shape, path: str | None = None) -> None:
    """Before any probe runs, what `distplan estimate --module` does: import the factory, build the
    model and run one forward and backward on fake tensors (no memory, no weights touched). ValueError
    (one line, naming --module) when the factory or the model raises or calls sys.exit(), returns no
    nn.Module, or has no parameters."""

    load_factory(factory_path)
    profile_workload(FactoryWorkload(factory_path, parse_shape(input_shape), path), "float32")


def _check_model(torch, model, flag: str, label: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{flag}={label!r}: the factory returned {type(model).__name__}, not an nn.Module")
    if not any(True for _ in model.parameters()):
        raise ValueError(f"{flag}={label!r}: the model has no parameters: nothing to train, shard or "
                         f"synchronise")


def profile_workload(work, dtype: str = "float32", fake: bool = True, device: str = "cpu",
                     checkpoint_every: int = 0) -> dict:
    """`_profile_workload`, with user code that ends the process (`sys.exit`) or raises a
    BaseException turned into a one-line ValueError naming the flag (KeyboardInterrupt passes)."""
    try:
        return _profile_workload(work, dtype, fake, device, checkpoint_every)
    except (KeyboardInterrupt, Exception):
        raise
    except BaseException as exc:  # SystemExit, GeneratorExit, a user's BaseException subclass
        flag = "--hf-config" if work.kind == "hf" else "--module"
        raise user_code_error(flag, work.label, "the model", exc) from None


def _profile_workload(work, dtype: str = "float32", fake: bool = True, device: str = "cpu",
                      checkpoint_every: int = 0) -> dict:
    """Parameters (per wrapping unit), saved-activation bytes, output bytes and forward FLOPs of a
    workload (`planner.workload.traced_model`: a factory's module, or a Hugging Face causal LM).

    Returns a dict in base units: {"factory", "module_class", "input_shape", "dtype", "params": int,
    "param_bytes_dtype": int, "units": [{"name", "params": [[name, shape], ...], "numel"}],
    "tied": [numel of each parameter reached under more than one name], "buffers_bytes", "activation_bytes",
    "output_bytes", "output_shape", "loss",
    "segments": [{"unit", "activation_bytes", "input_bytes"}, ...] (forward order; "root" first,
    "loss" last), "forward_flops", "profile_s"}.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: accepted values are {', '.join(_DTYPES)}")
    if device not in KERNEL_DEVICES:
        raise ValueError(f"device={device!r}: accepted values are {', '.join(KERNEL_DEVICES)}")
    t0 = time.perf_counter()
    autocast = dtype.startswith("autocast-")
    fsdp_mixed = dtype.startswith(("fsdp-", "fsdp1-"))  # FSDP's mixed precision: the root casts the batch
    tdtype = getattr(torch, dtype.split("-")[-1])
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        model, full_precision, built_bytes = _built_model(torch, work, dtype, tdtype, checkpoint_every)
        model.train()
        unit_modules = work.units(model)
        owner = {}
        for uname, um in full_precision + unit_modules:  # a BatchNorm's parameters are its own unit's
            for p in um.parameters():
                owner.setdefault(id(p), uname)
        units, param_keys, tied = _parameters_by_unit(model, owner)
        buffers, buffer_dtypes = _buffer_bytes_by_dtype(model)
        construct = _construct_order(model, built_bytes)
        n_params = sum(u["numel"] for u in units.values())
        pbytes = next(iter(model.parameters())).element_size() if n_params else 4

        inputs = work.inputs(torch, torch.float32 if autocast or fsdp_mixed else tdtype)
        rec = _ForwardRecorder(torch, model, inputs, param_keys, {name for name, _ in unit_modules})
        root_handles = rec.hook_root(model, tdtype if fsdp_mixed else None)
        handles = rec.hook_units(work.segment_modules(model), full_precision)
        loss, loss_kind, out, ready = _traced_step(torch, work, model, rec, inputs, handles + root_handles, owner,
                                                   device, autocast, tdtype, checkpoint_every)
        out_bytes = out.numel() * out.element_size()
        out_shape = list(out.shape)
        backward = _backward_peaks(rec.bwd)
        census = _kept_segment_census(rec.segments, units, rec.bwd)
        del loss, out
        alloc_log = rec.bwd.close_log()
        fwd_flops, layer_flops = _forward_flops(census, rec.segments, unit_modules)
    return {
        "factory": work.label,
        "workload": work.to_spec(),
        "module_class": type(model).__name__,
        "input_shape": list(tuple(work.input_shape)),
        "dtype": dtype,
        "kernels_of": device,
        "params": int(n_params),
        "param_bytes_dtype": int(pbytes),
        "units": list(units.values()),
        "tied": tied,
        "buffers_bytes": int(buffers),
        "buffers": [[d, sizes] for d, sizes in buffer_dtypes.items()],
        "activation_bytes": int(sum(rec.saved.values())),
        "batch_bytes": int(rec.batch_bytes),
        "output_bytes": int(out_bytes),
        "output_shape": out_shape,
        "segments": _segment_records(rec, units, backward, census),
        "loss": loss_kind,
        "grad_ready": ready,
        "linear_bias": rec.bwd.linear_bias,
        "batchnorm": any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()),
        "fp32_units": [name for name, _ in full_precision],
        "forward_flops": fwd_flops,
        "layer_flops": layer_flops,
        # the parameters' and buffers' bytes in the order `model.to(device)` allocates them
        # (`Module._apply`: the children first, then the module's own parameters, then its buffers), and the
        # step's allocations (`_SegmentTracker.log`)
        **construct, "alloc_log": alloc_log,
        "profile_s": time.perf_counter() - t0,
    }


def _built_model(torch, work, dtype: str, tdtype, checkpoint_every: int) -> tuple:
    """The workload's model as the trace runs it: built (user code: what it raises, one line naming the
    flag), checkpointed as the probes apply it, cast to the run's dtype. Returns (model, full_precision:
    [(name, module)] kept in fp32 by FSDP1's mixed precision, built_bytes: {id(tensor): bytes as built})."""
    factory_path = work.label
    autocast = dtype.startswith("autocast-")
    flag = "--hf-config" if work.kind == "hf" else "--module"
    try:
        model = work.build()
    except ValueError as exc:
        raise ValueError(str(exc).splitlines()[0][:300]) from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - user code; SystemExit too
        raise user_code_error(flag, factory_path, "building the model" if work.kind == "hf" else "the factory",
                              exc) from None
    _check_model(torch, model, flag, factory_path)
    if checkpoint_every:
        # as the probes apply it (validate/probe.py; a transformers model: its own): only the step's log is of use from such a trace (its
        # recomputations in backward, in host order); the rest of the profile is a checkpointed run's
        work.enable_checkpointing(model, work.units(model), checkpoint_every)
    # FSDP1 under mixed precision wraps each module of these classes apart, in full precision
    # (`fsdp/wrap.py` `_wrap_module_cls_individually` with `mixed_precision=None`)
    full_precision = _fsdp1_full_precision_modules(torch, model) if dtype.startswith("fsdp1-") else []
    kept32 = {id(t) for _, m in full_precision for t in list(m.parameters()) + list(m.buffers())}
    # each parameter's and buffer's bytes as the factory built them (before the casts below): pure
    # 16-bit training builds the module so and casts it after `model.to(device)`
    built_bytes = {id(t): int(t.numel() * t.element_size())
                   for t in list(model.parameters()) + list(model.buffers())}
    if not autocast and tdtype != torch.float32:
        # Module.to() swaps tensors, which fake tensors refuse; assigning .data casts in place.
        # FSDP's mixed precision casts parameters only; a module's own `.to(dtype)` casts buffers too
        # (FSDP1's `buffer_dtype` too, the probes' MixedPrecision(buffer_dtype=param_dtype)).
        casts = list(model.parameters()) + ([] if work.kind == "hf" else list(model.buffers()))
        for t in casts:
            if t.is_floating_point() and id(t) not in kept32:
                t.data = t.data.to(tdtype)
    if full_precision:
        from torch.distributed.fsdp._common_utils import _override_module_mixed_precision
        # the forward pre- and post-hooks FSDP1 registers on them: the input cast to fp32, the output
        # back to the input's dtype
        _override_module_mixed_precision(model, _fsdp1_full_precision_classes(torch))
    return model, full_precision, built_bytes


def _parameters_by_unit(model, owner: dict) -> tuple:
    """(units: {unit: {"name", "params": [[name, shape], ...], "numel"}}, the parameters' storage keys,
    tied: [numel of each parameter reached under more than one name])."""
    # Parameters, once each (tied weights), grouped by the unit that owns them.
    seen: set = set()
    units: dict[str, dict] = {}
    param_keys = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        param_keys.add(_storage_key(p))
        unit = owner.get(id(p), "root")
        u = units.setdefault(unit, {"name": unit, "params": [], "numel": 0})
        u["params"].append([name, list(p.shape)])
        u["numel"] += p.numel()
    # Tied parameters (an embedding shared with the LM head): reached under more than one name.
    names_of: dict = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        names_of[id(p)] = names_of.get(id(p), 0) + 1
    tied = [int(p.numel()) for p in model.parameters() if p.requires_grad and names_of[id(p)] > 1]
    return units, param_keys, tied


def _buffer_bytes_by_dtype(model) -> tuple:
    """(the buffers' bytes, {dtype name: [each buffer's bytes]})."""
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    buffer_dtypes: dict = {}  # DDP broadcasts buffers per dtype (module_plan.module_collectives)
    for b in model.buffers():
        key = str(b.dtype).replace("torch.", "")
        buffer_dtypes[key] = buffer_dtypes.get(key, []) + [int(b.numel() * b.element_size())]
    return buffers, buffer_dtypes


def _construct_order(model, built_bytes: dict) -> dict:
    """The parameters' and buffers' bytes in the order `model.to(device)` allocates them: {"construct_bytes",
    "construct_names", "construct_built", "construct_paths"}, one entry per tensor in each."""
    construct: list = []
    construct_names: list = []  # each one's parameter name ("" for a buffer)
    construct_built: list = []  # each one's bytes as built
    construct_paths: list = []  # each one's qualified name, a buffer's too (expand_layers repeats a layer's)
    moved: set = set()
    param_name = {id(p): n for n, p in model.named_parameters()}
    tensor_path = {**{id(b): n for n, b in model.named_buffers()}, **param_name}

    def apply_order(mod) -> None:
        for child in mod.children():
            apply_order(child)
        for t in list(mod._parameters.values()) + list(mod._buffers.values()):
            if t is not None and id(t) not in moved:
                moved.add(id(t))
                construct.append(int(t.numel() * t.element_size()))
                construct_names.append(param_name.get(id(t), ""))
                construct_built.append(built_bytes.get(id(t), construct[-1]))
                construct_paths.append(tensor_path.get(id(t), ""))
    apply_order(model)
    return {"construct_bytes": construct, "construct_names": construct_names, "construct_built": construct_built,
            "construct_paths": construct_paths}


class _ForwardRecorder:
    """The forward's segments as the traced step runs, and what autograd saves in each (`pack`).

    Segments of the forward in execution order: each unit's call starts one; what the root
    computes between units (functional relu, flatten; a decoder's final norm and head) joins the
    segment before it. The units' hook points go to the step's log (`_SegmentTracker`, `bwd`)."""

    def __init__(self, torch, model, inputs, param_keys: set, unit_names: set):
        from torch.utils._pytree import tree_leaves

        self._torch, self._leaves = torch, tree_leaves
        self.unit_names = unit_names
        self.batch_bytes = sum(t.numel() * t.element_size() for t in inputs)
        self.saved: dict = {}
        self.segments: list[dict] = [{"unit": "root", "activation_bytes": 0, "input_bytes": int(self.batch_bytes)}]
        self.bwd = _SegmentTracker(torch)
        self.bwd.forward_segment = lambda: len(self.segments) - 1
        self.shared_ids: dict = {}
        self.in_keys: dict = {}  # the running unit's segment index -> its input's storage key (first positional tensor)
        self.fp32_started: set = set()
        # The input batch is not an activation: it exists before the forward and after it (the probes'
        # tracker and the planner count it as a temporary, `batch_bytes`); nor are buffers (BatchNorm
        # saves its running statistics for backward; the planner counts them with the parameters).
        self.batch_keys = {_storage_key(x) for x in inputs}
        self.not_activations = param_keys | self.batch_keys | {_storage_key(b) for b in model.buffers()}
        self.bwd.not_activations = self.not_activations

    def hook_root(self, model, cast_to=None) -> list:
        """The root's FSDP hooks in the log (after FSDP's cast of the batch, before the units'), their
        handles; `cast_to` (FSDP's mixed precision): the root casts its floating inputs to that dtype."""
        bwd = self.bwd
        root_handles = [model.register_forward_pre_hook(lambda *_: bwd.log_marker(3, "root"), prepend=True),
                        model.register_forward_hook(lambda *_: bwd.log_marker(4, "root"))]
        if cast_to is not None:
            torch = self._torch

            def cast_root_inputs(_mod, args, kwargs):
                cast = lambda t: t.to(cast_to) if t.is_floating_point() and t.dtype != cast_to else t  # noqa: E731
                return (tuple(cast(a) if isinstance(a, torch.Tensor) else a for a in args),
                        {k: cast(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
            # first of the root's pre-hooks (FSDP's own runs before the module's forward)
            model.register_forward_pre_hook(cast_root_inputs, prepend=True, with_kwargs=True)
        return root_handles

    def hook_units(self, seg_modules: list, full_precision: list) -> list:
        """Each segment module's pre- and post-forward hooks (and FSDP1's fp32 units'), their handles."""
        handles = [m.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True) for name, m in seg_modules]
        for name, mod in full_precision:
            handles += self._fp32_unit_hooks(name, mod)
        handles += [m.register_forward_hook(self._post_hook(name)) for name, m in seg_modules]
        return handles

    def _pre_hook(self, name):
        torch, tree_leaves, segments, bwd = self._torch, self._leaves, self.segments, self.bwd

        def hook(_mod, args, kwargs):
            # The unit's input: its first positional tensor (a decoder layer's hidden states).
            inp = sum(a.numel() * a.element_size() for a in args[:1] if isinstance(a, torch.Tensor))
            # The unit's other tensor inputs (a decoder layer's attention mask, RoPE cos/sin and
            # position ids, passed by keyword, or GPT-2's mask by position): shared by the units, and what
            # a checkpointed unit's recompute closure keeps alive (`torch.utils.checkpoint`, non-reentrant)
            # until its backward; counted once, however many units are given them (a positional one was
            # counted in every unit's input as well: GPT-2 with eager attention's (B, 1, S, S) mask,
            # one per layer, where the run keeps one).
            first = {_storage_key(a) for a in args[:1] if isinstance(a, torch.Tensor)}
            self.in_keys.clear()  # while the unit runs (its input is alive, so its storage key is its own)
            self.in_keys[len(segments)] = first
            shared = []
            for t in tree_leaves((args[1:], kwargs)):
                if isinstance(t, torch.Tensor):
                    k = _storage_key(t)
                    if k not in self.not_activations and k not in first:
                        idx = self.shared_ids.setdefault(k, len(self.shared_ids))
                        if all(i != idx for i, _ in shared):
                            shared.append([idx, int(_storage_nbytes(t))])
            segments.append({"unit": name, "activation_bytes": 0, "input_bytes": int(inp),
                             "shared_inputs": shared,
                             # the batch itself (a temporary, not what a checkpointed unit keeps anew)
                             "input_is_batch": bool(first & self.batch_keys),
                             # saved already by the ops before (a ReLU's output): an activation, not
                             # a checkpointed forward's transient output
                             "input_already_saved": any(k_ in self.saved for k_ in first)})
            unit = name if name in self.unit_names else None
            bwd.log_marker(3, unit)
            bwd.mark_input(args, len(segments) - 1, unit)
        return hook

    def _post_hook(self, name):
        return lambda mod, args, out: self._after_unit(name if name in self.unit_names else None, out)

    def _after_unit(self, unit, out):
        torch, tree_leaves, segments, bwd = self._torch, self._leaves, self.segments, self.bwd
        self.in_keys.clear()  # the root's ops after the unit: a freed input's key may be another storage's
        bwd.log_marker(4, unit)
        bwd.mark_output(tree_leaves(out), len(segments) - 1, unit)
        # what the unit's own call saved; the rest of the segment's saved bytes are the root's ops
        # after it (kept under a unit's activation checkpointing)
        segments[-1]["unit_bytes"] = segments[-1]["activation_bytes"]
        # the unit's own kernels (what a checkpointed unit runs again in backward), before the root's ops
        # after it join its segment
        segments[-1]["unit_census"] = bwd.census.of(len(segments) - 1, "forward")
        # what a checkpointed unit's recomputation holds at its peak: the unit's own forward peak (less
        # the earlier segments' saved tensors, as `forward_bytes`) and its output
        idx = len(segments) - 1
        segments[-1]["unit_forward_bytes"] = int(max(0, bwd.fwd_peak.get(idx, 0)
                                                     - sum(x["activation_bytes"] for x in segments[:idx])))
        segments[-1]["unit_output_bytes"] = int(sum(_storage_nbytes(t) for t in tree_leaves(out)
                                                    if isinstance(t, torch.Tensor)))

    def _fp32_unit_hooks(self, name, mod) -> list:
        """FSDP1's own units of the BatchNorm modules (inside a unit): their hooks in the log too."""
        torch, tree_leaves, bwd, fp32_started = self._torch, self._leaves, self.bwd, self.fp32_started

        def after(_m, _a, out):
            bwd.log_marker(4, name)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda _g: bwd.log_marker(5, name) if name not in fp32_started
                                    else None)
                    t.register_hook(lambda _g: fp32_started.add(name))
        return [mod.register_forward_pre_hook(lambda *_: bwd.log_marker(3, name), prepend=True),
                mod.register_forward_hook(after)]

    def pack(self, t):
        """`saved_tensors_hooks`' pack: each storage autograd saves, counted once, in the running segment."""
        segments, saved = self.segments, self.saved
        k = _storage_key(t)
        if k not in self.not_activations and k not in saved:
            saved[k] = _storage_nbytes(t)
            segments[-1]["activation_bytes"] += saved[k]
            if k in self.in_keys.get(len(segments) - 1, ()):
                # the unit saves its own input (an RMSNorm's `x.to(float32)` of fp32 hidden states, a
                # LayerNorm's input): under checkpointing the recompute saves the kept input again,
                # not a copy of it
                segments[-1]["input_saved_bytes"] = segments[-1].get("input_saved_bytes", 0) + saved[k]
            self.bwd.mark_saved(t.untyped_storage(), saved[k], len(segments) - 1)
        return t


def _traced_step(torch, work, model, rec: _ForwardRecorder, inputs, handles: list, owner: dict, device: str,
                 autocast: bool, tdtype, checkpoint_every: int) -> tuple:
    """One forward, the loss and the backward on the trace's tensors, recorded by `rec`: (loss, loss kind,
    output, grad_ready: [[parameter name, numel], ...] in the order their gradients are accumulated)."""
    factory_path, shape = work.label, tuple(work.input_shape)
    segments, bwd = rec.segments, rec.bwd
    # over the forward and the backward (the grouped GEMMs' gradients)
    with _grouped_mm_any_dtype(torch):
        try:
            with work.trace_context(), _cuda_kernels(torch) if device == "cuda" else contextlib.nullcontext(), \
                    _quiet_fake_tensor_log(), bwd.forward_mode, \
                    torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t), \
                    torch.autocast("cpu", dtype=tdtype, enabled=autocast):
                loss, loss_kind, out = work.loss(model, inputs)
                if not isinstance(out, torch.Tensor):
                    raise TypeError(f"the forward returned {type(out).__name__}; profile needs a tensor output")
                for h in handles:
                    h.remove()
                if out.requires_grad:  # the root's pre-backward (FSDP's hook on the root's outputs)
                    out.register_hook(lambda _g: bwd.log_marker(5, "root"))
                segments.append({"unit": "loss", "activation_bytes": 0,
                                 "input_already_saved": _storage_key(out) in rec.saved,
                                 "input_bytes": out.numel() * out.element_size()})
                bwd.mark_input((out,), len(segments) - 1)
            # The backward on the same fake tensors: the peak of the bytes it creates and frees within
            # each segment (activation gradients; parameters' gradients, which outlive it, excluded).
            # The order the parameters' gradients become ready in is recorded too: DDP rebuilds its
            # buckets in that order after the first iteration (`Reducer::rebuild_buckets`).
            ready, hooks = _record_grad_ready(model, owner, bwd)
            # (a checkpointed unit's recomputation runs the forward's kernels again: CUDA's, as traced)
            with _cuda_kernels(torch) if device == "cuda" and checkpoint_every else contextlib.nullcontext():
                if loss.requires_grad:
                    bwd.run(loss, len(segments))
            for h in hooks:
                h.remove()
        except ValueError:
            raise
        except Exception as exc:
            what = "--input-shape=" + ",".join(map(str, shape)) if work.kind != "hf" else f"--hf-config={factory_path!r}"
            raise ValueError(f"{what}: the forward of {factory_path} "
                             f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    return loss, loss_kind, out, ready


def _record_grad_ready(model, owner: dict, bwd) -> tuple:
    """(ready: [[name, numel], ...] filled as the backward accumulates each parameter's gradient, the hooks'
    handles). Each accumulation is marked in `bwd`; a unit's last one logs FSDP1's post-backward [7, unit]."""
    ready: list = []
    hooks = []
    seen_ready: set = set()
    # per unit, its parameters whose gradient is not accumulated yet: when none is left, FSDP1's
    # flat parameter's AccumulateGrad runs its post-backward hook ([7, unit] in the log)
    pending: dict = {}
    for _, p in model.named_parameters():
        if p.requires_grad:
            pending.setdefault(owner.get(id(p), "root"), set()).add(id(p))
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen_ready:
            seen_ready.add(id(p))
            def on_ready(t, name=name) -> None:
                ready.append([name, int(t.numel())])
                bwd.mark_accumulated(t, name)
                left = pending.get(owner.get(id(t), "root"))
                if left is not None and id(t) in left:
                    left.discard(id(t))
                    if not left:
                        bwd.log_marker(7, owner.get(id(t), "root"))
            hooks.append(p.register_post_accumulate_grad_hook(on_ready))
    return ready, hooks


def _backward_peaks(bwd) -> tuple:
    """The backward's figures per segment, read before the step's log is closed: (peaks, split (not started,
    started), split accumulating (not started, started), ends, grads made), each {segment index: ...}."""
    peaks = bwd.segment_peaks()
    split = (bwd.segment_peaks(started=False), bwd.segment_peaks(started=True))
    split_acc = (bwd.segment_peaks_accumulating(started=False), bwd.segment_peaks_accumulating(started=True))
    ends = bwd.segment_ends()
    made = bwd.segment_grads()
    return peaks, split, split_acc, ends, made


def _kept(i: int, seg: dict, units: dict) -> bool:
    """Whether segment i is one the profile keeps: the first, one that saved bytes, a unit's, the loss."""
    return i == 0 or seg["activation_bytes"] or seg["unit"] in units or seg["unit"] == "loss"


def _kept_segment_census(segments: list, units: dict, bwd) -> dict:
    """{kept segment index: [forward census, backward census]} (`CENSUS_FIELDS`)."""
    # each kept segment's kernels, with those of the segments dropped below (a parameter-free child that
    # saved nothing: a ReLU module) folded into the kept one before it
    census: dict = {}
    kept = 0
    for i, seg in enumerate(segments):
        if _kept(i, seg, units):
            kept = i
        both = census.setdefault(kept, [[0] * len(CENSUS_FIELDS), [0] * len(CENSUS_FIELDS)])
        for mine, theirs in zip(both, (bwd.census.of(i, "forward"), bwd.census.of(i, "backward"))):
            mine[:] = [a + b for a, b in zip(mine, theirs)]
    return census


def _forward_flops(census: dict, segments: list, unit_modules: list) -> tuple:
    """(the forward's FLOPs, one layer's forward FLOPs (0 without a middle unit))."""
    # The forward's FLOPs (MFU's numerator: x 3, no recompute) from the census: the GEMMs and convolutions
    # by torch.utils.flop_counter's formulas, a MoE's grouped GEMMs, and fused attention halved when causal,
    # as the analytic front end counts it (compute.model_flops; Narayanan et al. 2021, Eq. 3). Not
    # FlopCounterMode's total: it has no grouped GEMM, and counts the CPU's SDPA in torch 2.15 (unhalved)
    # but not in 2.13, so the same model's MFU moved with the installed torch.
    fwd = {i: both[0] for i, both in census.items()}
    fwd_flops = int(sum(f[0] + f[2] for f in fwd.values()))
    layer = next((i for i, seg in enumerate(segments) if seg["unit"] == unit_modules[1][0]), None) \
        if len(unit_modules) > 2 else None
    layer_flops = int(fwd[layer][0] + fwd[layer][2]) if layer in fwd else 0
    return fwd_flops, layer_flops


def _segment_records(rec: _ForwardRecorder, units: dict, backward: tuple, census: dict) -> list:
    """The kept segments, each with its backward's figures (`_backward_peaks`), census and convolutions."""
    peaks, split, split_acc, ends, made = backward
    segments, bwd = rec.segments, rec.bwd
    return [dict(seg, **dict(zip(("backward_bytes", "backward_grad_bytes", "backward_saved_bytes"),
                                 peaks.get(i, (0, 0, 0)))),
                 backward_split=[list(p.get(i, (0, 0, 0))) for p in split],
                 backward_split_accumulating=[list(p.get(i, (0, 0, 0))) for p in split_acc],
                 backward_end=int(ends.get(i, 0)), grads_made=int(made.get(i, 0)),
                 census=census.get(i, [[0] * len(CENSUS_FIELDS)] * 2),
                 kernels=bwd.segment_kernels(i, sum(x["activation_bytes"] for x in segments[:i])),
                 forward_bytes=max(0, bwd.fwd_peak.get(i, 0)
                                   - sum(x["activation_bytes"] for x in segments[:i])))
            for i, seg in enumerate(segments) if _kept(i, seg, units)]
