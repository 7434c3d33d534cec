"""Tensor parallelism (TP) on a 2-D device mesh: (dp, tp), TP inside a node, as torchtitan lays it out.

`TrainConfig.tp` = t splits every block with `torch.distributed.tensor.parallel.parallelize_module`
following torchtitan's Llama plan (`torchtitan/models/llama3/infra/parallelize.py` `apply_tp`): q, k,
v and gate, up (fc) `ColwiseParallel`, o and down (proj) `RowwiseParallel`, the token embedding
`RowwiseParallel`, the LM head `ColwiseParallel` with loss parallel (logits stay sharded over the
vocabulary), norms replicated. With `sequence_parallel` (torchtitan's default) the norms are
`SequenceParallel`, the rowwise outputs Shard(1) (reduce-scatter) and `PrepareModuleInput` all-gathers
the attention's and the MLP's input once; without it the same plan with Replicate layouts (one
all-reduce of the rowwise output in forward, one of the module input's gradient in backward: the
three colwise Linears' partial gradients are summed on the DTensor first). Transformers models get the same
split by their own module names (torchtitan's plan for them,
`torchtitan/experiments/transformers_modeling_backend/infra/parallelize.py` `apply_non_moe_tp`, which
`distplan validate --hf-config --tp` applies), plus Qwen3's per-head q_norm/k_norm as replicated weights
over each rank's heads (`SequenceParallel(sequence_dim=2)`).

The data-parallel strategies (DDP, ZeRO, FSDP, HSDP) then run over the dp = gpus / t ranks of the
other mesh dimension on the per-TP-rank model (`model.TPRankSpec`): `tp_view` gives the planner's
memory, schedule and step-time code that view, so their formulas apply unchanged: a dp group has
gpus_per_node / t ranks per node, each with 1/t of the node's NICs (all t groups run at once, one
per TP rank).

Per-layer TP collectives per micro-step (group "tp", t ranks on the intra-node link; message b*s*h in
the activation dtype; on the critical path in eager PyTorch, so the step time adds them whole):
- without SP: forward 2 all-reduces (attention and MLP outputs), backward 2 (their inputs' gradients);
  outside the blocks the embedding's output all-reduce (forward) and the LM head input's gradient
  all-reduce (backward).
- with SP: all-gather + reduce-scatter for each of those (forward: gather the norm output, scatter the
  rowwise output; backward the reverse); the embedding reduce-scatters its output (forward) and
  all-gathers its gradient (backward), the head all-gathers its input (forward) and reduce-scatters
  its gradient (backward). The same bytes on the wire as the all-reduces.
Activation checkpointing ('full', every-K): each recomputed block repeats part of its forward's TP
collectives in backward (`tp_raw_schedule`); op-level selective checkpointing's recomputation is not
modelled.

Outside the blocks, forward: loss parallel's three all-reduces of b*s fp32 values per micro-step
(`distributed/tensor/parallel/loss.py`: `_log_softmax` all-reduces the row max and the sum of
exponentials, `_nll_loss_forward` the target's logit through `_MaskPartial._reduce_value`).

With SP the replicated norm weights (and LayerNorm biases) get Partial gradients: the weight's
gradient sums over the sequence dimension, which is sharded, and DTensor keeps the Partial placement
on `.grad` (AccumulateGrad does not redistribute). Qwen3's q_norm/k_norm weights (head_dim each, 2 per
layer) are such replicated weights with or without SP. Where they are all-reduced depends on who reads
them:
- `single` (no data parallelism): torch.optim's AdamW/Adam read each gradient in three DTensor ops
  (`optim/adam.py` `_multi_tensor_adam`: `_foreach_lerp_(exp_avgs, grads)` and
  `_foreach_addcmul_(exp_avg_sqs, grads, grads)`; `_single_tensor_adam` the same `lerp_` and
  `addcmul_`), and DTensor's sharding propagation redistributes each Partial operand on its own:
  three all-reduces of each norm parameter per optimizer step, in the gradient dtype (measured on the
  fake process group: 3 x (2L + 1) for an RMSNorm decoder). Other optimizers: not modelled.
- FSDP2 on the dp dimension: `FSDPParam._get_grad_inner_tensor` redistributes each gradient to the
  parameter's TP placement before the reduce-scatter: one all-reduce per norm parameter per optimizer
  step (between micro-steps the gradient accumulates as a Partial DTensor, in reduce_dtype under mixed
  precision: `to_accumulated_grad_if_needed`), in the unsharded parameter's dtype with one micro-step.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from .activations import regime_for
from .nccl_model import _interconnect
from .config import Cluster, TrainConfig, check_tp, checkpoint_every, fsdp2_grads_in_reduce_dtype
from .model import TPRankSpec
from .strategies import REGISTRY, SINGLE

TP_STRATEGIES = tuple(n for n, s in REGISTRY.items() if not s.distributed or s.fsdp2)
"""The data-parallel strategies `distplan validate` composes tensor parallelism with: FSDP2 on the dp
dimension of the (dp, tp) mesh as torchtitan lays it out, or none (`single`: dp = 1). DDP and FSDP1 over
DTensor parameters are not torchtitan layouts; the planner still estimates them."""

_HALF = {"bf16-mixed": "bfloat16", "bf16": "bfloat16", "fp16-mixed": "float16", "fp32": "float32"}


def tp_view(train: TrainConfig, cluster: Cluster) -> tuple[TrainConfig, Cluster]:
    """(train with one TP rank's parameter shapes, the data-parallel cluster of gpus / tp ranks).

    The identity for tp = 1, and for a view already taken (its model is a `TPRankSpec`)."""
    if train.tp == 1 or isinstance(train.model, TPRankSpec):
        return train, cluster
    views = train.__dict__.get("_tp_views")  # kept on the config: hashing it costs more than the view
    if views is None:
        views = {}
        object.__setattr__(train, "_tp_views", views)
    view = views.get(cluster)
    if view is None:
        view = views[cluster] = _tp_view(train, cluster)
    return view


@lru_cache(maxsize=1024)
def _tp_view(train: TrainConfig, cluster: Cluster) -> tuple[TrainConfig, Cluster]:
    t = train.tp
    check_tp(t, train.model, "--tp", cluster.gpus, cluster.local_size)
    g = cluster.local_size
    if cluster.inter_bytes_per_s:
        nics, inter = cluster.nics_per_node, cluster.inter_bytes_per_s / t
    elif cluster.nics_per_node % t == 0:
        nics, inter = cluster.nics_per_node // t, None
    else:
        ic = _interconnect(cluster.inter_link, cluster.catalog_dirs)
        nics, inter = cluster.nics_per_node, ic.busbw_bytes_per_s * cluster.nics_per_node / t
    dp = replace(cluster, gpus=cluster.gpus // t, gpus_per_node=g // t, nics_per_node=nics,
                 inter_bytes_per_s=inter)
    return replace(train, model=train.rank_model), dp


def tp_raw_schedule(train: TrainConfig, family: str) -> tuple:
    """The TP group's collectives of one optimizer step: (op, group, group_size, dtype, message_bytes,
    calls, phase, unit) tuples as `comm._raw_schedule` makes them (module docstring)."""
    m = train.model
    out = _tp_raw(m.hidden, m.layers, train.micro_batch * train.seq_len, train.grad_accum, train.tp,
                  train.sequence_parallel, train.precision, regime_for(train, family))
    out += (("all_reduce", "tp", train.tp, "float32", train.micro_batch * train.seq_len * 4,
             3 * train.grad_accum, "forward", "tp_loss"),)
    every = checkpoint_every(train.checkpointing)
    if every:
        # Activation checkpointing recomputes a checkpointed block's forward in backward, and with it
        # the TP collectives up to the last tensor backward needs: non-reentrant `checkpoint` stops the
        # recomputation there (`utils/checkpoint.py` `_StopRecomputationError`). The block's last saved
        # tensor is the down (proj) projection's input, so the MLP's rowwise output collective is not
        # redone: per recomputed block, without SP the attention output's all-reduce; with SP the
        # attention's and the MLP's input all-gathers and the attention output's reduce-scatter.
        n = train.micro_batch * train.seq_len
        res = "float32" if regime_for(train, family) in ("fp32", "autocast") else _HALF[train.precision]
        out_dt = "float32" if regime_for(train, family) == "fp32" else _HALF[train.precision]
        k = len(range(0, m.layers, every)) * train.grad_accum  # blocks 0, K, 2K, ... recomputed
        size = {"float32": 4, "bfloat16": 2, "float16": 2}
        if train.sequence_parallel:
            out += (("all_gather", "tp", train.tp, res, n * m.hidden * size[res], 2 * k, "backward", "tp_recompute"),
                    ("reduce_scatter", "tp", train.tp, out_dt, n * m.hidden * size[out_dt], k, "backward",
                     "tp_recompute"))
        else:
            out += (("all_reduce", "tp", train.tp, out_dt, n * m.hidden * size[out_dt], k, "backward",
                     "tp_recompute"),)
    # Replicated weights with Partial gradients: with SP the norms (module docstring); Qwen3's q_norm and
    # k_norm (`Qwen3RMSNorm(head_dim)` over each rank's heads: torchtitan's plan for transformers models makes
    # them `SequenceParallel(sequence_dim=2)`, replicated weights, with or without SP) always
    replicated = []  # (parameters, elements each)
    if train.sequence_parallel:
        replicated.append(((2 * m.layers + 1) * (2 if m.norm == "layernorm" else 1), m.hidden))
    if m.qk_norm:
        replicated.append((2 * m.layers, m.head_dim))
    if replicated:
        # one all-reduce per such parameter in the gradient's dtype: the fp32 parameter's under fp32 and
        # autocast, FSDP2's param_dtype (the unsharded parameter's) under mixed precision, the model's under
        # pure bf16
        regime = regime_for(train, family)
        gdt = "float32" if regime in ("fp32", "autocast") else _HALF[train.precision]
        if family != SINGLE and (train.grad_accum > 1 or fsdp2_grads_in_reduce_dtype(train)):
            # accumulated in reduce_dtype (fp32), still Partial; from torch 2.15 made in it
            gdt = "float32" if train.precision != "bf16" else gdt
        for count, elems in replicated:
            if family == SINGLE:
                if train.optimizer in ("adam", "adamw"):
                    out += (("all_reduce", "tp", train.tp, gdt, elems * (4 if gdt == "float32" else 2),
                             3 * count, "optimizer", "tp_norm_grad"),)
            else:
                out += (("all_reduce", "tp", train.tp, gdt, elems * (4 if gdt == "float32" else 2),
                         count, "backward", "tp_norm_grad"),)
    return out


@lru_cache(maxsize=1024)
def _tp_raw(h: int, L: int, n: int, A: int, t: int, sp: bool, precision: str, regime: str) -> tuple:
    # the residual stream (embedding and norm outputs, their gradients) is fp32 under fp32 and
    # autocast; the Linears' outputs (and their gradients) are in the compute dtype
    res = "float32" if regime in ("fp32", "autocast") else _HALF[precision]
    out = "float32" if regime == "fp32" else _HALF[precision]
    size = {"float32": 4, "bfloat16": 2, "float16": 2}
    r_msg, o_msg = n * h * size[res], n * h * size[out]
    if not sp:
        return (("all_reduce", "tp", t, out, o_msg, 2 * L * A, "forward", "tp_block"),
                ("all_reduce", "tp", t, res, r_msg, A, "forward", "tp_embed"),
                ("all_reduce", "tp", t, res, r_msg, 2 * L * A, "backward", "tp_block"),
                ("all_reduce", "tp", t, res, r_msg, A, "backward", "tp_head"))
    return (("all_gather", "tp", t, res, r_msg, 2 * L * A, "forward", "tp_block"),
            ("reduce_scatter", "tp", t, out, o_msg, 2 * L * A, "forward", "tp_block"),
            ("reduce_scatter", "tp", t, res, r_msg, A, "forward", "tp_embed"),
            ("all_gather", "tp", t, res, r_msg, A, "forward", "tp_head"),
            ("all_gather", "tp", t, out, o_msg, 2 * L * A, "backward", "tp_block"),
            ("reduce_scatter", "tp", t, res, r_msg, 2 * L * A, "backward", "tp_block"),
            ("reduce_scatter", "tp", t, res, r_msg, A, "backward", "tp_head"),
            ("all_gather", "tp", t, res, r_msg, A, "backward", "tp_embed"))
