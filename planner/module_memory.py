"""The trace front end's memory walk: the most loaded rank's memory of one strategy for a measured module
(`walk_module_memory`; module_plan.py's docstring says what it counts) and the events its reserved peak replays
(`logged_module_events`)."""

from __future__ import annotations

from math import prod

from .alloc_trace import (LOGGED_FAMILIES, LOGGED_FSDP1, LOGGED_FSDP2, LOGGED_OPTIMIZERS, logged_fsdp1_events,
                          logged_fsdp2_events, logged_step_events)
from .comm import DDP_BUCKET_CAP_MB
from .config import Cluster, checkpoint_every, fsdp2_first_microstep_grads_in_reduce_dtype, fsdp2_reduce_keeps_last_grad
from .footprint import device_footprint
from .memory import MemoryEstimate, library_workspace_bytes
from .module_desc import ModuleDesc, ModuleTrain, _zero1_owned
from .module_step import ddp_buckets
from .module_walk import DdpWalk
from .module_walk_fsdp import FsdpWalk
from .strategies import DDP, Strategy, ZERO1, get_strategy


# -- memory ------------------------------------------------------------------------------------

PADDING_NOTE_FRACTION = 0.10
"""FSDP2's dim-0 padding is named in a note once it adds this fraction to a rank's parameter shard."""


