"""The terms both memory walks share (memory.py's replica walk, fsdp_walk.py's FSDP walk): what
`memory.estimate_memory` works out once per estimate, handed to the walks' phases as one frozen record.

Sizes are in bytes unless a name ends in `_elems` (elements) or is a per-element width (`pb`, `gb`, `cb`, `r`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class WalkTerms:
    """One estimate's walk terms (see memory.estimate_memory, where each is computed and explained)."""
    train: Any  # TrainConfig (after the CP and TP views)
    st: Any  # Strategy
    m: Any  # the model
    act: Any  # activations.ActivationBreakdown
    lay: Any  # state_layout.Layout
    notes: list  # the estimate's notes (the walks append to it)
    walked_blocks: Callable  # memory.walked_blocks as estimate_memory found it (a test replaces it)
    regime: str
    device: str
    backend: str
    pb: int  # parameter bytes per element
    gb: int  # gradient bytes per element
    cb: int  # compute (FSDP param_dtype, activation) bytes per element
    mixed: bool  # mixed precision
    shard: int  # ranks a parameter is sharded over
    L: int  # blocks
    v: int  # one tensor-parallel rank's vocabulary shard (entries)
    h: int  # hidden size (entries)
    n_tok: int  # tokens per micro-batch
    r: int  # residual stream bytes per element
    ev: int  # every-K checkpointing's K (0: none)
    later: bool  # the walk is of a micro-step after the first (gradient accumulation)
    every: bool  # grad_sync 'every' (sync every micro-step)
    offload_params: bool  # FSDP CPU offload of parameters and optimizer state
    in_place: bool  # FSDP2 adds a later micro-step's gradients in place (`_in_place_block_peak`)
    acts_fwd: int  # activations at the end of forward
    acts_bwd: int  # activations at the loss's backward
    loss_bwd_tmp: int  # the loss's backward transients
    head_bwd: int  # the LM head's backward transients (0: no such instant)
    head_acts: int  # activations at the LM head's backward
    head_elems: int  # LM head (or tied) + final norm elements
    first_acts: int  # every block's activations (the first block's backward)
    outside_first: int  # what else is saved then (inputs, every block's weight cache)
    last_acts: int  # block 0's activations and what the blocks share (the last block's backward)
    outside_last: int  # what else is saved then
    freed: int  # saved bytes freed by a block's backward peak
    blk_tmp: int  # transient bytes at a block's backward peak
    wgrad_elems: int  # weight-gradient elements alive at a block's backward peak
    plain_freed: int  # `freed` of a block not checkpointed (every-K)
    plain_tmp: int  # `blk_tmp` of a block not checkpointed (every-K)
    opt_tmp: int  # optimizer-step intermediates

    def block_backward_bytes(self, j: int) -> tuple[int, int]:
        """Every-K: (saved bytes freed, transient bytes) at block j's backward peak, recomputed or not (without
        every-K, every block's: `freed` and `blk_tmp`)."""
        if not self.ev:
            return self.freed, self.blk_tmp
        if j % self.ev == 0:
            return 0, self.plain_tmp + self.act.recompute_block - self.plain_freed
        return self.plain_freed, self.plain_tmp
