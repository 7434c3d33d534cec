"""Per-kernel time of one training step on one GPU: the compute side of the step-time model.

Owns `KernelTimes` and `kernel_times(train, gpu, regime)`. `compute.step_time` adds communication,
overlap and the optimizer's collectives on top.

Every op of a decoder block is timed by what bounds it:

- **GEMMs** (the Linear layers, the LM head) by FLOPs at their shapes: a GEMM of F = 2*m*n*k FLOPs runs at
  peak x matmul_efficiency x F / (F + G), G = `gpu.matmul_half_efficiency_flop` (small GEMMs lose to tile
  and wave quantization: a fixed G / (16-bit peak x efficiency) per GEMM, whatever its dtype); backward is two GEMMs of the same size (input gradient and weight gradient).
- **Attention** by kernel: SDPA's flash / memory-efficient kernel at `gpu.attention_efficiency` of the
  dense peak forward and `attention_backward_efficiency` backward (FlashAttention in Triton,
  `attention_kernel='flash-triton'`: those over `TRITON_FLASH_*_SLOWDOWN`), causal FLOPs halved (the kernels
  skip masked tiles); backward does 2.5x the forward's matmul FLOPs (Dao 2023, FlashAttention-2, sec. 3.1:
  five matmuls backward vs two forward). Eager attention: QK^T and AV as GEMMs plus the fp32 softmax,
  mask and casts over b x heads x s^2 elements, memory bound.
- **Memory-bound ops** (norms, rotary, activations, residual adds, autocast's casts, cross-entropy over the
  vocabulary, the embedding's gradient, the optimizer) by bytes read + written / (HBM x hbm_efficiency).
  Eager bytes follow the ops transformers' modeling code (and the reference decoder) run: LlamaRMSNorm
  upcasts to fp32 and runs pow, mean, rsqrt, mul, downcast and the weight mul as separate kernels;
  `rotate_half` is a neg and a cat before two muls and an add; the loss upcasts the logits to fp32
  (`transformers.loss.loss_utils.ForCausalLMLoss`). Backward of an elementwise op reads its saved
  inputs and the output gradient and writes the input gradient: twice the forward's bytes. Under
  `torch.compile` (`compile=True`) Inductor fuses each chain of pointwise ops into one kernel that reads its
  inputs and writes its outputs once; GEMMs, attention and the loss (outside the compiled blocks, as
  torchtitan compiles per block) are unchanged.
- **Launches**: every kernel costs `gpu.kernel_overhead_s` of GPU time beyond its work, and the step
  cannot be faster than the host issues its ops (`gpu.host_op_s` per dispatched ATen op; the CPU-bound
  floor of small models). The ops are counted per block from the reference decoder's forward and
  backward (`host_ops`: every ATen op a TorchDispatchMode sees, views included, as the traced census
  counts them), the optimizer's per step (`optimizer_host_ops`).

Kernel and op counts per block are those of transformers' Llama (forward ~45 kernels eager, ~12
compiled; backward about twice), a round figure: the trace's kernel census (`workload.census._KernelCensus`)
counts 34 (fp32), 48 (bf16 autocast) and 38 (bf16) kernels in LlamaDecoderLayer's forward and 67 / 87 / 71
in its backward, and for the memory-bound bytes of a block forward it agrees with the formulas below
within 12% (backward 2.1-2.2x the forward's bytes, not 2x); on the step's compute time the two agree within
-6% to +8% at real width (tests/test_census.py).

A sliding window no longer than the sequence makes transformers pass SDPA a mask (`activations._hf_mask`):
the attention kernel then computes every tile (no causal halving) and GQA's K/V are repeated to every head
first (`repeat_kv`), as the traced kernel census (`module_plan.census_seconds`) shows.

Known limitations: SM contention with NCCL's kernels is charged where communication overlaps compute
(compute.py `contention`), not here; dropout masks are counted as one extra elementwise pass; fp32
GEMMs use the same efficiency as 16-bit ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from .activations import block_linears, regime_for, saved_linears, sp_tokens
from .activations_attention import _hf_mask
from .config import TrainConfig
from .cp import attention_flops_factor
from .strategies import FSDP1

_EAGER_FWD_KERNELS, _COMPILED_FWD_KERNELS = 45, 12
"""Kernels per block forward: transformers' LlamaDecoderLayer issues ~45 (7 GEMMs, SDPA, 2 x 7 for the
norms, ~10 for rotary, the casts and adds); compiled, the 7 GEMMs, attention and ~4 fused pointwise
kernels. Backward issues about twice as many."""
TRITON_FLASH_FWD_SLOWDOWN, TRITON_FLASH_BWD_SLOWDOWN = 1.4, 2.0
"""FlashAttention-2's speed over FlashAttention in Triton: forward 1.3-1.5x (the middle taken), backward about
2x (Dao 2023, FlashAttention-2, arXiv:2307.08691, sec. 4.1, measured on A100; applied on every GPU, as the
flash efficiencies they divide are per GPU)."""
_HOST_OPS_PER_KERNEL = 1.3
"""Compiled blocks: host calls per kernel the Inductor wrapper launches (the eager count is `host_ops`)."""


@dataclass(frozen=True, slots=True)
class KernelTimes:
    """Seconds on one GPU for one micro-step (per block and for the parts outside the blocks)."""

    block_forward_s: float
    """One block's forward."""
    block_backward_s: float
    """One block's backward, its recompute included (full: the whole forward; selective: the pointwise ops)."""
    head_forward_s: float
    """Embedding, final norm, LM head and loss forward."""
    head_backward_s: float
    """Their backward (the loss's, the head's two GEMMs, the embedding's gradient)."""
    per_step_s: float
    """Once per optimizer step: gradient accumulation's adds into .grad under autocast (DDP, single); the
    optimizer step is timed in compute.py."""
    host_s: float
    """Host time to issue one micro-step's ops: the step takes at least this long per micro-step."""
    matmul_s: float
    """Of one micro-step: GEMM time (blocks and head, forward, backward, recompute)."""
    attention_s: float
    """Of one micro-step: attention kernels."""
    memory_bound_s: float
    """Of one micro-step: norms, rotary, activations, adds, casts, loss, embedding gradient."""
    launch_s: float
    """Of one micro-step: kernel overheads."""

    def gpu_s(self, layers: int) -> float:
        """GPU time of one micro-step's forward and backward."""
        return layers * (self.block_forward_s + self.block_backward_s) + self.head_forward_s + self.head_backward_s

    def micro_step_s(self, layers: int) -> float:
        """One micro-step: its GPU time, or the host's if that is longer (a host-bound step)."""
        return max(self.gpu_s(layers), self.host_s)

    def to_dict(self) -> dict:
        return asdict(self)


