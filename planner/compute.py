"""FLOPs of a step, step time with communication overlap, and the inter-node bandwidth a plan needs.

Owns `step_flops`, `model_flops`, `step_time` (-> `StepTime`) and `required_inter_bandwidth`.

FLOPs: Narayanan et al. 2021 (arXiv:2104.04473) Eq. 3 counts, per layer and micro-batch,
24*b*s*h^2 (QKV + projection + a 4h MLP) + 4*b*s^2*h (scores and attention-over-values) forward, and
2*b*s*h*V for the logits, backward = 2x forward, full recompute = +1 forward. We adapt it: the matmul
term is 2 x (Linear weights of a block) x tokens, counted from the exact inventory (GQA, SwiGLU, any
ffn width, biases excluded as non-matmul); the attention term is halved for SDPA with
`is_causal=True` (the flash / memory-efficient kernels skip fully masked tiles, ~s^2/2), kept whole for
eager attention (the full s x s scores are computed, then masked). Embedding lookups are 0 FLOPs.

Overlap model (per optimizer step; exposure = max(0, comm - compute it can hide behind)):
- DDP (and zero1's DDP part): bucket all-reduces overlap the backward of the micro-step that reduces
  (the last; each one with grad_sync='every') except the last bucket, which is exposed; zero1's
  parameter broadcasts (after the step) are exposed.
- FSDP1/FSDP2: forward all-gather of unit i+1 overlaps compute of unit i (prefetch); the first
  (root) all-gather is exposed, so is block 0's (only the embedding lookup precedes it). In backward,
  the root's backward (logits) hides block L-1's all-gather; each block's backward hides the
  all-gather of the next block plus the reduce-scatter (and HSDP inter-node all-reduce) of the
  previous one; the last block's reduce-scatter/all-reduce and the root's are exposed.
  Reduce-scatters exist only on the last micro-step (grad_sync='last', `no_sync()` /
  `set_requires_gradient_sync(False)` before it) or on every one (grad_sync='every'), each exposing
  its last block's and root's reduction.
- DeepSpeed: stage 1/2 (overlap_comm=False by default) expose everything; stage 3 overlaps per phase
  (exposed = max(0, comm - compute) per phase).
Optimizer step: memory bound, bytes touched / (HBM x hbm_efficiency).

Compute is the per-kernel model of `kernels.py` (GEMMs by shape, attention by kernel, memory-bound ops
by bytes, launches, the host's floor); the overlap model above hides communication behind its per-block
forward and backward times.

What overlap costs (`contention`, `sm_shares`): an NCCL collective's kernel holds one CTA per channel on
as many SMs for as long as its data takes to move (`src/enqueue.cc` `ncclLaunchKernel`); the GEMMs and
attention it overlaps run on the remaining SMs, so a window of compute w that overlaps communication c
ends at max(c, w + phi x c), phi = channels / SMs x the share of compute in GEMMs and attention. The
measured range: "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
Learning" (arXiv:2507.03114, abstract): overlapped compute 18.9% slower on average, 40% at most, on
A100/H100/MI250/MI210; here 1 / (1 - phi) - 1 is 18% for an H100 under an inter-node collective (24
channels of 132 SMs, phi = 0.155 at 85% GEMM time) and 8% inside one DGX H100 (12 channels).

Known limitations: the contention counts SMs only (HBM traffic of NCCL's copies, wave-quantization tails
and memory-bound kernels are not slowed); no data-loader overhead.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import NamedTuple

from distplan.catalog.loader import load_catalog

from .activations import regime_for
from .comm import Collective, Schedule, _DTYPE_BYTES, schedule_totals
from .comm_schedule import collective_schedule
from .config import Cluster, TrainConfig, checkpoint_every
from .cp import attention_flops_factor, cp_view
from .footprint import _footprint_for, nccl_env
from .kernels import KernelTimes, kernel_times, optimizer_host_ops, param_tensors, peak_flops
from .model import TPRankSpec
from .pp import bubble_fraction, pp_cluster, stage_train
from .strategies import Strategy, get_strategy
from .tp import tp_view


def _forward_flops(train: TrainConfig) -> tuple[float, float]:
    """(block FLOPs of ONE block, head FLOPs) for one micro-step forward on one rank."""
    m = train.model
    b, s, h = train.micro_batch, train.seq_len, m.hidden
    block_w, head_w = m.linear_weights()  # logits: x @ W^T with W the head or the tied embedding
    tokens = b * s
    # Narayanan et al. 2021 Eq. 3: 4*b*s^2*h per layer (QK^T and AV); halved for causal SDPA; a
    # tensor-parallel rank runs heads / tp of them (`block_w`, `head_w` are its weights already).
    attn = 4.0 * b * s * s * m.q_dim * (0.5 if train.attention == "sdpa" else 1.0) / train.tp
    if train.cp > 1:  # a context-parallel rank's s/cp queries attend over the whole sequence (cp.py)
        attn *= attention_flops_factor(train)
    block = 2.0 * block_w * tokens + attn
    head = 2.0 * head_w * tokens  # Eq. 3's logits term 2*b*s*h*V
    return block, head


def model_flops(train: TrainConfig, forward: tuple[float, float] | None = None) -> float:
    """FLOPs per rank per optimizer step WITHOUT recompute (the MFU numerator): 3 x forward x A.
    `forward`: `_forward_flops(train)` when the caller has it already."""
    block, head = forward or _forward_flops(train)
    return 3.0 * (train.model.layers * block + head) * train.grad_accum


def step_flops(train: TrainConfig, forward: tuple[float, float] | None = None) -> float:
    """FLOPs per rank per optimizer step, recompute included.

    forward F = L x block + head; backward 2F (Narayanan Eq. 3); full checkpointing re-runs the
    blocks' forward (+ L x block), every-K that of blocks 0, K, 2K, ... (+ ceil(L / K) x block);
    selective recomputes only non-matmul ops (~0 matmul FLOPs).
    """
    block, head = forward or _forward_flops(train)
    every = checkpoint_every(train.checkpointing)
    recompute = len(range(0, train.model.layers, every)) * block if every else 0.0
    return (3.0 * (train.model.layers * block + head) + recompute) * train.grad_accum


@dataclass(slots=True)
class StepTime:
    compute_s: float
    """Forward + backward (+ recompute) time of all micro-steps."""
    comm_s: float
    """Serial sum of the schedule's collective times."""
    exposed_comm_s: float
    """The part of comm_s not hidden behind compute (overlap model in the module docstring)."""
    optimizer_s: float
    """Optimizer step, memory bound."""
    step_time_s: float
    """compute + exposed + optimizer + copies and launches around the collectives (copy_bytes)."""
    tokens_per_s: float
    """Global tokens per optimizer step / step time."""
    mfu: float
    """model_flops (no recompute) / (step_time x peak) per GPU."""
    overhead_s: float = 0.0
    """Memory-bound copies around the collectives and per-call launch cost (copy_bytes, COLLECTIVE_LAUNCH_S)."""

    @property
    def exposed_s(self) -> float:
        return self.exposed_comm_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d["exposed_s"] = self.exposed_comm_s
        return d


