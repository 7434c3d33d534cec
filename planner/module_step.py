"""The trace front end's communication and step time: a traced module's collectives per strategy
(comm._raw_schedule's rules on its real units) and the time of its step (the census of its kernels); module_plan.py."""

from __future__ import annotations

from math import prod

from .comm import Collective, DDP_BUCKET_CAP_MB, bucket_sizes, grad_ready_order, timed_collectives
from .compute import _optimizer_bytes, _owned_elems, contention
from .config import Cluster, checkpoint_every
from .kernels import matmul_rates, optimizer_host_ops
from .module_desc import ModuleDesc, ModuleTime, ModuleTrain, _FLOAT_BYTES
from .strategies import Strategy, get_strategy


DDP_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024
"""`DistributedDataParallel.broadcast_bucket_size` (torch/nn/parallel/distributed.py)."""


# -- communication -----------------------------------------------------------------------------

def ready_order_sizes(desc: ModuleDesc, autocast: bool = False) -> list[int]:
    """The traced gradient-ready order, else comm.grad_ready_order over the module's parameters."""
    if desc.grad_ready:
        return list(desc.grad_ready)
    return grad_ready_order(((name, shape) for _, ps in desc.units for name, shape in ps), autocast)


def ddp_buckets(desc: ModuleDesc, elem_bytes: int, bucket_cap_mb: int | None = DDP_BUCKET_CAP_MB,
                autocast: bool = False) -> list[int]:
    """comm.bucket_sizes on the module's ready order."""
    return list(bucket_sizes(ready_order_sizes(desc, autocast), elem_bytes, bucket_cap_mb))


