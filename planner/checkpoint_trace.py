"""The allocations of a checkpoint save (`checkpoint_events`): the live tensors of DDP's and a plain
module's state dict, FSDP2's and FSDP1's full or sharded state dicts, gathered and cloned as
torch.distributed.checkpoint and `state_dict` make them."""

from __future__ import annotations

from math import prod

from .config import TrainConfig
from .model import unit_sizes
from .state_layout import _all_state_elems
from .strategies import DDP, FSDP2, REGISTRY, SINGLE, get_strategy
from .trace_events import _Events


CHECKPOINT_REPLAY_STRATEGIES = tuple(n for n, s in REGISTRY.items()
                                     if s.family in (SINGLE, DDP, FSDP2) or s.fsdp1 and s.shards_params and not s.hybrid)
"""Strategies whose saves `checkpoint_events` writes and the recorded saves check (single's path is DDP's:
the live tensors); NO_SHARD, HSDP and tensor-parallel saves keep the margin."""


CHECKPOINT_REPLAY_MODES = ("full", "sharded")
"""Checkpoint saves whose allocations `checkpoint_events` writes; `full-offload` keeps the margin (its
device transients differ between a GPU and the CPU probes, so the recorded traces cannot check them)."""


def checkpoint_events(train: TrainConfig, strategy, shard: int, mode: str, first_key: int) -> list:
    """Rank 0's allocations while it saves model and optimizer state after the measured step
    (planner/checkpoint.py, validate/checkpoint.py), to append to `allocation_events` (keys from
    `first_key` on). Only what is made on the device; what stays until the save ends is not freed.

    - single / DDP: the state dicts are the live tensors (`full`), DCP writes them as they are
      (`sharded`): nothing.
    - FSDP2 `full`: each parameter, then each of its optimizer states, `redistribute`d to Replicate
      (`_state_dict_utils._gather_state_dict`): an all-gather into a new tensor of the padded unsharded
      size, kept (the narrowed parameter is a view of it). `sharded`: the DTensors as they are: nothing
      (rank 0's shards fill their storage, so DCP's CPU loader clones none).
    - FSDP1 `full`: the root unit unsharded (`_full_pre_state_dict_hook`) while each block is unsharded
      in turn, its parameters cloned (kept) and resharded, then the root's cloned; the optimizer
      (`_optim_utils._allgather_orig_param_states`) all-gathers each state of a FlatParameter (the root's
      first) into a new padded flat buffer, kept. `sharded`: the same unsharding with this rank's chunk of
      each parameter cloned (`_ext_chunk_tensor`), and each FlatParameter's states gathered, their chunks
      cloned, the gathered buffers freed."""
    st = get_strategy(strategy)
    if mode not in CHECKPOINT_REPLAY_MODES:
        raise ValueError(f"checkpoint_events: mode={mode!r}: accepted: {', '.join(CHECKPOINT_REPLAY_MODES)}")
    E = _Events()
    E.n = first_key
    m = train.model
    pb = train.prec.param_bytes
    sharding = shard > 1 and st.shards_params and st.fsdp
    if not sharding:
        return E.ev
    states, _ = _all_state_elems(m, train.optimizer)
    per_state = round(states / (m.param_count() or 1))  # elementwise states per parameter (AdamW: 2)
    root_shapes, block_shapes, *_ = unit_sizes(m)
    embed, _, head = m.units()
    order = [s for _, s in embed.params] + list(block_shapes) * m.layers + [s for _, s in head.params]

    def chunk(s) -> int:  # rank 0's rows (torch.chunk): ceil(d0 / shard)
        return -(-s[0] // shard) * prod(s[1:])

    if st.fsdp2:
        if mode == "full":
            for s in order:
                E.a(chunk(s) * shard * pb)
            for s in order:
                for _ in range(per_state):
                    E.a(chunk(s) * shard * pb)
        return E.ev
    # FSDP1: units of flat parameters, padded to a multiple of the shard group
    def padded(elems: int) -> int:
        return -(-elems // shard) * shard
    root_elems = sum(prod(s) for s in root_shapes)
    block_elems = sum(prod(s) for s in block_shapes)
    kept = (lambda s: prod(s)) if mode == "full" else chunk
    root_flat = E.a(padded(root_elems) * pb)
    for _ in range(m.layers):
        flat = E.a(padded(block_elems) * pb)
        for s in block_shapes:
            E.a(kept(s) * pb)
        E.f(flat)
    for s in root_shapes:
        E.a(kept(s) * pb)
    E.f(root_flat)
    for elems, shapes in [(root_elems, root_shapes)] + [(block_elems, block_shapes)] * m.layers:
        for _ in range(per_state):
            buf = E.a(padded(elems) * pb)
            if mode == "sharded":
                for s in shapes:
                    E.a(chunk(s) * pb)
                E.f(buf)
    return E.ev