def _optimizer_bytes(train: TrainConfig, elems: float) -> float:
    """HBM bytes (read + write) the optimizer step moves for `elems` owned parameters.

    Counted pass by pass from torch/optim/adam.py `_multi_tensor_adam` (foreach; `_single_tensor_adam`
    runs the same ops per tensor) with p = param, g = grad, s = state element bytes:
    `_foreach_mul_(params, 1 - lr*wd)` (adamw: 2p), `_foreach_lerp_(exp_avgs, grads)` (2s + g),
    `_foreach_mul_(exp_avg_sqs, beta2)` (2s), `_foreach_addcmul_(exp_avg_sqs, grads, grads)` (2s + g),
    `_foreach_sqrt` (2s), `_foreach_div_` (2s), `_foreach_add_(eps)` (2s),
    `_foreach_addcdiv_(params, exp_avgs, denom)` (2p + 2s): 4p + 14s + 2g for AdamW (Adam with its
    default weight_decay=0: 2p + 14s + 2g). The fused kernel (`torch._fused_adamw_`) reads p, g and both
    states once and writes p and both states: 2p + g + 4s. SGD with momentum (`_multi_tensor_sgd`):
    `_foreach_mul_(bufs)`, `_foreach_add_(bufs, grads)`, `_foreach_add_(params, bufs)`: 2p + 5s + g;
    plain SGD 2p + g. bitsandbytes' 8-bit AdamW is one fused kernel over 1-byte states."""
    p = train.prec
    pb, gb = p.param_bytes, p.grad_bytes
    sb = pb
    opt, impl = train.optimizer, train.optimizer_impl
    if opt in ("adam", "adamw"):
        if impl == "fused":
            per = 2 * pb + gb + 4 * sb
        else:
            per = (4 if opt == "adamw" else 2) * pb + 14 * sb + 2 * gb
    elif opt == "adamw-8bit":
        per = 2 * pb + gb + 2 * 2 * 1
    elif opt == "sgd-momentum":
        per = 2 * pb + gb + 2 * sb if impl == "fused" else 2 * pb + 5 * sb + gb
    elif opt == "sgd":
        per = 2 * pb + gb
    else:  # adafactor: factored second moment (small), a few passes over params and grads
        per = 3 * (2 * pb + gb)
    return elems * per