def fsdp2_padding_note(desc: ModuleDesc, names, shard: int) -> str | None:
    """A note where FSDP2's dim-0 sharding pads the shards well beyond 1/shard of the parameters: a
    parameter with fewer rows than the shard group (a mixture-of-experts layer's stacked experts, whose
    dim 0 is the number of experts) gives every rank ceil(rows / shard) rows, the all-gathers move
    shard x that, and ranks past the last row hold padding (`FSDPParam._init_sharded_param`: `torch.chunk`
    on dim 0, padded to `padded_sharded_param_size`). None when the padding is under
    PADDING_NOTE_FRACTION or no FSDP2 strategy is planned."""
    names = [n for n in names if get_strategy(n).fsdp2]
    if not names or shard <= 1:
        return None
    padded = exact = 0
    worst = (0, "", ())
    for _, ps in desc.units:
        for pname, s in ps:
            rows = -(-s[0] // shard) * prod(s[1:]) if s else 1
            padded += rows
            exact += prod(s) / shard
            extra = rows - prod(s) / shard
            if extra > worst[0]:
                worst = (extra, pname, s)
    if not exact or padded <= (1 + PADDING_NOTE_FRACTION) * exact:
        return None
    _, pname, s = worst
    return (f"{', '.join(names)}: FSDP2 shards each parameter on dim 0, and {pname} ({'x'.join(map(str, s))}) has "
            f"{s[0]} rows for {shard} ranks, so each rank holds {-(-s[0] // shard)} row(s) and the all-gathers "
            f"move {shard} x that: the parameter shards come to {padded / exact:.1f}x 1/{shard} of the model. "
            f"fully_shard(shard_placement_fn=...) can shard such parameters on another dim (not planned), or "
            f"FSDP1's flat parameters (fsdp) avoid it")


def walk_module_memory(desc: ModuleDesc, train: ModuleTrain, cluster: Cluster,
                       strategy: str | Strategy, device: str = "cuda", backend: str = "nccl",
                       workspaces: dict | None = None, rank: int | None = None,
                       init: str = "device", snapshots: list | None = None) -> MemoryEstimate:
    """Most loaded rank's memory of one strategy for a measured module (module docstring); `rank`: that
    rank's instead, where ranks differ (ZeRO-1's partition of the optimizer state: a probe on the fake process
    group measures rank 0). `init`: how the written run builds the model under FSDP (logged_module_events).

    On 'cuda' `peak_allocated` adds two cuBLAS workspaces (forward and backward threads) and cuBLASLt's
    when a Linear has a bias (`memory.library_workspace_bytes`'s rule), and each convolution's cuDNN
    workspace from `workspaces` ({kernel key: bytes}, measured by `validate.kernel_workspace`) at the
    instant its call runs: the components are those of the tensors' peak, `peak_allocated` is the
    highest of tensors plus the workspace of the moment, and `workspace` what it adds to the components.
    `backend` 'gloo' adds the copy its reduce_scatter_tensor makes of its input (as memory.py)."""
    st = get_strategy(strategy)
    walk = (FsdpWalk if st.fsdp else DdpWalk)(desc, train, cluster, st, device, backend, workspaces, rank)
    walk.walk()
    snaps, extra, notes, family, world, shard, ws = (
        walk.snaps, walk.workspace_bytes, walk.notes, walk.family, walk.world, walk.shard, walk.ws)

    if snapshots is not None:  # debugging: every instant the walk looked at
        snapshots[:] = snaps
    peak = max(snaps, key=lambda s: s.total)
    library = library_workspace_bytes(train, cluster.gpu_name, desc.linear_bias) if device == "cuda" else 0
    peak_allocated = max(s.total + e for s, e in zip(snaps, extra)) + library
    workspace = peak_allocated - peak.total
    # The reserved peak: the traced step's own allocations replayed through the caching allocator where
    # they are written (logged_module_events); a Hugging Face model whose own run is not written, or whose
    # embeddings are tied, pairs with the analytic front end's replay (module_result, pair_tied,
    # pair_reserved); else the allocated peak plus the margin
    # (memory.RESERVED_MARGIN). `reserved_source` says which.
    events = (logged_module_events(desc, train, family, world, shard, library, ws, rank, st.name, init)
              if device == "cuda" else None)
    # The CUDA context and each NCCL communicator's buffers (footprint.py); none on gloo or fake.
    fp = device_footprint(cluster, world if backend == "nccl" else 1, st.shard_group)
    return MemoryEstimate(st.name, dict(peak.parts), peak_allocated, peak.phase, fp.total,
                          cluster.gpu_memory_bytes, notes, workspace, footprint=fp,
                          reserved_replay=("events", events, train.alloc_conf) if events else None)


def logged_module_events(desc: ModuleDesc, train: "ModuleTrain", family: str, world: int, shard: int,
                         workspace: int = 0, conv_workspaces: dict | None = None,
                         rank: int | None = None, strategy: str = "", init: str = "device") -> tuple | None:
    """The events of the module's run (alloc_trace.logged_step_events; zero2 / zero3 sharded over more than
    one rank: alloc_trace.logged_fsdp2_events; FSDP1: alloc_trace.logged_fsdp1_events, the units'
    collectives where the trace marked FSDP's hooks) from its traced step's allocations, as a tuple (replay
    results are remembered by it; under activation checkpointing the log of the checkpointed trace,
    `ModuleDesc.alloc_log_every`; pure bf16: the cast after construction from `ModuleDesc.construct_built`);
    None where they are not written: FSDP2 on one rank, FSDP2 accumulating under mixed precision where the
    installed torch makes the first micro-step's gradients in fp32 (2.15), a log traced without the run's
    checkpointing,
    optimizers outside alloc_trace.LOGGED_OPTIMIZERS, and a profile
    without a log (another batch than the traced). `init` "device": the model built on the device, then
    wrapped (what the probes do); "meta": under FSDP built on the meta device and only this rank's shards
    materialized (alloc_trace.logged_fsdp2_events / logged_fsdp1_events `meta`: what a plan of a large model
    assumes, as the analytic front end's)."""
    pure, mixed = train.precision == "bf16", train.precision in ("bf16-mixed", "fp16-mixed")
    if (not desc.alloc_log or not desc.construct or train.optimizer not in LOGGED_OPTIMIZERS
            or train.precision not in ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
            or (pure and not desc.construct_built) or checkpoint_every(train.checkpointing) != desc.alloc_log_every):
        return None
    built = desc.construct_built if pure else ()
    if (strategy in LOGGED_FSDP2 and mixed and train.grad_accum > 1 and not train.sync_every
            and fsdp2_first_microstep_grads_in_reduce_dtype(train)):
        return None  # torch 2.15's fp32 gradients of the first micro-step (the walk has them; the writer does not)
    if strategy in LOGGED_FSDP2 and shard > 1 and desc.alloc_grads and desc.construct_names:
        return tuple(logged_fsdp2_events(desc.construct, desc.construct_names, desc.alloc_log, desc.alloc_grads,
                                         desc.units, (desc.batch_bytes,) * train.grad_accum, shard,
                                         get_strategy(strategy).reshard_after_forward, mixed, train.optimizer,
                                         train.optimizer_impl, train.grad_accum, train.sync_every,
                                         fsdp2_reduce_keeps_last_grad(train), workspace, conv_workspaces,
                                         built, 2 if pure else 4, init == "meta"))
    if strategy in LOGGED_FSDP1 and desc.alloc_grads and desc.construct_names:
        return tuple(logged_fsdp1_events(desc.construct, desc.construct_names, desc.alloc_log, desc.alloc_grads,
                                         desc.units, (desc.batch_bytes,) * train.grad_accum, shard, strategy,
                                         mixed, desc.fp32_units, train.optimizer,
                                         train.optimizer_impl, train.grad_accum, train.sync_every, workspace,
                                         conv_workspaces, built, 2 if pure else 4, init == "meta"))
    if family not in LOGGED_FAMILIES:
        return None
    prec = train.prec
    shapes = desc.all_shapes()
    owned = _zero1_owned(shapes, shard, rank) if family == ZERO1 and shard > 1 else shapes
    autocast = mixed
    total = sum(prod(s) for s in shapes)
    buckets = (total * prec.grad_bytes,) if family in (DDP, ZERO1) else ()
    rebuilt = tuple(ddp_buckets(desc, prec.grad_bytes, DDP_BUCKET_CAP_MB, autocast)) if buckets else ()
    return tuple(logged_step_events(desc.construct, desc.alloc_log, desc.alloc_kept,
                                    (desc.batch_bytes,) * train.grad_accum, family, world,
                                    tuple(prod(s) * prec.param_bytes for s in owned), train.optimizer,
                                    train.optimizer_impl, train.grad_accum, buckets, rebuilt,
                                    tuple(sum(sizes) for _, sizes in desc.buffers), workspace,
                                    conv_workspaces, built))
