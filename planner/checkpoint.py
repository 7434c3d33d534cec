"""The memory and time of saving a checkpoint: the per-rank peak while saving, on the GPU and the host.

Saving can hold more than the training step: a full state dict gathers every parameter and optimizer
state, and a run that trains within its GPU's memory can die at its first checkpoint. This module
predicts, from the layout the memory walk uses (`memory.layout`, `memory._all_state_elems`), what each
rank holds while it saves model and optimizer state the way PyTorch's Distributed Checkpoint API does
it (`torch/distributed/checkpoint/state_dict.py`, the same calls for DDP, FSDP1 and FSDP2):

- `full`: `get_model_state_dict` / `get_optimizer_state_dict` with `StateDictOptions(full_state_dict=True)`,
  then rank 0 `torch.save`s the result. Every rank ends up with the whole state dict on the GPU
  (`_maybe_full_or_cpu_state_dict` -> `_gather_state_dict(ranks_only=())`).
- `full-offload`: the same with `cpu_offload=True`: `_gather_state_dict(cpu_offload=True,
  ranks_only=(0,))` moves each gathered tensor to the CPU on rank 0 and drops it on the others, and
  FSDP1 runs `FullStateDictConfig(offload_to_cpu=True, rank0_only=True)`.
- `sharded`: the default options (FSDP2's DTensors as they are; FSDP1 `SHARDED_STATE_DICT`), written by
  every rank with `torch.distributed.checkpoint.save` (`FileSystemWriter`).

What each family allocates (installed torch, `torch/distributed/...`):
- DDP / single: `module.state_dict()` and `optimizer.state_dict()` return the live tensors: no copy on
  the device; `cpu_offload` copies each to the CPU (`_iterate_state_dict`: `ret.to(cpu_device)`).
- FSDP2: each DTensor is `redistribute`d to `Replicate()` (`_state_dict_utils._gather_state_dict`,
  `dtensor_func`): an all-gather into a new tensor of the padded unsharded size (dim 0 padded to a
  multiple of the group, `FSDPParam._init_sharded_param`), narrowed to the parameter (a view: the padded
  storage stays). Without offload every gathered tensor is kept; with it, one at a time on the device.
- FSDP1 full (`fsdp/_state_dict_utils.py` `_full_pre_state_dict_hook` -> `_enter_unshard_params_ctx`,
  `_full_post_state_dict_hook` -> `_common_unshard_post_state_dict_hook`): one FSDP unit unsharded at a
  time (full precision), each original parameter cloned; the optimizer (`fsdp/_optim_utils.py`
  `_allgather_orig_param_states`) all-gathers each state of a FlatParameter into a new padded flat
  buffer (`new_zeros`) whose views become the state dict's tensors, so the buffers stay.
- FSDP1 sharded (`_sharded_pre_state_dict_hook` unshards a unit, `_sharded_post_state_dict_hook` ->
  `_ext_chunk_tensor` clones this rank's `chunk` of each parameter; the optimizer all-gathers a
  FlatParameter's states (`_communicate_optim_state`) and clones this rank's chunks): the clones stay,
  a unit's gathered states are transient.
- DCP's writer (`checkpoint/filesystem.py` `_write_files_from_queue`): on a GPU `_OverlappingCpuLoader`
  copies items to the host (`per_thread_copy_ahead` ahead of the writes), on a CPU device
  `_SerialCpuLoader` passes tensors as they are (a clone only of a shard shorter than its storage), and
  every written tensor stays in `tensor_dict` until the rank's file is done: a rank's whole share is
  in host memory at the end. Replicated (DDP) items are written once, spread over the ranks
  (`_dedup_save_plans`).
- `torch.save` of GPU tensors (`torch/serialization.py` `_save`) copies one storage at a time to the
  host as it writes it.

Reserved bytes (`device_reserved_bytes`, what decides the OOM): on rank 0 the run's allocations and the
save's (alloc_trace.checkpoint_events: full and sharded saves under single, DDP, FSDP2 and FSDP1) replayed
through the caching-allocator model; elsewhere (full-offload, NO_SHARD, HSDP, tensor parallelism, other
ranks) the device peak plus memory.RESERVED_MARGIN, as `reserved_source` says.

Save time: the bytes the busiest writer writes over the storage bandwidth per writing rank
(`storage_bytes_per_s`; full: rank 0 writes everything; sharded: the ranks write in parallel, which
assumes the file system's aggregate bandwidth grows with the writers).

Known limitations: DCP's planning metadata (pickled save plans gathered on rank 0, a few hundred bytes per
tensor per rank) and the collectives' time are not counted; ZeroRedundancyOptimizer (zero1) has no DCP
state-dict support and is not modelled, nor are pipeline stages (`--pp`); FSDP1 with `offload_to_cpu` cannot run on a CPU device (PyTorch
raises), so the CPU probes do not check `full-offload` under FSDP1; DeepSpeed's checkpoints are not
modelled; CPU-offloaded training (`cpu_offload=params`) is planned as if its state were on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import prod

from .alloc_trace import CHECKPOINT_REPLAY_MODES, CHECKPOINT_REPLAY_STRATEGIES, allocation_events, checkpoint_events
from .allocator import alloc_rounding, replay
from .config import CHECKPOINT_MODES, Cluster, DEFAULT_STORAGE_GBPS, TrainConfig
from .memory import MemoryEstimate, RESERVED_MARGIN, _all_state_elems, estimate_memory, layout
from .model import ModelSpec, TPRankSpec, unit_sizes
from .resolve import DEFAULT_GPU
from .strategies import Strategy, get_strategy
from .tp import tp_view

MODES = CHECKPOINT_MODES


@dataclass
class CheckpointEstimate:
    """One strategy's checkpoint save, on the most loaded rank (rank 0 for full state dicts)."""

    strategy: str
    mode: str
    resident_bytes: int
    """Device bytes when the save starts: parameters, optimizer state, DDP's buckets, the last batch."""
    device_extra_bytes: int
    """Device bytes the save adds at its peak."""
    host_bytes: int
    """Host (CPU) bytes of state-dict tensors at the peak, on the rank that holds the most (rank 0 for
    full state dicts)."""
    written_bytes: int
    """Bytes written to storage by all ranks together."""
    writer_bytes: int
    """Bytes the busiest rank writes."""
    save_time_s: float
    fits: bool
    """The save's reserved peak (`device_reserved_bytes`) and the process overhead (CUDA context, NCCL)
    fit the GPU."""
    notes: list = field(default_factory=list)
    device_reserved_bytes: int = 0
    """What `torch.cuda.max_memory_reserved` should read by the end of the save: the run's allocations
    and the save's replayed through the caching allocator (alloc_trace.checkpoint_events), or the device
    peak plus memory.RESERVED_MARGIN (`reserved_source`)."""
    reserved_source: str = f"{RESERVED_MARGIN:.0%} margin"

    @property
    def device_peak_bytes(self) -> int:
        return self.resident_bytes + self.device_extra_bytes

    def to_dict(self) -> dict:
        return {"mode": self.mode, "device_peak_bytes": int(self.device_peak_bytes),
                "resident_bytes": int(self.resident_bytes), "device_extra_bytes": int(self.device_extra_bytes),
                "host_bytes": int(self.host_bytes), "written_bytes": int(self.written_bytes),
                "writer_bytes": int(self.writer_bytes), "save_time_s": self.save_time_s, "fits": self.fits,
                "device_reserved_bytes": int(self.device_reserved_bytes), "reserved_source": self.reserved_source,
                "notes": list(self.notes)}