def _owned_elems(train: TrainConfig, cluster: Cluster, s: Strategy) -> float:
    P = train.model.param_count()
    if not s.shards_optimizer:
        return float(P)
    n = cluster.local_size if s.shard_group == "node" else cluster.gpus
    return math.ceil(P / n)


@lru_cache(maxsize=1024)
def sm_shares(cluster: Cluster, sm_count: int | None, shard_group: str, environ_key: tuple = ()) -> tuple:
    """((collective group, share), ...): the fraction of a GPU's SMs that an NCCL kernel of that
    data-parallel group holds while it runs. NCCL launches one CTA per channel
    (`src/enqueue.cc` `ncclLaunchKernel`: `dim3 grid = {nChannels, 1, 1}`, up to NCCL_MAX_NTHREADS = 640
    threads each) and the CTAs stay resident until the collective's data has moved, waiting on the network
    included; a GEMM or flash-attention CTA needs most of an SM's shared memory, so it runs on the other
    SMs. Channels: `footprint.ring_channels` per communicator (NCCL's topology search; NCCL_MAX_NCHANNELS
    and NCCL_MIN_NCHANNELS apply). () where the GPU's SM count is unknown or nothing communicates."""
    if not sm_count or cluster.gpus <= 1:
        return ()
    # One node: HSDP's shard group is the whole data-parallel group, one communicator (`footprint.communicators`),
    # and its collectives are named "intra_node" in the schedule (the replica group of one moves nothing).
    groups = {"data_parallel": ("world", "dp", "dp_cp", "intra_node"), "shard": ("intra_node",),
              "replicate": ("inter_node",)}
    out = []
    for c in _footprint_for(cluster, cluster.gpus, shard_group, 1, environ_key).nccl:
        share = min(1.0, c.channels / sm_count)
        out += [(g, share) for g in groups.get(c.name, ())]
    return tuple(out)


def sm_bound_share(compute: KernelTimes) -> float:
    """The share of a micro-step's GPU time in kernels that need whole SMs: GEMMs and attention (a
    memory-bound kernel is limited by HBM and shares an SM with an NCCL CTA)."""
    busy = compute.matmul_s + compute.attention_s
    total = busy + compute.memory_bound_s + compute.launch_s
    return busy / total if total > 0 else 0.0


class Contention(NamedTuple):
    """What the collectives that overlap compute take from it (`contention`)."""

    shares: tuple
    """((collective group, share of the GPU's SMs its NCCL kernel holds), ...) (`sm_shares`)."""
    sm_bound: float
    """Share of the compute that needs whole SMs (`sm_bound_share`)."""

    def lost(self, group: str) -> float:
        """Fraction of compute throughput lost while a collective of `group` runs."""
        return dict(self.shares).get(group, 0.0) * self.sm_bound


def contention(cluster: Cluster, strategy: str | Strategy, gpu, sm_bound: float) -> Contention | None:
    """The SM shares of the strategy's communicators on `gpu` with `sm_bound` (`sm_bound_share`): a
    collective of a group with share f slows the compute it overlaps by f x sm_bound. None where the GPU's
    SM count is unknown."""
    shares = sm_shares(cluster, getattr(gpu, "sm_count", None), get_strategy(strategy).shard_group, nccl_env())
    return Contention(shares, sm_bound) if shares else None