def recomputed_share(train: TrainConfig) -> float:
    """The share of blocks whose forward runs again in backward: all under `full`, blocks 0, K, 2K, ...
    (ceil(L / K) of L) under `every-K`, none otherwise."""
    ck, L = train.checkpointing, train.model.layers
    if ck == "full":
        return 1.0
    if not ck.startswith("every-") or not L:
        return 0.0
    return len(range(0, L, int(ck.split("-")[1]))) / L


def _gemm(flops: float, rate: float, fixed: float) -> float:
    """Seconds of one GEMM of `flops` = 2*m*n*k at large-GEMM `rate`, plus the `fixed` time a GEMM of any
    size loses to tile and wave quantization (G / tensor-core rate: in 16-bit, (F + G) / rate)."""
    return flops / rate + fixed


def step_bound(train: TrainConfig, gpu, family: str) -> str:
    """'host' where the host issuing one micro-step's eager ops outlasts the GPU's kernels, else 'gpu' (what
    `distplan validate` judges a probe's step time by: a host-bound time is reported, not judged)."""
    kt = kernel_times(train, gpu, regime_for(train, family))
    return "host" if kt.host_s >= kt.gpu_s(train.model.layers) else "gpu"


def kernel_times(train: TrainConfig, gpu, regime: str) -> KernelTimes:
    """Per-kernel times of one micro-step of `train` on `gpu` (a catalog GPU) under `regime`
    (activations.regime_for: 'fp32', 'autocast' (fp32 params, 16-bit matmuls), 'lowp' (16-bit params))."""
    return _kernel_times(train, regime, _gpu_key(gpu))