def _shard_group(st: Strategy, cluster: Cluster) -> int:
    """Ranks a state is sharded over (memory.estimate_memory's rule)."""
    world = cluster.gpus if st.distributed else 1
    if st.fsdp_no_shard or st.shard_group == "none":
        return 1
    return world if st.shard_group == "world" else min(world, cluster.local_size)


@dataclass(frozen=True)
class _Sizes:
    """Element counts the save paths allocate on one rank (see `_sizes`)."""

    params: int  # unsharded parameters
    states: int  # unsharded optimizer state elements (elementwise states)
    gathered: int  # FSDP: parameters as all-gathered (padded); else `params`
    largest_gathered: int  # the largest single all-gathered tensor (FSDP2) or FSDP1 unit
    local: int  # FSDP2 / FSDP1 chunks: this rank's rows of every parameter (torch.chunk's split)
    local0: int  # the same on rank 0 (the memory walk's most loaded rank)
    pad_last: int  # FSDP2: the padded copy of this rank's shard of the last tensor gathered (0: none)
    pad_gather: int  # FSDP2: the largest (gathered + padded local copy) of one tensor on this rank
    short_views: int  # FSDP2: this rank's shards shorter than their padded storage (DCP clones them)


def _rows(d0: int, w: int, r: int) -> int:
    """Rows of a dim-0 shard on rank r: `torch.chunk`'s split, which FSDP2 (`FSDPParam._init_sharded_param`)
    and FSDP1's `_ext_chunk_tensor` both use: ceil(d0 / w) rows per rank, the last ranks short or empty."""
    c = -(-d0 // w)
    return max(0, min(c, d0 - r * c))


def _sizes(train: TrainConfig, st: Strategy, shard: int, rank: int) -> _Sizes:
    m = train.model
    lay = layout(m, st.family, shard, st.shards_params, st.shards_optimizer)
    states, _ = _all_state_elems(m, train.optimizer)
    root_shapes, block_shapes, *_ = unit_sizes(m)
    embed, _, head = m.units()
    # registration order (the state dicts' order): embedding, the blocks, the head's parameters
    order = [s for _, s in embed.params] + list(block_shapes) * m.layers + [s for _, s in head.params]
    w, r = shard, rank % shard if shard else 0

    def local_of(rr: int) -> int:
        return sum(_rows(s[0], w, rr) * prod(s[1:]) for s in order)

    pad_last = pad_gather = short = 0
    if st.fsdp2:
        gathered = lay.unshard_root + m.layers * lay.unshard_block
        full = [(-(-s[0] // w) * w * prod(s[1:]), -(-s[0] // w) * prod(s[1:]), _rows(s[0], w, r) * prod(s[1:]))
                for s in order]  # (gathered, padded local chunk, this rank's chunk)
        largest = max(g for g, _, _ in full)
        if w > 1:
            # DTensor's uneven all-gather pads a short local shard to the full chunk first
            # (`distributed/tensor/_collective_utils.py` `fill_empty_tensor_to_shards` / `pad_tensor`)
            padded = [(g, c if n < c else 0, n if n < c else 0) for g, c, n in full]
            pad_last = padded[-1][1]  # the last parameter's last state is the last tensor gathered
            pad_gather = max(g + p for g, p, _ in padded)
            short = sum(n for _, _, n in padded)  # sharded params only: optimizer states are own-size
    elif st.fsdp1:
        gathered = lay.unshard_root + m.layers * lay.unshard_block
        largest = max(lay.unshard_root, lay.unshard_block)
    else:
        gathered, largest = lay.total, lay.largest_param
    return _Sizes(lay.total, states, gathered, largest, local_of(r), local_of(0), pad_last,
                  pad_gather or largest, short)


def _most_loaded(train, cluster, st, mode, storage_bytes_per_s, device, mem):
    shard = _shard_group(st, cluster)
    ranks = sorted({0, 1 % max(1, shard), max(0, shard - 1)})
    outs = [estimate_checkpoint(train, cluster, st, mode, storage_bytes_per_s, device, mem, rank=r) for r in ranks]
    top = max(outs, key=lambda c: (c.device_peak_bytes, c.host_bytes))
    # the device peak of the most loaded rank; the host bytes and save time of the busiest one
    busiest = max(outs, key=lambda c: c.writer_bytes)
    return replace(top, host_bytes=max(c.host_bytes for c in outs), writer_bytes=busiest.writer_bytes,
                   save_time_s=busiest.save_time_s)


def estimate_checkpoint(train: TrainConfig, cluster: Cluster, strategy: str | Strategy, mode: str,
                        storage_bytes_per_s: float = DEFAULT_STORAGE_GBPS * 1e9, device: str = "cuda",
                        mem: MemoryEstimate | None = None, rank: int | None = None) -> CheckpointEstimate | None:
    """Predict one strategy's checkpoint save (module docstring) on `rank`, by default the most loaded
    one (the largest device peak: rank 0, or the last rank of a group whose shards are uneven); None
    where it is not modelled (zero1, DeepSpeed).

    `device='cpu'` predicts a CPU run (the probes): device and host memory are one, so `.to('cpu')`
    copies nothing and the CPU-side bytes are counted in `device_extra_bytes`."""
    if mode not in MODES:
        raise ValueError(f"checkpoint={mode!r}: accepted: {', '.join(MODES)}")
    st = get_strategy(strategy)
    if st.zero_optimizer or (train.framework == "deepspeed" and st.deepspeed_zero):
        return None
    if getattr(train, "pp", 1) > 1:  # pipeline stages (pp.py): each stage saves its own layers; not modelled
        return None
    whole = None
    if train.tp > 1:  # one TP rank's parameters (tp.py); the strategy over the data-parallel ranks
        if mem is None:
            mem = estimate_memory(train, cluster, st, device=device)
        m = train.model
        states, _ = _all_state_elems(m, train.optimizer)
        whole = ((m.param_count() + states) * train.prec.param_bytes, unit_sizes(m)[4] * train.prec.param_bytes)
        train, cluster = tp_view(train, cluster)
    if mem is None:
        mem = estimate_memory(train, cluster, st, device=device)
    if rank is None:
        out = _most_loaded(train, cluster, st, mode, storage_bytes_per_s, device, mem)
        if whole is not None and mode != "sharded":
            out = _with_tp_full_state(out, whole, mode, train, cluster, mem, storage_bytes_per_s)
        return out
    return _rank_save(train, cluster, st, mode, storage_bytes_per_s, device, mem, rank)


def _with_tp_full_state(out: CheckpointEstimate, whole: tuple, mode: str, train: TrainConfig, cluster: Cluster,
                        mem: MemoryEstimate, storage_bytes_per_s: float) -> CheckpointEstimate:
    """`out` (one TP rank's save) under tensor parallelism for a full state dict: `whole` is (the whole
    model's state bytes, its largest unit's bytes)."""
    # A full state dict redistributes every DTensor to Replicate on every mesh dimension
    # (`_gather_state_dict`'s `dtensor_func`), the tensor-parallel one too: the whole model,
    # not one TP rank's slice, on every rank (full) or in rank 0's host memory (full-offload).
    full_bytes, largest = whole
    extra = full_bytes if mode == "full" else largest
    out = replace(out, device_extra_bytes=extra, written_bytes=full_bytes, writer_bytes=full_bytes,
                  host_bytes=full_bytes if mode == "full-offload" else largest,
                  save_time_s=full_bytes / storage_bytes_per_s if storage_bytes_per_s > 0 else float("inf"))
    peak = out.resident_bytes + extra
    out.device_reserved_bytes = int((1 + RESERVED_MARGIN) * peak)  # the TP gathers are not written
    out.reserved_source = f"{RESERVED_MARGIN:.0%} margin"
    out.fits = out.device_reserved_bytes + mem.process_overhead <= cluster.gpu_memory_bytes
    out.notes = out.notes + [f"--tp {train.tp}: the {mode} state dict gathers the tensor-parallel shards too"]
    return out


def _rank_save(train: TrainConfig, cluster: Cluster, st: Strategy, mode: str, storage_bytes_per_s: float,
               device: str, mem: MemoryEstimate, rank: int) -> CheckpointEstimate:
    """The save of `mode` on `rank` (estimate_checkpoint): what the rank holds when it starts (`resident`),
    what the save adds on the device and the host, what it writes, and whether it fits."""
    shard = _shard_group(st, cluster)
    sz = _sizes(train, st, shard, rank)
    pb = train.prec.param_bytes  # fp32 master parameters under mixed precision; optimizer states alike
    elems = sz.params
    ratio = sz.states / elems if elems else 0.0  # elementwise state elements per parameter (Adam: 2)
    full_bytes = (sz.params + sz.states) * pb  # the state dict's tensors, unpadded
    gathered_bytes = sz.gathered * pb + round(sz.states * sz.gathered / elems) * pb if elems else 0
    cpu = device == "cpu"
    sharding = st.fsdp and shard > 1
    notes: list[str] = []

    resident = mem.components["params"] + mem.components["optimizer"]  # the memory walk's rank 0
    if st.fsdp2 and shard > 1:  # a rank with short shards holds less (dim-0 chunks)
        resident -= round((sz.local0 - sz.local) * pb * (1 + ratio))
    if st.ddp_reducer:
        resident += sz.params * train.prec.grad_bytes  # DDP's buckets, allocated at construction
    resident += 2 * train.micro_batch * train.seq_len * 8  # the last batch: token ids and labels, int64

    extra, host, writer = _save_bytes(mode, st, sz, sharding, pb, full_bytes, gathered_bytes, rank, cpu,
                                      cluster.gpus, notes)
    written = full_bytes
    time_s = writer / storage_bytes_per_s if storage_bytes_per_s > 0 else float("inf")
    peak = resident + extra
    # The save allocates after the step, from the caching allocator's segments: the run's allocations and
    # the save's replayed (rank 0, where the training trace is written), else the margin.
    reserved = _save_reserved(train, st, shard, mode, mem, peak) if rank == 0 and device == "cuda" else None
    source = "allocator replay" if reserved is not None else f"{RESERVED_MARGIN:.0%} margin"
    if reserved is None:
        reserved = int((1 + RESERVED_MARGIN) * peak)
    fits = reserved + mem.process_overhead <= cluster.gpu_memory_bytes
    if not fits and mem.fits:
        notes.append(f"the {mode} checkpoint save does not fit though the training step does")
    return CheckpointEstimate(st.name, mode, int(resident), int(extra), int(host), int(written), int(writer),
                              time_s, fits, notes, int(reserved), source)


def _save_bytes(mode: str, st: Strategy, sz: _Sizes, sharding: bool, pb: int, full_bytes: int,
                gathered_bytes: int, rank: int, cpu: bool, gpus: int, notes: list) -> tuple[int, int, int]:
    """(device bytes the save adds, host bytes, bytes this rank writes) of a `mode` save on `rank`; `pb` the
    bytes of a parameter and of a state element, `full_bytes` the state dict's, `gathered_bytes` its
    gathered (padded) tensors'."""
    elems = sz.params
    ratio = sz.states / elems if elems else 0.0  # elementwise state elements per parameter (Adam: 2)
    per_state = round(ratio)
    host = 0
    writer = full_bytes if rank == 0 else 0  # full state dicts: rank 0 writes everything
    if mode == "full":
        if sharding and st.fsdp2:
            extra = gathered_bytes + sz.pad_last * pb
        elif sharding:  # FSDP1: parameters cloned (unpadded); states gathered into padded flat buffers
            extra = sz.params * pb + round(sz.states * sz.gathered / elems) * pb
        elif st.fsdp1:  # NO_SHARD: the post-state-dict hook still clones every parameter
            extra = sz.params * pb
        else:
            extra = 0
        # rank 0's torch.save copies one storage at a time to the host (FSDP1: a unit's flat buffer)
        host = sz.largest_gathered * pb if (rank == 0 and not cpu) else 0
    elif mode == "full-offload":
        if rank == 0 and not cpu:
            host = full_bytes
        if sharding and st.fsdp2:
            # one gathered tensor on the device at a time; on a CPU device `.to("cpu")` is the tensor
            # itself, so rank 0 keeps every gathered (padded) tensor
            extra = gathered_bytes + sz.pad_last * pb if (cpu and rank == 0) else sz.pad_gather * pb
        elif st.fsdp1:
            # a unit unsharded for the parameters, then its states gathered (the unit's flat size each)
            extra = sz.largest_gathered * pb * max(1, per_state)
            if cpu:
                notes.append("FSDP1 offload_to_cpu=True does not run on a CPU device (PyTorch raises)")
        else:
            extra = 0  # DDP: `.to("cpu")` copies to the host (on a CPU device it is the tensor itself)
    else:  # sharded: DCP
        if sharding and st.fsdp1:
            # chunk clones of parameters and states stay; one unit's states gathered on top
            extra = (1 + per_state) * sz.local * pb + per_state * sz.largest_gathered * pb
        elif st.fsdp1:
            # NO_SHARD: FSDP1 returns a full state dict instead (`_post_state_dict_hook`: "When using
            # NO_SHARD ... full_state_dict will be returned"); measured on the CPU probes, the model's
            # tensors are not copied and the optimizer's flat-state path (`_optim_utils`) copies every
            # state once. Taken from the measurement, not traced line by line.
            extra = sz.states * pb
        elif sharding and cpu:
            # `_SerialCpuLoader` clones a shard shorter than its padded storage, and
            # `_write_files_from_queue` keeps every written tensor in `tensor_dict` until the file ends
            extra = sz.short_views * pb
        else:
            extra = 0
        if sharding:  # this rank's chunks of the parameters and of their states
            writer = round(sz.local * (1 + ratio)) * pb
        else:  # replicated: each item written once, spread over the ranks (`_dedup_save_plans`)
            writer = -(-full_bytes // max(1, gpus if st.distributed else 1))
        # On a GPU `_OverlappingCpuLoader` copies every item to the host and `tensor_dict` keeps it
        # until the rank's file is written: the rank's whole share, in host memory.
        host = 0 if cpu else writer
    return extra, host, writer


def _save_reserved(train, st, shard: int, mode: str, mem: MemoryEstimate, peak: int) -> int | None:
    """The reserved peak through rank 0's save: the training run's allocations (mem.reserved_replay) and
    the save's (alloc_trace.checkpoint_events) replayed; None where they are not written (full-offload,
    pipeline stages, no training replay)."""
    args = mem.reserved_replay
    # the strategies and modes the recorded saves check (tests/test_alloc_trace.py); not tensor parallelism
    if (args is None or args[0] in ("pp-stage", "events") or mode not in CHECKPOINT_REPLAY_MODES
            or st.name not in CHECKPOINT_REPLAY_STRATEGIES or isinstance(train.model, TPRankSpec)):
        return None
    tr, name, world, shard_, device, backend, workspace, expandable, init, max_split = args
    events = allocation_events(tr, name, world, shard_, device, backend, workspace, init)
    last_key = max(e[1] for e in events if e[0] == "alloc")
    events += checkpoint_events(tr, name, shard_, mode, last_key)
    a = replay(events, expandable_segments=expandable, max_split_size=max_split, rounding=alloc_rounding(tr.alloc_conf))
    seg = 2 << 20  # where the trace allocates less than the walk, the difference is still reserved
    # (the training step's reserved peak, with its own such difference, was reached before the save)
    return max(a.peak_reserved + seg * -(-max(0, peak - a.peak_allocated) // seg), mem.peak_reserved)


def predict_checkpoint_probe(spec: dict) -> list[dict]:
    """Predicted live bytes when the save of a CPU validation probe starts (`resident`) and at its peak
    (`peak`), per rank (`spec` as `distplan.validate.probe` takes it, with `checkpoint.mode`): device
    and host memory are one there, so the peak is what the rank holds plus everything the save adds."""

    t = spec["train"]
    train = TrainConfig(ModelSpec(**spec["model"]), seq_len=t["seq_len"], micro_batch=t["micro_batch"],
                        precision=t.get("precision", "fp32"), optimizer=t.get("optimizer", "adamw"),
                        optimizer_impl=t.get("optimizer_impl", "foreach"),
                        torch_version=spec.get("torch_version") or "")
    world = int(spec["world_size"])
    cluster = Cluster(gpus=world, gpus_per_node=int(spec.get("gpus_per_node") or world), gpu_memory_bytes=10**15,
                      gpu_name=DEFAULT_GPU, intra_link="nvlink4", inter_link="ib-ndr", nics_per_node=world)
    mem = estimate_memory(train, cluster, spec["strategy"], device="cpu", backend="gloo")
    out = []
    for rank in range(world if spec.get("mode") != "fake" else 1):  # the fake process group: rank 0
        c = estimate_checkpoint(train, cluster, spec["strategy"], spec["checkpoint"]["mode"], device="cpu",
                                mem=mem, rank=rank)
        row = {"resident": c.resident_bytes, "peak": c.device_peak_bytes}
        if (spec.get("mode") == "cpu" and world > 1 and rank != 0 and c.device_extra_bytes
                and spec["checkpoint"]["mode"] == "full-offload"):
            # gloo's worker thread (ProcessGroupGloo::runLoop) still holds the previous all-gather's work,
            # and with it its output, for a moment after the main thread's wait() returns: the next
            # gathered tensor can be allocated before the previous one is freed (1 run in 6 of the CPU
            # checkpoint probe). Whether NCCL's work objects hold outputs past wait() is not measured yet.
            row["peak_gloo_race"] = c.device_peak_bytes + c.device_extra_bytes
        out.append(row)
    return out
