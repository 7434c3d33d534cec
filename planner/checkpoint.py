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
- DCP's writer (`checkpoint/filesystem.py`): on a GPU `_OverlappingCpuLoader` copies items to the host
  up to `per_thread_copy_ahead` (10,000,000 bytes) ahead of the writes; on a CPU device
  `_SerialCpuLoader` writes tensors in place (a clone only of a view smaller than its storage).
  Replicated (DDP) items are written once, spread over the ranks (`_dedup_save_plans`).
- `torch.save` of GPU tensors (`torch/serialization.py` `_save`) copies one storage at a time to the
  host as it writes it.

Save time: the bytes the busiest writer writes over the storage bandwidth per writing rank
(`storage_bytes_per_s`; full: rank 0 writes everything; sharded: the ranks write in parallel, which
assumes the file system's aggregate bandwidth grows with the writers).

Known limitations: DCP's planning metadata (pickled save plans gathered on rank 0, a few hundred bytes per
tensor per rank) and the collectives' time are not counted; ZeroRedundancyOptimizer (zero1) has no DCP
state-dict support and is not modelled; FSDP1 with `offload_to_cpu` cannot run on a CPU device (PyTorch
raises), so the CPU probes do not check `full-offload` under FSDP1; DeepSpeed's checkpoints are not
modelled; CPU-offloaded training (`cpu_offload=params`) is planned as if its state were on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from .config import CHECKPOINT_MODES, DEFAULT_STORAGE_GBPS, Cluster, TrainConfig  # noqa: F401
from .memory import RESERVED_MARGIN, MemoryEstimate, _all_state_elems, estimate_memory, layout
from .model import unit_sizes
from .strategies import Strategy, get_strategy

MODES = CHECKPOINT_MODES
DCP_COPY_AHEAD_BYTES = 10_000_000
"""`FileSystemWriter(per_thread_copy_ahead=10_000_000)` (torch/distributed/checkpoint/filesystem.py)."""


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
    """Host (CPU) bytes of state-dict tensors at the peak (rank 0 for full state dicts)."""
    written_bytes: int
    """Bytes written to storage by all ranks together."""
    writer_bytes: int
    """Bytes the busiest rank writes."""
    save_time_s: float
    fits: bool
    """The device peak, with the allocator margin (memory.RESERVED_MARGIN) and the process overhead
    (CUDA context, NCCL), fits the GPU."""
    notes: list = field(default_factory=list)

    @property
    def device_peak_bytes(self) -> int:
        return self.resident_bytes + self.device_extra_bytes

    def to_dict(self) -> dict:
        return {"mode": self.mode, "device_peak_bytes": int(self.device_peak_bytes),
                "resident_bytes": int(self.resident_bytes), "device_extra_bytes": int(self.device_extra_bytes),
                "host_bytes": int(self.host_bytes), "written_bytes": int(self.written_bytes),
                "writer_bytes": int(self.writer_bytes), "save_time_s": self.save_time_s, "fits": self.fits,
                "notes": list(self.notes)}


def _shard_group(st: Strategy, cluster: Cluster) -> int:
    """Ranks a state is sharded over (memory.estimate_memory's rule)."""
    world = 1 if st.name == "single" else cluster.gpus
    if st.name == "fsdp-no-shard" or st.shard_group == "none":
        return 1
    return world if st.shard_group == "world" else min(world, cluster.local_size)


@dataclass(frozen=True)
class _Sizes:
    """Element counts the save paths allocate (see `_sizes`)."""

    params: int  # unsharded parameters
    states: int  # unsharded optimizer state elements (elementwise states)
    gathered: int  # FSDP: parameters as all-gathered (padded); else `params`
    largest_gathered: int  # the largest single all-gathered tensor (FSDP2) or FSDP1 unit
    chunks: int  # FSDP1 sharded: this rank's chunk of every parameter (rank 0: ceil(dim0 / W) rows)
    shard: int  # parameter elements this rank stores


def _sizes(train: TrainConfig, st: Strategy, shard: int) -> _Sizes:
    m = train.model
    lay = layout(m, st.family, shard, st.shards_params, st.shards_optimizer)
    states, _ = _all_state_elems(m, train.optimizer)
    root_shapes, block_shapes, *_ = unit_sizes(m)
    if st.family == "fsdp2":
        gathered = lay.unshard_root + m.layers * lay.unshard_block
        largest = max(-(-s[0] // shard) * shard * prod(s[1:]) for s in list(root_shapes) + list(block_shapes))
    elif st.family == "fsdp1":
        gathered = lay.unshard_root + m.layers * lay.unshard_block
        largest = max(lay.unshard_root, lay.unshard_block)
    else:
        gathered, largest = lay.total, lay.largest_param
    c = layout(m, "fsdp2", shard, True, True)  # torch.chunk's rank-0 rows = FSDP2's dim-0 shard
    chunks = c.shard_root + m.layers * c.shard_block
    return _Sizes(lay.total, states, gathered, largest, chunks, lay.shard_total)


def estimate_checkpoint(train: TrainConfig, cluster: Cluster, strategy: str | Strategy, mode: str,
                        storage_bytes_per_s: float = DEFAULT_STORAGE_GBPS * 1e9, device: str = "cuda",
                        mem: MemoryEstimate | None = None, rank: int = 0) -> CheckpointEstimate | None:
    """Predict one strategy's checkpoint save (module docstring); None where it is not modelled (zero1,
    DeepSpeed).

    `device='cpu'` predicts a CPU run (the probes): device and host memory are one, so `.to('cpu')`
    copies nothing and the CPU-side bytes are counted in `device_extra_bytes`; `rank` picks the rank
    (full-offload differs between rank 0 and the others)."""
    if mode not in MODES:
        raise ValueError(f"checkpoint={mode!r}: accepted: {', '.join(MODES)}")
    st = get_strategy(strategy)
    if st.family == "zero1" or (train.framework == "deepspeed" and st.name in ("zero1", "zero2", "zero3")):
        return None
    if train.tp > 1:  # one TP rank's parameters (tp.py): each TP rank saves its own slice
        from .tp import tp_view
        train, cluster = tp_view(train, cluster)
    if mem is None:
        mem = estimate_memory(train, cluster, st, device=device)
    shard = _shard_group(st, cluster)
    sz = _sizes(train, st, shard)
    pb = train.prec.param_bytes  # fp32 master parameters under mixed precision; optimizer states alike
    elems = sz.params
    scale = sz.gathered / elems if elems else 1.0  # all-gathered states are padded as the parameters are
    full_bytes = (sz.params + sz.states) * pb  # the state dict's tensors, unpadded
    gathered_bytes = sz.gathered * pb + round(sz.states * scale) * pb
    fam = st.family
    cpu = device == "cpu"
    notes: list[str] = []

    resident = mem.components["params"] + mem.components["optimizer"]
    if fam == "ddp":
        resident += sz.params * train.prec.grad_bytes  # DDP's buckets, allocated at construction
    resident += 2 * train.micro_batch * train.seq_len * 8  # the last batch: token ids and labels, int64

    host = 0
    if mode == "full":
        if fam in ("fsdp2", "fsdp1") and shard > 1:
            if fam == "fsdp2":
                extra = gathered_bytes
            else:  # parameters cloned (unpadded); states gathered into padded flat buffers
                extra = sz.params * pb + round(sz.states * scale) * pb
        elif fam == "fsdp1":  # NO_SHARD: the post-state-dict hook still clones every parameter
            extra = sz.params * pb
        else:
            extra = 0
        # rank 0's torch.save copies one storage at a time to the host (FSDP1: a unit's flat buffer)
        host = 0 if cpu else sz.largest_gathered * pb
        written = writer = full_bytes
    elif mode == "full-offload":
        if rank == 0 and not cpu:
            host = full_bytes
        if fam == "fsdp2" and shard > 1:
            # one gathered tensor on the device at a time; on a CPU device `.to("cpu")` is the tensor
            # itself, so rank 0 keeps every gathered (padded) tensor
            extra = gathered_bytes if (cpu and rank == 0) else sz.largest_gathered * pb
        elif fam == "fsdp1":
            # a unit unsharded for the parameters, then its states gathered (the unit's flat size each)
            per_unit = max(1, round(sz.states / elems) if elems else 1)
            extra = sz.largest_gathered * pb * per_unit
            if cpu:
                notes.append("FSDP1 offload_to_cpu=True does not run on a CPU device (PyTorch raises)")
        else:
            extra = 0  # DDP: `.to("cpu")` copies to the host (on a CPU device it is the tensor itself)
        written = writer = full_bytes
    else:  # sharded: DCP
        if fam == "fsdp1" and shard > 1:
            # chunk clones of parameters and states stay; one unit's states gathered on top
            per_state = round(sz.states / elems) if elems else 0
            clones = (sz.chunks + per_state * sz.chunks) * pb
            extra = clones + per_state * sz.largest_gathered * pb
        elif fam == "fsdp1":
            # NO_SHARD: the parameters are saved as views of the flat parameter, but the optimizer's
            # sharded state dict clones every state (`_optim_utils._shard_orig_param_state`)
            extra = sz.states * pb
        else:
            extra = 0
        if fam in ("ddp", "single") or shard == 1:
            writer = -(-full_bytes // max(1, cluster.gpus if st.name != "single" else 1))
        else:
            writer = (sz.shard + round(sz.states * sz.shard / elems)) * pb if elems else 0
        written = full_bytes if fam in ("ddp", "single") or shard == 1 else writer * shard
        if fam == "fsdp1" and shard > 1:
            host = 0 if cpu else min(extra, DCP_COPY_AHEAD_BYTES + sz.largest_gathered * pb)
        else:
            host = 0 if cpu else min(writer, DCP_COPY_AHEAD_BYTES + sz.largest_gathered * pb)
    time_s = writer / storage_bytes_per_s if storage_bytes_per_s > 0 else float("inf")
    peak = resident + extra
    # The save allocates after the step, from the caching allocator's segments: its reserved bytes are
    # the allocated peak plus memory.RESERVED_MARGIN (no allocation trace is written for the save).
    fits = int((1 + RESERVED_MARGIN) * peak) + mem.process_overhead <= cluster.gpu_memory_bytes
    if not fits and mem.fits:
        notes.append(f"the {mode} checkpoint save does not fit though the training step does")
    return CheckpointEstimate(st.name, mode, int(resident), int(extra), int(host), int(written), int(writer),
                              time_s, fits, notes)


def predict_checkpoint_probe(spec: dict) -> list[dict]:
    """Predicted live bytes when the save of a CPU validation probe starts (`resident`) and at its peak
    (`peak`), per rank (`spec` as `distplan.validate.probe` takes it, with `checkpoint.mode`): device
    and host memory are one there, so the peak is what the rank holds plus everything the save adds."""
    from .api import DEFAULT_GPU
    from .model import ModelSpec

    t = spec["train"]
    train = TrainConfig(ModelSpec(**spec["model"]), seq_len=t["seq_len"], micro_batch=t["micro_batch"],
                        precision=t.get("precision", "fp32"), optimizer=t.get("optimizer", "adamw"),
                        optimizer_impl=t.get("optimizer_impl", "foreach"))
    world = int(spec["world_size"])
    cluster = Cluster(gpus=world, gpus_per_node=int(spec.get("gpus_per_node") or world), gpu_memory_bytes=10**15,
                      gpu_name=DEFAULT_GPU, intra_link="nvlink4", inter_link="ib-ndr", nics_per_node=world)
    mem = estimate_memory(train, cluster, spec["strategy"], device="cpu", backend="gloo")
    out = []
    for rank in range(world if spec.get("mode") != "fake" else 1):
        c = estimate_checkpoint(train, cluster, spec["strategy"], spec["checkpoint"]["mode"], device="cpu",
                                mem=mem, rank=rank)
        out.append({"resident": c.resident_bytes, "peak": c.device_peak_bytes})
    return out