_GPU_KEYS: dict = {}  # id(gpu) -> (gpu, its key): catalog GPUs are frozen, and a sweep asks per estimate


def _gpu_key(gpu) -> tuple:
    hit = _GPU_KEYS.get(id(gpu))
    if hit is not None and hit[0] is gpu:
        return hit[1]
    key = (tuple(sorted(gpu.flops.items())), gpu.matmul_efficiency, gpu.matmul_half_efficiency_flop,
           gpu.hbm_bytes_per_s, gpu.hbm_efficiency, gpu.attention_efficiency,
           gpu.attention_backward_efficiency, gpu.kernel_overhead_s, gpu.host_op_s)
    if len(_GPU_KEYS) > 256:
        _GPU_KEYS.clear()
    _GPU_KEYS[id(gpu)] = (gpu, key)
    return key


_DTYPE = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16": "bf16"}
"""Key of GPU.flops for the matmul dtype of a precision: fp32 (PyTorch's default allow_tf32=False), bf16, fp16."""


def peak_flops(flops: dict, precision: str) -> float:
    """Dense peak FLOP/s of the matmul dtype; a GPU without it (no bf16: V100, T4) emulates at fp32 speed."""
    return flops.get(_DTYPE[precision]) or flops.get("fp32") or max(flops.values())


def matmul_rates(flops: dict, eff: float, half_flop: float, precision: str) -> tuple[float, float, float]:
    """(dense peak FLOP/s of the precision's matmul dtype, the large-GEMM rate peak x eff, the fixed seconds
    every GEMM loses to tiles and waves). The half-efficiency size G is a tensor-core figure: a fixed time
    G / (16-bit peak x eff) per GEMM, whatever its dtype."""
    peak = peak_flops(flops, precision)
    return peak, peak * eff, half_flop / (max(flops.get("bf16", 0.0), flops.get("fp16", 0.0), peak) * eff)


@lru_cache(maxsize=4096)
def _kernel_times(train: TrainConfig, regime: str, key: tuple) -> KernelTimes:
    (flops, eff, half, hbm, hbm_eff, att_eff, att_bwd_eff, k_over, host_op) = key
    peak, rate, half = matmul_rates(dict(flops), eff, half, train.precision)
    bw = hbm * hbm_eff
    m = train.model
    compiled = train.compile

    # -- GEMMs of one block: (m, k, n) per Linear, forward; backward = 2 GEMMs of the same FLOPs
    linears = block_linears(m, train.tp)
    times = [_gemm(2.0 * train.micro_batch * train.seq_len * i * o, rate, half) for i, o, _ in linears]
    gemm_fwd = sum(times)
    gemms = len(linears)
    attn_fwd, attn_bwd, attn_mem_fwd, attn_kernels = _attention_seconds_and_bytes(train, regime, peak, rate, half,
                                                                                  att_eff, att_bwd_eff)
    mem, qk_kernels = _block_pointwise_bytes(train, regime)
    mem += attn_mem_fwd

    fwd_kernels = (_COMPILED_FWD_KERNELS if compiled else _EAGER_FWD_KERNELS) - 1 + attn_kernels + qk_kernels
    mem_fwd = mem / bw
    # autocast casts each fp32 weight to 16-bit in forward (read 4, write 2 bytes per element; cached for the
    # region, so once per micro-step) and casts its 16-bit gradient back to fp32 in backward (read 2, write 4)
    cast = 6.0 * sum(i * o for i, o, _ in linears) / bw if regime == "autocast" else 0.0
    mem_fwd += cast
    block_fwd = gemm_fwd + attn_fwd + mem_fwd + fwd_kernels * k_over
    block_bwd = 2 * gemm_fwd + attn_bwd + 2 * mem_fwd - cast + 2 * fwd_kernels * k_over
    recompute_mem = 0.0
    if train.checkpointing == "full" or train.checkpointing.startswith("every-"):
        # the share of blocks recomputed: blocks 0, K, 2K, ... (ceil(L / K) of L)
        per = recomputed_share(train)
        block_bwd += per * block_fwd
        recompute_mem = per * mem_fwd
        recompute_gemm = per * gemm_fwd
        recompute_attn = per * attn_fwd
    elif train.checkpointing in ("selective", "selective-op"):
        # the pointwise ops, and the GEMMs whose outputs the policy does not save (selective-op: every 2nd mm)
        unsaved = [t for t, keep in zip(times, saved_linears(train)) if not keep]
        recompute_gemm = sum(unsaved)
        block_bwd += mem_fwd + recompute_gemm + (fwd_kernels - gemms - attn_kernels + len(unsaved)) * k_over
        recompute_mem, recompute_attn = mem_fwd, 0.0
    else:
        recompute_gemm = recompute_attn = 0.0

    head_gemm, head_mem_fwd, head_mem_bwd = _head_seconds_and_bytes(train, regime, rate, half)
    head_kernels = 20
    head_fwd = head_gemm + head_mem_fwd / bw + head_kernels * k_over
    head_bwd = 2 * head_gemm + head_mem_bwd / bw + 2 * head_kernels * k_over

    # -- once per optimizer step: with gradient accumulation, AccumulateGrad adds each later micro-step's
    # gradient into .grad (read 2 x grad_bytes, write grad_bytes per parameter) where the grads are whole
    per_step = 0.0
    if regime == "autocast" and train.grad_accum > 1:
        per_step += (train.grad_accum - 1) * m.param_count() * 3 * train.prec.grad_bytes / bw

    L = m.layers
    recompute_kernels = (fwd_kernels - gemms - attn_kernels if train.checkpointing.startswith("selective")
                         else fwd_kernels * recomputed_share(train))
    if compiled:
        host = (L * (3 * fwd_kernels + recompute_kernels) + 3 * head_kernels) * _HOST_OPS_PER_KERNEL * host_op
    else:
        ops_fwd, ops_bwd, out_fwd, out_bwd = host_ops(train, regime, linears)
        host = (L * (ops_fwd + ops_bwd) + out_fwd + out_bwd) * host_op
    matmul = L * (3 * gemm_fwd + recompute_gemm) + 3 * head_gemm
    attention = L * (attn_fwd + attn_bwd + recompute_attn)
    memory = (L * (3 * mem_fwd + recompute_mem) + (head_mem_fwd + head_mem_bwd) / bw)
    launch = (L * (3 * fwd_kernels + recompute_kernels) + 3 * head_kernels) * k_over
    return KernelTimes(block_fwd, block_bwd, head_fwd, head_bwd, per_step, host, matmul, attention, memory, launch)


def _matmul_output_bytes(regime: str) -> int:
    return 4 if regime == "fp32" else 2            # matmul outputs, attention


def _residual_bytes(regime: str) -> int:
    return 4 if regime in ("fp32", "autocast") else 2  # residual stream (fp32 under autocast: fp32 + bf16 -> fp32)