def module_collectives(desc: ModuleDesc, train: ModuleTrain, cluster: Cluster, strategy: str) -> list[Collective]:
    """One optimizer step's collectives for the module (comm._raw_schedule's rules, real unit sizes)."""
    st = get_strategy(strategy)
    if not st.distributed:
        return []
    world, g = cluster.gpus, cluster.local_size
    A = train.grad_accum
    R = A if train.sync_every else 1  # micro-steps that reduce (comm._raw_schedule)
    pdt = {"fp32": "float32", "bf16-mixed": "bfloat16", "fp16-mixed": "float16", "bf16": "bfloat16"}[train.precision]
    gdt = "bfloat16" if train.precision == "bf16" else "float32"
    nbytes = _FLOAT_BYTES
    pb, gb = nbytes[pdt], nbytes[gdt]
    raw: dict[tuple, int] = {}

    def add(op, group, n, dtype, msg, calls, phase, unit):
        if calls > 0 and msg > 0:
            key = (op, group, n, dtype, int(msg), phase, unit)
            raw[key] = raw.get(key, 0) + int(calls)

    units = [(u, tuple(s for _, s in ps)) for u, ps in desc.units]
    if st.ddp_reducer:
        buckets = ddp_buckets(desc, gb, autocast=train.precision in ("bf16-mixed", "fp16-mixed"))
        for b in buckets[:-1]:
            add("all_reduce", "world", world, gdt, b, R, "backward", "bucket")
        add("all_reduce", "world", world, gdt, buckets[-1], R, "backward", "last_bucket")
        # DDP broadcasts the module's buffers (BatchNorm statistics) from rank 0 before a forward that
        # follows a synchronised forward (`_check_sync_bufs_pre_fwd`; `_post_forward` sets
        # `require_forward_param_sync` only outside no_sync): once per optimizer step however many
        # no_sync micro-steps it has, or once per micro-step when each one syncs. `_broadcast_coalesced` sends
        # one message per dtype (measured, CPU and H100); past `broadcast_bucket_size` (250 MiB) of
        # buffers the split is assumed to close a bucket once it reaches that size (not measured).
        for dtype, sizes in desc.buffers:
            bucket = 0
            for n in sizes:
                bucket += n
                if bucket >= DDP_BROADCAST_BUCKET_BYTES:
                    add("broadcast", "world", world, dtype, bucket, R, "forward", "buffers")
                    bucket = 0
            add("broadcast", "world", world, dtype, bucket, R, "forward", "buffers")
        if st.zero_optimizer:
            sdt = "bfloat16" if train.precision == "bf16" else "float32"
            for n in ready_order_sizes(desc):
                add("broadcast", "world", world, sdt, n * nbytes[sdt], 1, "optimizer", "param")
    elif st.fsdp2:
        for u, shapes in units:
            n = sum(-(-s[0] // world) * world * prod(s[1:]) if s else world for s in shapes)
            kind = "root" if u == "root" else "unit"
            add("all_gather", "world", world, pdt, n * pb, A, "forward", kind)
            # The root is not resharded after forward (`FSDPState._lazy_init`: fully_shard's default
            # reshard_after_forward=None leaves the root's post_forward_mesh_info None).
            if st.reshard_after_forward and u != "root":
                add("all_gather", "world", world, pdt, n * pb, A, "backward", kind)
            add("reduce_scatter", "world", world, gdt, n * gb, R, "backward", kind)
    else:  # fsdp1
        shard_n, group = (min(world, g), "intra_node") if st.hybrid else (world, "world")
        # A BatchNorm unit inside a checkpointed unit is all-gathered once more in backward when its parent
        # recomputes: its forward runs again after it was resharded (measured: the CIFAR ResNet, fsdp and hsdp
        # bf16-mixed under full checkpointing, 3 all-gathers of each BatchNorm unit per step)
        every = checkpoint_every(train.checkpointing)
        regs = [u for u, ps in desc.units if ps and u != "root" and u not in desc.fp32_units]
        recomputed = set(regs[::every]) if every else set()

        def in_recomputed(u: str) -> bool:
            return any(u.startswith(p + ".") for p in recomputed)
        for u, shapes in units:
            n = sum(prod(s) for s in shapes)
            kind = "root" if u == "root" else "unit"
            if st.fsdp_no_shard:
                add("all_reduce", "world", world, gdt, n * gb, R, "backward", kind)
                continue
            flat = -(-n // shard_n) * shard_n
            # a BatchNorm unit under mixed precision gathers its fp32 parameters (`ModuleDesc.fp32_units`)
            udt = "float32" if u in desc.fp32_units else pdt
            add("all_gather", group, shard_n, udt, flat * nbytes[udt],
                1 if not st.reshard_after_forward and not train.sync_every else A, "forward", kind)
            if st.reshard_after_forward and u != "root":
                add("all_gather", group, shard_n, udt, flat * nbytes[udt], A * (2 if in_recomputed(u) else 1),
                    "backward", kind)
            add("reduce_scatter", group, shard_n, gdt, flat * gb, R, "backward", kind)
            if st.hybrid:
                add("all_reduce", "inter_node", max(1, world // shard_n), gdt, flat // shard_n * gb, R,
                    "backward", kind)
    return timed_collectives([(op, group, n, dtype, msg, calls, phase, unit)
                              for (op, group, n, dtype, msg, phase, unit), calls in raw.items()], cluster)


def census_seconds(c: tuple, gpu, precision: str, backward: bool, sm_bound: bool = False) -> float:
    """GPU seconds of the kernels one census entry counts (`ModuleDesc.census`), by what bounds each, as
    `kernels.kernel_times` times a decoder's: GEMMs and convolutions by FLOPs at the matmul rate of the
    precision plus the fixed time each GEMM loses to tiles and waves, fused attention at the GPU's forward or
    backward attention efficiency, every other kernel by the bytes it moves at the achievable HBM bandwidth,
    and each kernel's launch overhead. `sm_bound`: the GEMMs' and attention's seconds only (the kernels
    that need whole SMs, `compute.sm_bound_share`). Under a 16-bit precision the GEMMs that ran on fp32
    inputs (`fp32_gemm_flops`: autocast leaves ops off its lists in fp32) take the fp32 matmul rate."""
    gemm_flops, gemms, attention, nbytes, kernels = c[:5]
    peak, rate, fixed = matmul_rates(gpu.flops, gpu.matmul_efficiency, gpu.matmul_half_efficiency_flop, precision)
    att = peak * (gpu.attention_backward_efficiency if backward else gpu.attention_efficiency)
    wide = c[6] if precision != "fp32" else 0.0
    busy = (gemm_flops - wide) / rate + gemms * fixed + attention / att
    if wide:
        busy += wide / matmul_rates(gpu.flops, gpu.matmul_efficiency, gpu.matmul_half_efficiency_flop, "fp32")[1]
    if sm_bound:
        return busy
    return busy + nbytes / (gpu.hbm_bytes_per_s * gpu.hbm_efficiency) + kernels * gpu.kernel_overhead_s


def traced_compute(desc: ModuleDesc, train: ModuleTrain, gpu, sm_bound: bool = False) -> tuple[float, float, float]:
    """(forward, backward with its recompute, host) seconds of one micro-step from the traced kernels: the
    forward and backward of every segment, the forward of each checkpointed unit again in backward, and the
    host's time to issue every ATen op (`gpu.host_op_s` each: a step is never faster than its host).
    `sm_bound`: forward and backward count GEMMs and attention only (`census_seconds`)."""
    every = checkpoint_every(train.checkpointing)
    unit_names = [s[0] for s in desc.segments if s[0] not in ("root", "loss")]
    again = set(unit_names[::every]) if every else set()
    fwd = bwd = ops = 0.0
    for seg, (f, b, own) in zip(desc.segments, desc.census):
        fwd += census_seconds(f, gpu, train.precision, False, sm_bound)
        bwd += census_seconds(b, gpu, train.precision, True, sm_bound)
        ops += f[5] + b[5]
        if seg[0] in again:
            bwd += census_seconds(own, gpu, train.precision, False, sm_bound)
            ops += own[5]
    return fwd, bwd, ops * gpu.host_op_s


def module_time(desc: ModuleDesc, train: ModuleTrain, cluster: Cluster, collectives: list,
                gpu, st: Strategy) -> ModuleTime:
    """One optimizer step: compute, the communication it cannot hide, and the optimizer step.

    Compute: `traced_compute` per micro-step (the longer of the GPU's time and the host's), plus the
    optimizer step's passes over this rank's parameters by bytes (compute._optimizer_bytes).
    Communication in forward/backward hides behind that phase's compute, except the last bucket or unit of
    backward and the optimizer-phase broadcasts, which nothing follows; while it overlaps, the SMs NCCL
    holds slow the GEMMs and attention (`compute.contention`, as `compute.exposed_comm` charges it)."""
    fwd_s, bwd_s, host_s = traced_compute(desc, train, gpu)
    compute = train.grad_accum * max(fwd_s + bwd_s, host_s)
    fwd_share = fwd_s / (fwd_s + bwd_s) if fwd_s + bwd_s > 0 else 1 / 3
    optimizer = _optimizer_bytes(train, _owned_elems(train, cluster, st)) / (gpu.hbm_bytes_per_s * gpu.hbm_efficiency)
    # the host issues the optimizer's ops too (kernels.optimizer_host_ops): FSDP1 steps a flat parameter per unit
    tensors = (len(desc.units) if st.fsdp1 else sum(len(params) for _, params in desc.units))
    optimizer = max(optimizer, optimizer_host_ops(train, tensors) * gpu.host_op_s)
    fwd = sum(c.time_s for c in collectives if c.phase == "forward")
    # the last bucket's or the root's reduction, exposed on each micro-step that reduces
    reducing = train.grad_accum if train.sync_every else 1
    bwd_tail = sum(c.time_s / max(1, c.calls) * reducing for c in collectives
                   if c.phase == "backward" and c.unit in ("last_bucket", "root"))
    bwd = sum(c.time_s for c in collectives if c.phase == "backward") - bwd_tail
    opt = sum(c.time_s for c in collectives if c.phase == "optimizer")
    lost_f = lost_b = 0.0
    if fwd + bwd > 0 and fwd_s + bwd_s > 0:
        busy = sum(traced_compute(desc, train, gpu, sm_bound=True)[:2]) / (fwd_s + bwd_s)
        cont = contention(cluster, st, gpu, busy)
        if cont is not None:
            lost_f = sum(cont.lost(c.group) * c.time_s for c in collectives if c.phase == "forward")
            # the tail (last bucket, root) runs after the backward's compute: it slows nothing
            lost_b = sum(cont.lost(c.group) * c.time_s * (1 - min(c.calls, reducing) / max(1, c.calls)
                                                          if c.unit in ("last_bucket", "root") else 1)
                         for c in collectives if c.phase == "backward")
    exposed = (max(0.0, fwd - compute * fwd_share, lost_f) + max(0.0, bwd - compute * (1 - fwd_share), lost_b)
               + bwd_tail + opt)
    step = compute + exposed + optimizer
    samples = desc.batch * train.grad_accum * cluster.gpus * train.tokens_per_sample
    peak = matmul_rates(gpu.flops, gpu.matmul_efficiency, gpu.matmul_half_efficiency_flop, train.precision)[0]
    model_flops = 3 * desc.forward_flops * train.grad_accum  # no recompute: MFU, as compute.model_flops
    return ModuleTime(compute, sum(c.time_s for c in collectives), exposed, step,
                      samples / step if step > 0 else 0.0,
                      model_flops / (step * peak) if step > 0 else 0.0, optimizer)