_WEIGHTED: dict = {}
"""(id(schedule totals), shares) -> (the totals, {(op, phase, unit): SM-share-weighted seconds per call})."""


def _share_weighted(schedule: list[Collective], sums, c: Contention) -> dict:
    """{(op, phase, unit): seconds per call x its group's SM share}; x the SM-bound share, the compute
    seconds lost per call while it overlaps compute. Kept per cached schedule (a sweep reuses them across
    sequence lengths and micro-batches)."""
    key = (id(sums), c.shares)
    hit = _WEIGHTED.get(key)
    if hit is None or hit[0] is not sums:
        shares = dict(c.shares)
        acc: dict[tuple, list] = {}
        for col in schedule:  # per call of the key, over all its calls (as sums.per_call averages)
            a = acc.setdefault((col.op, col.phase, col.unit), [0.0, 0])
            a[0] += shares.get(col.group, 0.0) * col.time_s
            a[1] += col.calls
        if len(_WEIGHTED) > 8192:
            _WEIGHTED.clear()
        hit = _WEIGHTED[key] = (sums, {k: t / n for k, (t, n) in acc.items() if n and t})
    return hit[1]


def exposed_comm(train: TrainConfig, strategy: str | Strategy, schedule: list[Collective],
                 compute: KernelTimes, lost: Contention | None = None) -> float:
    """Seconds of communication not hidden by compute, per optimizer step (module docstring model), plus
    the compute it slows while it overlaps.

    `compute`: the per-kernel times of one micro-step (`kernels.kernel_times`). `lost`: what a collective
    takes from the compute it overlaps (`contention`; None: nothing). A
    window of compute w that overlaps communication c, during which compute runs at 1 - phi, ends at
    max(c, w + phi x c): it costs max(c - w, phi x c) beyond w."""
    if not schedule:
        return 0.0
    s = get_strategy(strategy)
    A, L = train.grad_accum, train.model.layers
    F_blk, F_head = compute.block_forward_s, compute.head_forward_s
    B_blk, B_head = compute.block_backward_s, compute.head_backward_s
    bwd_total = L * B_blk + B_head
    sums = schedule_totals(schedule)
    by_phase = sums.time_by_phase
    opt_comm = by_phase.get("optimizer", 0.0)
    lpc, g = (_share_weighted(schedule, sums, lost), lost.sm_bound) if lost else ({}, 0.0)

    def slowed(key: tuple) -> float:
        """Compute seconds lost per call of the collectives of `key` while they overlap."""
        return lpc.get(key, 0.0) * g

    if train.framework == "deepspeed" and s.deepspeed_zero:
        if not s.reshard_after_forward:  # ZeRO-1 and ZeRO-2; ZeRO-3 (zero3) reshards after forward
            return sums.time_s
        fwd, bwd = by_phase.get("forward", 0.0), by_phase.get("backward", 0.0)
        lf = g * sum(t * sums.per_call[k][1] for k, t in lpc.items() if k[1] == "forward")
        lb = g * sum(t * sums.per_call[k][1] for k, t in lpc.items() if k[1] == "backward")
        return (max(0.0, fwd - A * (L * F_blk + F_head), lf) + max(0.0, bwd - A * bwd_total, lb)
                + opt_comm)

    # Micro-steps that reduce: the last one, or each with grad_sync='every' (the schedule's reductions
    # count all of them; each backward hides its own).
    R = A if train.sync_every else 1
    if s.ddp_reducer:
        # Per reducing micro-step: the bucket reduced last waits for nothing to hide it; the others
        # overlap that micro-step's backward (DDP's Reducer launches each bucket when it is ready).
        last = sums.time_by_unit.get("last_bucket", 0.0) / R
        rest = sums.time_by_unit.get("bucket", 0.0) / R
        rest_lost = g * sum(t * sums.per_call[k][1] for k, t in lpc.items() if k[2] == "bucket") / R
        return R * (last + max(0.0, rest - bwd_total, rest_lost)) + opt_comm

    # FSDP1 / FSDP2: per-unit walk with uniform blocks (closed form over L).
    pc, none = sums.per_call, (0.0, 0)
    ag_bf, n_bf = pc.get(("all_gather", "forward", "block"), none)
    ag_rf, n_rf = pc.get(("all_gather", "forward", "root"), none)
    ag_bb, n_bb = pc.get(("all_gather", "backward", "block"), none)
    ag_rb, n_rb = pc.get(("all_gather", "backward", "root"), none)
    red_b = (pc.get(("reduce_scatter", "backward", "block"), none)[0]
             + pc.get(("all_reduce", "backward", "block"), none)[0])
    red_r = (pc.get(("reduce_scatter", "backward", "root"), none)[0]
             + pc.get(("all_reduce", "backward", "root"), none)[0])
    fwd_steps = n_rf  # micro-steps that all-gather in forward
    bwd_ag_steps = max(n_rb, n_bb // L if L else 0)
    total = 0.0
    # forward of a micro-step that all-gathers: root AG, block 0 AG exposed; block i hides AG(i+1)
    fwd_exp = ag_rf + ag_bf + max(0, L - 1) * max(0.0, ag_bf - F_blk, slowed(("all_gather", "forward", "block")))
    total += fwd_steps * fwd_exp
    lag = slowed(("all_gather", "backward", "block"))
    lred = (slowed(("reduce_scatter", "backward", "block")) + slowed(("all_reduce", "backward", "block")))

    def bwd_exposed(ag: float, agr: float, red: float, redr: float) -> float:
        """One micro-step's backward: its all-gathers (ag, agr) and, on the last, the reductions."""
        if ag == 0.0 and red == 0.0 and agr == 0.0:
            return 0.0
        la, lr = (lag if ag else 0.0), (lred if red else 0.0)
        # root AG (if resharded) is needed before the head backward: exposed
        exp = agr + max(0.0, ag - B_head, la)
        exp += max(0, L - 1) * max(0.0, ag + red - B_blk, la + lr)
        exp += red + redr  # last block's and the root's reductions
        return exp

    # The first bwd_ag_steps micro-steps all-gather in backward (all A, or none for SHARD_GRAD_OP and
    # zero2); the last R reduce (R = 1 under no_sync, A with grad_sync='every'): a closed form over the
    # four kinds of micro-step (the work does not grow with --grad-accum).
    G = min(bwd_ag_steps, A)
    both = max(0, G + R - A)
    total += (G - both) * bwd_exposed(ag_bb, ag_rb, 0.0, 0.0)
    total += (R - both) * bwd_exposed(0.0, 0.0, red_b, red_r)
    total += both * bwd_exposed(ag_bb, ag_rb, red_b, red_r)
    return total + opt_comm


COLLECTIVE_LAUNCH_S = 20e-6
"""Host-side cost per collective call (Python hooks, NCCL kernel launch). An assumption of a few tens of
microseconds seen in PyTorch profiler traces; not measured by the probes (they time whole steps)."""


def copy_bytes(train: TrainConfig, strategy: str | Strategy, schedule: list[Collective]) -> float:
    """HBM bytes the implementation moves around its collectives (read + write), per optimizer step.

    - DDP with `gradient_as_bucket_view=False` (reducer.cpp `mark_variable_ready_dense` copies each grad
      into its bucket, `finalize_backward` copies the reduced bucket back): 2 copies of every bucket.
    - FSDP2 (`_fsdp_collectives.py`): `foreach_all_gather_copy_out` copies the all-gather output into the
      unsharded parameters; `foreach_reduce` copies the unsharded gradients into the reduce-scatter
      input, casting to `reduce_dtype`.
    - FSDP1 (`_flat_param.py`, `_runtime_utils.py`): all-gathers straight into the flat parameter; under
      mixed precision the unsharded gradient is cast to `reduce_dtype` before reduce-scatter.
    """
    st = get_strategy(strategy)
    prec = train.prec
    cb = prec.compute_bytes if prec.mixed else prec.param_bytes
    total = 0.0
    for (op, dtype), nbytes in schedule_totals(schedule).bytes_by_op_dtype.items():
        if st.ddp_reducer and op == "all_reduce":
            total += 2 * 2 * nbytes
        elif st.fsdp2 and op == "all_gather":
            total += 2 * nbytes
        elif st.fsdp and op == "reduce_scatter" and (st.fsdp2 or prec.mixed):
            total += nbytes * (1 + cb / _DTYPE_BYTES[dtype])
    return total


def step_time(train: TrainConfig, cluster: Cluster, strategy: str | Strategy,
              schedule: list[Collective] | None = None, gpu=None) -> StepTime:
    """Step time of one optimizer step on the most loaded rank.

    `gpu`: a catalog GPU (flops dict, matmul_efficiency, hbm_bytes_per_s); default the cluster's
    `gpu_name` from the catalog. `schedule`: default `collective_schedule(train, cluster, strategy)`.
    """
    s = get_strategy(strategy)
    if gpu is None:
        gpu = _gpu(cluster.gpu_name, cluster.catalog_dirs)
    if schedule is None:
        schedule = collective_schedule(train, cluster, s.name)
    if train.pp > 1:
        return _pp_step_time(train, cluster, s, schedule, gpu)
    tp_exposed, tp_calls = 0.0, 0
    if train.cp > 1:  # one context-parallel rank (cp.py); its ring's collectives are split off below
        train = cp_view(train)
    tp = train.tp > 1 and not isinstance(train.model, TPRankSpec)
    if tp or train.cp > 1:
        # Tensor parallelism (tp.py): the per-rank model over the data-parallel ranks; the TP group's
        # collectives sit between the block's kernels in eager PyTorch, exposed whole. So do context
        # parallelism's ring collectives, inside each attention (cp.py).
        if tp:
            train, cluster = tp_view(train, cluster)
        tp_part = [c for c in schedule if c.group in ("tp", "cp")]
        tp_exposed = sum(c.time_s for c in tp_part)
        tp_calls = sum(c.calls for c in tp_part)
        dp_part = [c for c in schedule if c.group not in ("tp", "cp")]
        schedule = Schedule(dp_part, schedule_totals(dp_part))
    peak = peak_flops(gpu.flops, train.precision)
    forward = _forward_flops(train)
    kt = kernel_times(train, gpu, regime_for(train, s.family))
    compute = train.grad_accum * kt.micro_step_s(train.model.layers) + kt.per_step_s
    sums = schedule_totals(schedule)
    comm = sums.time_s + tp_exposed
    exposed = exposed_comm(train, s, schedule, kt, contention(cluster, s, gpu, sm_bound_share(kt))) + tp_exposed
    bw = gpu.hbm_bytes_per_s * gpu.hbm_efficiency
    opt = _optimizer_bytes(train, _owned_elems(train, cluster, s)) / bw
    # the optimizer's ops are issued by the host too: a small model's step waits for them
    opt = max(opt, optimizer_host_ops(train, param_tensors(train.model, s.family)) * gpu.host_op_s)
    # Copies around the collectives (memory bound) and the host cost of each call; added, not overlapped.
    overhead = copy_bytes(train, s, schedule) / bw
    overhead += COLLECTIVE_LAUNCH_S * (sums.calls + tp_calls)
    total = compute + exposed + opt + overhead
    gpus = cluster.gpus if s.distributed else 1
    tokens = train.tokens_per_micro_step * train.grad_accum * gpus
    mfu = model_flops(train, forward) / (total * peak) if total > 0 else 0.0
    return StepTime(compute, comm, exposed, opt, total, tokens / total if total else 0.0, mfu, overhead)


def _pp_step_time(train: TrainConfig, cluster: Cluster, s, schedule, gpu) -> StepTime:
    """Pipeline parallelism (pp.py): the slowest stage (ceil(L/p) layers, the embedding, the LM head
    and the loss) computes M micro-batches over its dp ranks, plus the bubble, bubble / compute =
    (p - 1) / (v M) (GPipe arXiv:1811.06965 §2.2; Narayanan et al. 2021 arXiv:2104.04473 §2.2.1-2.2.2);
    the TP group's collectives exposed whole (as without PP), and the point-to-point sends of the fill
    and the drain, 2 (p - 1) boundary messages (the steady state's overlap the compute)."""
    if train.cp > 1:  # a context-parallel rank of each stage: s / cp tokens, the ring's collectives exposed
        train = cp_view(train)
    tv = stage_train(train, 0, time_view=True)
    dpc = cluster
    if train.tp > 1:
        dpc = tp_view(train, cluster)[1]
    dpc = pp_cluster(train, dpc)
    tp_part = [c for c in schedule if c.group in ("tp", "cp")]  # inside the blocks: exposed whole
    pp_part = [c for c in schedule if c.group == "pp"]
    dp_part = [c for c in schedule if c.group not in ("tp", "cp", "pp")]
    base = step_time(tv, dpc, s, Schedule(dp_part, schedule_totals(dp_part)), gpu)
    bubble = base.compute_s * bubble_fraction(train.pp_schedule, train.pp, train.pp_microbatches)
    tp_exposed = sum(c.time_s for c in tp_part)
    one_send = max((c.time_s / c.calls for c in pp_part if c.calls), default=0.0)
    pp_exposed = 2 * (train.pp - 1) * one_send
    calls = sum(c.calls for c in tp_part) + sum(c.calls for c in pp_part if c.op == "send")
    overhead = base.overhead_s + COLLECTIVE_LAUNCH_S * calls
    compute = base.compute_s + bubble
    exposed = base.exposed_comm_s + tp_exposed + pp_exposed
    total = compute + exposed + base.optimizer_s + overhead
    comm = base.comm_s + tp_exposed + sum(c.time_s for c in pp_part)
    dp = dpc.gpus if s.distributed else 1  # data-parallel replicas of the pipeline
    tokens = train.tokens_per_micro_step * train.pp_microbatches * dp
    block, head = _forward_flops(tv)
    flops = 3.0 * (train.model.layers * block + head) * train.pp_microbatches / train.pp
    mfu = flops / (total * peak_flops(gpu.flops, train.precision)) if total > 0 else 0.0
    return StepTime(compute, comm, exposed, base.optimizer_s, total, tokens / total if total else 0.0, mfu,
                    overhead)


@lru_cache(maxsize=64)
def _gpu(name: str, catalog_dirs: tuple = ()):
    """The catalog's GPU `name`, cached per (name, dirs) like `comm._interconnect` (looked up once per
    evaluated strategy; `api.clear_caches()` after editing catalog files in a running process)."""
    # lazy: catalog.loader imports distplan.planner, whose __init__ imports this module

    return load_catalog(catalog_dirs).gpu(name)


def required_inter_bandwidth(train: TrainConfig, cluster: Cluster, strategy: str, *, gpu=None,
                             target_fraction: float = 0.05, lo: float = 1e6, hi: float = 1e14,
                             rel_tol: float = 1e-3) -> float | None:
    """Per-node inter-node bandwidth (bytes/s) at which exposed comm (with the compute that overlapped
    collectives slow, `contention`) <= target_fraction x compute.

    Bisection on `cluster.inter_bytes_per_s` (geometric, exposure is non-increasing in it). None for a
    single-node cluster or a strategy with no inter-node traffic; math.inf when even `hi` does not
    get there (intra-node links or latency alone expose more than the target).
    """
    s = get_strategy(strategy)
    if cluster.nodes <= 1 or not s.distributed or train.pp > 1:  # not modelled with pipeline stages
        return None
    if gpu is None:
        gpu = _gpu(cluster.gpu_name, cluster.catalog_dirs)
    if train.tp > 1 and not isinstance(train.model, TPRankSpec):
        # the data-parallel ranks' share of each node (1/tp of its NICs): per node it is tp times that
        t = train.tp
        rtrain, dp = tp_view(train, cluster)
        if dp.nodes <= 1:
            return None
        per_share = required_inter_bandwidth(rtrain, dp, strategy, gpu=gpu, target_fraction=target_fraction,
                                             lo=lo / t, hi=hi / t, rel_tol=rel_tol)
        return per_share if per_share is None else per_share * t
    kt = kernel_times(train, gpu, regime_for(train, s.family))
    compute = train.grad_accum * kt.micro_step_s(train.model.layers) + kt.per_step_s
    target = target_fraction * compute
    lost = contention(cluster, s, gpu, sm_bound_share(kt))  # the SMs NCCL holds do not depend on the bandwidth

    def exposed(bw: float) -> float:
        cl = replace(cluster, inter_bytes_per_s=bw)
        return exposed_comm(train, strategy, collective_schedule(train, cl, strategy), kt, lost)

    if exposed(hi) > target:
        return math.inf
    if exposed(lo) <= target:
        return lo
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        if exposed(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi
