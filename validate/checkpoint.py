"""Saving a checkpoint inside a probe, measured: the per-rank peak of live tensor bytes while saving.

Modes, as users write them with PyTorch's Distributed Checkpoint state-dict API
(`torch/distributed/checkpoint/state_dict.py`), the same calls for DDP, FSDP1 and FSDP2:

- `full`: `get_model_state_dict` / `get_optimizer_state_dict` with
  `StateDictOptions(full_state_dict=True)` (FSDP1: `StateDictType.FULL_STATE_DICT`, `offload_to_cpu=False`,
  `rank0_only=False`; FSDP2: every DTensor redistributed to `Replicate` and kept), then rank 0
  `torch.save`s both;
- `full-offload`: the same with `cpu_offload=True` (FSDP1: `offload_to_cpu=True, rank0_only=True`;
  otherwise `_gather_state_dict(..., cpu_offload=True, ranks_only=(0,))`: each gathered tensor moved to the
  CPU on rank 0 and dropped on the others);
- `sharded`: the default options (FSDP1: `SHARDED_STATE_DICT`; FSDP2: its DTensors), written by every
  rank with `torch.distributed.checkpoint.save` (`FileSystemWriter`).

What is measured (the probe's storage tracker, `measure.Tracker`): live bytes when the save starts
(the training state after `zero_grad(set_to_none=True)`), the peak during the save, live bytes after
the state dicts are dropped, and the bytes of the tensors in this rank's state dicts. On a CPU probe
device and host memory are one; the planner's CPU prediction adds the two.

Known limitations: ZeroRedundancyOptimizer (zero1) has no DCP state-dict support (its
`consolidate_state_dict` path is not run); the trace front ends' modules are saved the same way.
"""

from __future__ import annotations

import os

MODES = ("full", "full-offload", "sharded")


def _tensor_bytes(obj) -> int:
    import torch

    if hasattr(obj, "local_shards"):  # ShardedTensor (FSDP1's sharded state dict)
        return sum(s.tensor.numel() * s.tensor.element_size() for s in obj.local_shards())
    if isinstance(obj, torch.Tensor):
        t = getattr(obj, "_local_tensor", obj)  # DTensor: this rank's shard
        return t.numel() * t.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def save_checkpoint(model, optimizer, cfg: dict, tracker, rank: int) -> dict:
    """Save model and optimizer state in `cfg['mode']` under `cfg['dir']`, measured by `tracker`
    (entered by the caller). Returns what was measured on this rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    mode = cfg.get("mode")
    if mode not in MODES:
        raise ValueError(f"checkpoint.mode={mode!r}: accepted: {', '.join(MODES)}")
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
        raise ValueError("checkpoint: ZeroRedundancyOptimizer (zero1) has no DCP state-dict support")
    folder = cfg.get("dir") or os.environ.get("DISTPLAN_PROBE_DIR") or "."
    tracker.phase = "checkpoint"
    tracker.reset_peak()
    start = tracker.live_bytes
    opts = StateDictOptions(full_state_dict=mode != "sharded", cpu_offload=mode == "full-offload")
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    held = tracker.live_bytes
    sd_bytes = _tensor_bytes(msd) + _tensor_bytes(osd)
    if mode == "sharded":
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(folder, "dcp"))
    elif rank == 0:
        torch.save({"model": msd, "optim": osd}, os.path.join(folder, "full.pt"))
    if dist.is_initialized():
        dist.barrier()
    by_op: dict = {}
    tracker.components()  # the snapshot at the peak
    for _seq, n, phase, op in (tracker._snapshot[1] if tracker._snapshot else ()):
        if phase == "checkpoint":
            by_op[op] = by_op.get(op, 0) + n
    peak = tracker.peak_bytes
    del msd, osd
    out = {"mode": mode, "start_bytes": start, "peak_bytes": peak, "held_bytes": held,
           "end_bytes": tracker.live_bytes, "state_dict_bytes": sd_bytes, "peak_new_by_op": by_op}
    tracker.phase = "idle"
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, out)
    else:
        ranks = [out]
    return {"mode": mode, "per_rank": ranks}
