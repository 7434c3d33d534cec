"""Context parallelism (CP): every sequence split over `cp` ranks, attention as a ring, as torchtitan runs it.

`TrainConfig.cp` = c. torchtitan (`torchtitan/distributed/utils.py` `create_context_parallel_ctx`) runs
each step inside `torch.distributed.tensor.experimental.context_parallel`, which splits the sequence
dimension of the inputs, the targets and the RoPE table over the cp mesh dimension with the head-tail
load balancer (`_context_parallel/_load_balancer.py` `_HeadTailLoadBalancer`: 2c chunks, rank r keeps
chunks r and 2c-1-r, so each rank holds s/c tokens and the same share of the causal mask) and turns SDPA
(flash / memory-efficient / cuDNN) into ring attention (`_context_parallel/_attention.py`). The mesh is
(pp, dp_replicate, dp_shard, cp, tp) from outer to inner (`ParallelDims.build_mesh`), and FSDP shards
over dp_shard x cp flattened (`dp_shard_cp`): the cp ranks hold different tokens of the same sequences,
so their gradients are averaged like data-parallel ones.

So one CP rank is a data-parallel rank of a run with sequences of s/c tokens (`cp_view`): its activations,
logits, loss and RoPE tables are those of s/c tokens, and the strategies run over gpus / (tp * pp) ranks
(dp x cp). What differs is attention:

- FLOPs: a rank's queries (s/c) attend over the whole causal sequence: 1/c of the full attention's
  (`_templated_ring_attention`; the load balancer evens the causal mask out), i.e. c times what s/c-token
  sequences would cost (`attention_flops_factor`).
- Collectives, per layer and micro-step, on the cp group (`cp_raw_schedule`), with torch's default
  `_cp_options.rotate_method = ALL_GATHER` (torchtitan's `context_parallel_rotate_method` default too):
  forward one all-gather of the rank's K and V concatenated (`_AllGatherRotater`: 2 b (s/c) kv_dim
  elements in the compute dtype), backward the same all-gather again plus c ring shifts of the fp32 dK/dV
  (`_templated_ring_attention_backward`: `dkv_rotater` is always `_AllToAllRotater`, and
  `_functional_collectives.permute_tensor` is one `all_to_all_single` sending the whole buffer to the
  next rank; `_cp_options.convert_to_f32` accumulates in fp32). Full activation checkpointing repeats
  the forward all-gather in backward.
- Memory: the saved tensors are the flash kernel's (local q, k, v, output, logsumexp), as without CP; the
  ring adds transients inside each attention backward (`ring_backward_bytes`): the gathered K/V (c times
  the local K/V), local K/V copies (`contiguous`, `cat`, the kernel's gradients), the fp32 dQ/dK/dV
  accumulators and the dK/dV ring buffers.

Known limitations: the forward's ring transients (the gathered K/V and the fp32 merge of the partial
outputs, `_SDPAMerger`) are not in the walk: at the end of forward the loss's logits (n x V) are far
larger for language-model vocabularies. The ring's collectives are counted on the critical path (the
implementation waits for the gathered K/V after the first local block). The ALL_TO_ALL rotate method
(`set_rotate_method("alltoall")`) is not modelled.

With pipeline stages (pp.py) a cp rank of a stage holds s/c tokens of each of the stage's micro-batches:
the stage walk, the boundary tensors (b (s/c) h) and the bubble are those of the view; the ring's
collectives are the busiest pipeline rank's layers times the micro-batches (torchtitan's mesh: pp
outermost, then dp, cp, tp).
"""

from __future__ import annotations

from dataclasses import dataclass

from .activations import regime_for
from .activations_attention import attention_widths
from .config import TrainConfig, check_cp, checkpoint_every  # noqa: F401 (check_cp re-exported: config checks)
from .pp_schedule import rank_stage_ids, stage_layers, virtual_stages
from .tp import _HALF  # the compute dtype of each precision: one map for TP and CP


@dataclass(frozen=True)
class CPView(TrainConfig):
    """One context-parallel rank's training step: `seq_len` is s / cp, the tokens it holds of each sequence;
    `cp` stays the group size (attention's FLOPs, the ring's collectives and transients read it)."""

    _cp_local = True


def cp_view(train: TrainConfig) -> TrainConfig:
    """The rank's view (`CPView`), or `train` itself when cp = 1 or it is a view already."""
    if train.cp == 1 or isinstance(train, CPView):
        return train
    fields = {k: getattr(train, k) for k in train.__dataclass_fields__}
    fields["seq_len"] = train.seq_len // train.cp
    return CPView(**fields)


def attention_flops_factor(train: TrainConfig) -> int:
    """How many times the attention FLOPs of `train.seq_len`-token sequences a rank runs: cp for a view
    (its s/c queries against the whole sequence's keys: (s^2 / c) / (s/c)^2), else 1."""
    return train.cp if isinstance(train, CPView) else 1


def _elem(regime: str) -> int:
    return 4 if regime == "fp32" else 2


def ring_backward_bytes(train: TrainConfig, regime: str) -> int:
    """Transient bytes of one ring-attention backward near its worst instant, beyond the saved tensors and
    the incoming output gradient, for a view with cp > 1 (0 otherwise).

    `_templated_ring_attention_backward` with the head-tail load balancer, on the ranks that hold the first
    chunks (from the second step on they run half their queries against each received K/V and
    `_partial_update` the fp32 dQ). Ke = 2 b (s/c) kv_dim elements of the compute dtype, K4 the same in
    fp32, Qe = b (s/c) q_width of the compute dtype, Q4 in fp32:
    - the gathered K/V of the cp group (`_AllGatherRotater`): c x Ke;
    - local K/V copies: `key.contiguous()`/`value.contiguous()` of the transposed inputs, the `cat` that is
      sent, the kernel's dK/dV: 3 Ke;
    - fp32 dK/dV: the accumulator (`zeros_like(key, dtype=float32)`, later the received buffer), the `cat`
      sent to the next rank, the permuted copy in flight: 3 K4;
    - the kernel's dQ for half the queries: Qe / 2; the fp32 dQ accumulator and `_partial_update`'s new
      tensor: 2 Q4.
    Measured with the CPU storage tracker (`validate.cp.measure_ring_backward`, torch 2.13, the worst rank
    of c = 2, 4, 8, fp32 and bf16, with and without grouped-query attention, 21 shapes;
    tests/data/cp_ring_backward_cpu.json): this is -7.7% to +3.9% of the measured transient, whose worst
    instant moves between the first and later ring steps with the shape (tests/test_cp.py)."""
    if not isinstance(train, CPView) or train.cp == 1:
        return 0
    q_width, _, kv = attention_widths(train)
    n = train.micro_batch * train.seq_len
    e = _elem(regime)
    ke, k4 = 2 * n * kv * e, 2 * n * kv * 4
    qe, q4 = n * q_width * e, n * q_width * 4
    return (train.cp + 3) * ke + 3 * k4 + qe // 2 + 2 * q4


def cp_raw_schedule(train: TrainConfig, family: str) -> tuple:
    """The cp group's collectives of one optimizer step (module docstring): (op, group, group_size,
    dtype, message_bytes, calls, phase, unit) tuples as `comm._raw_schedule` makes them. Message bytes
    follow the probes' convention: an all-gather's gathered output, an all-to-all's input."""
    if not isinstance(train, CPView) or train.cp == 1:
        return ()
    c, m = train.cp, train.model
    _, _, kv = attention_widths(train)
    regime = regime_for(train, family)
    dt = "float32" if regime == "fp32" else _HALF[train.precision]
    e = _elem(regime)
    n = train.micro_batch * train.seq_len  # this rank's tokens
    layers, steps = m.layers, train.grad_accum
    if train.pp > 1:  # the busiest pipeline rank: its stages' layers, once per micro-batch (pp.py)
        v = virtual_stages(train.pp_schedule)
        layers = sum(stage_layers(m.layers, train.pp * v, sid) for sid in rank_stage_ids(train.pp_schedule, train.pp, 0))
        steps = train.pp_microbatches
    calls = layers * steps
    every = checkpoint_every(train.checkpointing)
    recompute = len(range(0, layers, every)) * steps if every else 0  # blocks 0, K, 2K, ... recomputed
    return (("all_gather", "cp", c, dt, c * 2 * n * kv * e, calls, "forward", "cp_kv"),
            ("all_gather", "cp", c, dt, c * 2 * n * kv * e, calls + recompute, "backward", "cp_kv"),
            ("all_to_all", "cp", c, "float32", 2 * n * kv * 4, c * calls, "backward", "cp_dkv"))