def _attention_seconds_and_bytes(train: TrainConfig, regime: str, peak: float, rate: float, half: float,
                                 att_eff: float, att_bwd_eff: float) -> tuple:
    """One block's attention: (forward seconds, backward seconds, forward memory-bound bytes, kernels)."""
    m, t = train.model, train.tp
    b, s = train.micro_batch, train.seq_len
    n = b * s
    d = m.head_dim
    q = m.q_dim // t
    kv = m.kv_heads * d // t
    heads = m.heads // t
    c = _matmul_output_bytes(regime)
    # -- attention
    attn_flops = 4.0 * b * s * s * m.q_dim / t  # QK^T and AV (Narayanan et al. 2021, Eq. 3; h = heads x head_dim)
    if train.cp > 1:  # a context-parallel rank's s/cp queries against the whole sequence (cp.py)
        attn_flops *= attention_flops_factor(train)
    masked = _hf_mask(train)
    if train.attention == "sdpa":
        if not masked:
            attn_flops *= 0.5  # is_causal: the flash / memory-efficient kernels skip masked tiles
        # a materialized mask (a sliding window no longer than the sequence): SDPA's memory-efficient kernel
        # adds it to every tile of scores, skipping none; GQA's K/V are first repeated to every head
        # (transformers' `repeat_kv`: `use_gqa_in_sdpa` is False with a mask), a copy each
        if train.attention_kernel == "flash-triton":
            # FlashAttention in Triton (flash_attn_triton.py, what llm-foundry's attn_impl='triton' runs) against
            # FlashAttention-2 on the same GPU: "around 1.3-1.5x faster than FlashAttention in Triton in the
            # forward pass and around 2x faster in the backward pass" (Dao 2023, arXiv:2307.08691, sec. 4.1, A100;
            # the kernel's own docstring: its forward is about FlashAttention-1's, its backward slower)
            att_eff, att_bwd_eff = att_eff / TRITON_FLASH_FWD_SLOWDOWN, att_bwd_eff / TRITON_FLASH_BWD_SLOWDOWN
        attn_fwd = attn_flops / (peak * att_eff)
        attn_bwd = 2.5 * attn_flops / (peak * att_bwd_eff)
        repeat = masked and m.kv_heads < m.heads
        attn_mem_fwd = 2.0 * n * (q + kv) * c if repeat else 0.0
        attn_kernels = 3 if repeat else 1
    else:
        scores = b * heads * s * s
        attn_fwd = _gemm(attn_flops, rate, half)
        attn_bwd = 2.0 * attn_fwd
        # scores (c) -> + mask -> fp32 softmax -> downcast: ~ write c, r/w 4+4 (mask add), r 4 w 4, r 4 w c
        attn_mem_fwd = scores * (c + 8 + 8 + 4 + c)
        attn_kernels = 6
        if m.attn_softcap:  # Gemma-2: / cap, tanh, * cap over the scores, each a read and a write
            attn_mem_fwd += scores * 6 * c
            attn_kernels += 3
    return attn_fwd, attn_bwd, attn_mem_fwd, attn_kernels


def _norm_bytes(train: TrainConfig, elems: int, x: int) -> float:
    """An RMSNorm over `elems` elements of `x` bytes (the residual stream's, or q/k's for Qwen3's q_norm
    and k_norm, which read the projections' outputs)."""
    if train.compile or train.model.norm == "layernorm":
        return elems * 2.0 * x  # one fused kernel (or ATen's native layer_norm): read x, write y
    upcast = 0 if x == 4 else x + 4
    downcast = 0 if x == 4 else 4 + x
    return elems * (upcast + 8 + 4 + 8 + downcast + 2 * x)  # to fp32, pow, mean, mul, to, weight mul


def _block_pointwise_bytes(train: TrainConfig, regime: str) -> tuple:
    """One block's forward memory-bound bytes outside attention's own, and the kernels Qwen3's q/k norms add."""
    # One tensor-parallel rank's shapes (tp.py): heads, MLP columns and vocabulary / tp; the norms,
    # residual adds and dropouts on s/tp tokens with sequence parallelism, on all s without.
    m, t = train.model, train.tp
    b, s, h, f = train.micro_batch, train.seq_len, m.hidden, m.ffn_hidden // t
    n = b * s
    d = m.head_dim
    q = m.q_dim // t
    kv = m.kv_heads * d // t
    heads = m.heads // t
    n_res = sp_tokens(train, n)
    c, r = _matmul_output_bytes(regime), _residual_bytes(regime)
    compiled = train.compile
    # -- memory-bound bytes of one block forward
    nh = n * h
    nh_res = n_res * h
    # Gemma-2's sandwich norms: four per block; its RMSNorm multiplies by (1 + weight) in fp32 before the
    # downcast, the same passes as Llama's in another order
    mem = (4 if m.sandwich_norms else 2) * _norm_bytes(train, nh_res, r)
    qk_kernels = 0
    if m.qk_norm:  # Qwen3's q_norm and k_norm over head_dim, on the projections' outputs (c bytes)
        mem += _norm_bytes(train, n * (q + kv), c)
        qk_kernels = 0 if compiled else 14
    if m.position == "rope":
        rot = n * (q + kv) * (m.rotary_dim / d if m.rotary_dim else 1.0)
        mem += rot * (2 * c if compiled else 10 * c)  # neg, cat, 2 mul, add on q and k (rotate_half)
    mem += n * q * 2 * c  # attention output transpose(1, 2).contiguous()
    mem += 2 * nh_res * (2 * r + c)  # two residual adds: read residual and branch, write residual
    nf = n * f
    if m.mlp == "swiglu":
        mem += nf * (3 * c if compiled else 5 * c)  # silu(gate) * up
    elif m.activation == "gelu_new" and not compiled:
        mem += nf * 16 * c  # NewGELUActivation: pow, mul, add, mul, tanh, add, mul, mul
    else:
        mem += nf * 2 * c
    if regime == "autocast":
        # autocast casts each Linear's fp32 input (the norm outputs: q, k, v and gate, up / fc)
        mem += nh * (3 + (2 if m.mlp == "swiglu" else 1)) * 6
    drop = (m.resid_dropout > 0) * 2 * nh_res + (m.attn_dropout > 0 and train.attention != "sdpa") * b * heads * s * s
    mem += drop * (3 * c + 1)  # mask generation, mul
    return mem, qk_kernels


def _head_seconds_and_bytes(train: TrainConfig, regime: str, rate: float, half: float) -> tuple:
    """Outside the blocks: (the head GEMM's forward seconds, forward bytes, backward bytes)."""
    # -- outside the blocks: embedding, final norm, head, loss
    m, t = train.model, train.tp
    n = train.micro_batch * train.seq_len
    h, V = m.hidden, -(-m.vocab // t)
    nh_res = sp_tokens(train, n) * h
    c, r = _matmul_output_bytes(regime), _residual_bytes(regime)
    head_gemm = _gemm(2.0 * n * h * V, rate, half)
    logits = n * V
    up = 0 if c == 4 else c + 4  # logits.float() and its backward
    head_mem_fwd = _norm_bytes(train, nh_res, r) + nh_res * (c + r) + logits * (up + 8)  # norm, embedding gather, cast + log_softmax
    head_mem_fwd += 6.0 * V * h if regime == "autocast" else 0.0  # the head weight's cast (as the blocks')
    if m.final_softcap:  # Gemma-2: / cap, tanh, * cap over the logits (backward: the tanh's and two scalings)
        head_mem_fwd += logits * 6 * c
    grad_b = train.prec.grad_bytes
    head_mem_bwd = (2 * _norm_bytes(train, nh_res, r) + logits * (4 + 12 + up)  # nll grad fill, log_softmax bwd, cast bwd
                    + V * h * grad_b + nh_res * r                  # embedding grad: zero fill + index add
                    + (6.0 * V * h if regime == "autocast" else 0.0)  # the head weight gradient's cast
                    + (logits * 8 * c if m.final_softcap else 0.0))
    return head_gemm, head_mem_fwd, head_mem_bwd


_RECOMPUTE_OPS = {"full": 1.9, "selective": 1.6, "selective-op": 1.8}
"""Ops a checkpointed block's backward dispatches again per op of its forward: the forward's ops re-run
plus `torch.utils.checkpoint`'s own (the saved-tensor unpacking, the policy's detaches), counted on the
reference decoder: full 1.76-2.13 (1.9 for Llama-style fp32 blocks), op-level selective 1.53-1.71,
torchtitan's every-other-mm policy 1.70-1.98."""
_POLICY_FWD_OPS = {"selective": 6, "selective-op": 3}
"""Ops an op-level policy adds to a block's forward (the saved outputs' detaches): counted 5-8 and 1-5."""


def host_ops(train: TrainConfig, regime: str, linears: list | None = None) -> tuple[float, float, float, float]:
    """ATen ops the host dispatches for one micro-step in eager mode: (one block's forward, one block's
    backward with its recompute, the forward and the backward outside the blocks), every op that a
    `TorchDispatchMode` sees, views and reshapes included (each costs the host a dispatch).

    Counted on the reference decoder (`validate.model.Decoder`, torch 2.13, CPU: the ops are the device's)
    by varying one feature at a time (benchmarks/host_ops.py prints the counts; tests/test_kernels.py
    checks this function against a live count): a block's forward is 4 ops per Linear (view, t, mm,
    _unsafe_view), 7 per RMSNorm (pow, mean, add, rsqrt, two muls, the fp32 cast where it is one) or 1 per
    LayerNorm, 12 for RoPE on q and k, 12 around attention (q/k/v views and transposes, SDPA, the output's
    transpose and reshape, two residual adds) and the MLP's activation (SwiGLU 2, GELU 1); its backward 8
    per Linear and 3 more per bias, 17 per RMSNorm or 2 per LayerNorm, 16 for RoPE, 22 around attention,
    5 for SwiGLU or 1 for GELU. Autocast casts Linear inputs and weights (and biases) in forward and the
    gradients back in backward: backward 2 ops per Linear and 1 per bias, forward the same less 2 plus
    RoPE's cos/sin casts (as counted). In 16 bits each RMSNorm's two casts (and RoPE's cos/sin casts in
    forward) are real ops. Eager attention (matmul, scale, mask, softmax, matmul, and GQA's
    repeat_interleave) adds 21 ops each way, 6 and 4 more with GQA.
    Transformers' modeling code (`ModelSpec.hf_model_type`) dispatches more: `_HF_EXTRA_OPS`.

    `linears`: the block's `block_linears` when the caller has them (only their number and biases count).

    Not modelled (estimates): Qwen3's q/k RMSNorms and Gemma-2's sandwich norms count as RMSNorms, GPT-2's
    `gelu_new` as 8 forward and 15 backward elementwise ops, each dropout as one op each way.
    """
    m = train.model
    lin = block_linears(m) if linears is None else linears
    n_lin, n_bias = len(lin), sum(1 for _, _, b in lin if b)
    rms = m.norm != "layernorm"
    norms = (4 if m.sandwich_norms else 2) + (2 if m.qk_norm else 0)
    rope = m.position == "rope"
    fwd = 4 * n_lin + norms * (7 if rms else 1) + (12 if rope else 0) + 12
    bwd = 8 * n_lin + 3 * n_bias + norms * (17 if rms else 2) + (16 if rope else 0) + 22
    if m.mlp == "swiglu":
        fwd, bwd = fwd + 2, bwd + 5
    elif m.activation == "gelu_new":
        fwd, bwd = fwd + 8, bwd + 15
    else:
        fwd, bwd = fwd + 1, bwd + 1
    drops = 2 * (m.resid_dropout > 0) + (m.attn_dropout > 0 and train.attention != "sdpa")
    fwd, bwd = fwd + drops, bwd + drops
    if train.attention != "sdpa":
        gqa = m.kv_heads < m.heads
        fwd, bwd = fwd + 21 + 6 * gqa, bwd + 21 + 4 * gqa
    if regime == "autocast":
        fwd, bwd = fwd + 2 * (n_lin - 1) + n_bias + 2 * rope, bwd + 2 * n_lin + n_bias
    elif regime == "lowp":
        fwd, bwd = fwd + 2 * norms * rms + 2 * rope, bwd + 2 * norms * rms
    ck = train.checkpointing
    fwd += _POLICY_FWD_OPS.get(ck, 0)
    if ck in _RECOMPUTE_OPS:
        bwd += _RECOMPUTE_OPS[ck] * fwd
    elif ck.startswith("every-"):  # blocks 0, K, 2K, ... fully checkpointed
        bwd += _RECOMPUTE_OPS["full"] * fwd * recomputed_share(train)
    # outside the blocks: embedding(s), RoPE tables, the final norm, the head, the loss
    out_fwd = 13 + (7 if rms else 1) + (8 if rope else 0)
    out_bwd = 17 + (17 if rms else 2) + (0 if rope else 4)
    if regime == "autocast" or (regime == "lowp" and rms):
        out_fwd, out_bwd = out_fwd + 3, out_bwd + 3
    elif regime == "lowp":
        out_fwd, out_bwd = out_fwd + 1, out_bwd + 1
    if m.embed_dropout > 0:
        out_fwd, out_bwd = out_fwd + 1, out_bwd + 1
    if m.hf_model_type:
        extra = _HF_EXTRA_OPS.get(m.hf_model_type, _HF_EXTRA_OPS["llama"])
        fwd += extra[0] + (extra[2] if regime == "autocast" else 0)
        bwd += extra[1] + (extra[3] if regime == "autocast" else 0)
        out_fwd += extra[4]
    return float(fwd), float(bwd), float(out_fwd), float(out_bwd)


_HF_EXTRA_OPS = {"llama": (9, 9, 0, 6, 4), "qwen2": (9, 9, 0, 6, 4), "gpt2": (36, 12, 5, 4, 11)}
"""Ops transformers' modeling code dispatches beyond the reference decoder's (block forward, block backward,
and under autocast each again, outside-the-blocks forward), counted as `host_ops` counts (transformers
5.24, torch 2.13, CPU, AdamW foreach): LlamaDecoderLayer and Qwen2DecoderLayer 77 / 142 ops fp32 against
the reference's 68 / 133 (its attention interface's views and transposes, the cache-position and mask
logic outside); GPT2Block 76 / 99 (Conv1D's views, the fused qkv's split and head reshapes, the dropouts).
Other model types take Llama's offsets (their modeling code derives from it; not counted)."""


def optimizer_host_ops(train: TrainConfig, tensors: int) -> float:
    """ATen ops the host dispatches for one optimizer step over `tensors` parameter tensors, counted on
    torch.optim (torch 2.13): foreach Adam/AdamW 10 `_foreach_*` ops plus two scalar reads of each
    tensor's step count (`_get_value`: `_local_scalar_dense`), the for-loop implementation 10 ops per
    tensor, the fused kernel 2 in all. Other optimizers are taken as Adam's (an estimate)."""
    impl = train.optimizer_impl
    if impl == "fused":
        return 2.0
    if impl == "for-loop":
        return 10.0 * tensors
    return 10.0 + 2.0 * tensors


@lru_cache(maxsize=256)
def param_tensors(model, family: str = "single") -> int:
    """Parameter tensors the optimizer steps over on one rank: every Linear's weight and bias, each norm's
    weight (and LayerNorm's bias), the embeddings and the head (as `ModelSpec.param_inventory` registers
    them, with transformers' fused projections as one Linear each: `block_linears`, which `units()`
    does not follow); FSDP1 (`use_orig_params=False`) steps one flat parameter per wrapped unit (the blocks and
    the root). ZeroRedundancyOptimizer's rank steps its share of them: counted as all (an upper bound)."""
    if family == FSDP1:
        return model.layers + 1
    lin = block_linears(model)
    ln = model.norm == "layernorm"
    norms = (4 if model.sandwich_norms else 2) + (2 if model.qk_norm else 0)
    block = len(lin) + sum(1 for _, _, b in lin if b) + norms * (1 + ln)
    outside = 1 + (model.position == "learned") + 1 + ln + (not model.tie_embeddings)
    return model.layers * block + outside
