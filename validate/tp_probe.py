"""Tensor-parallel probe of one decoder block on the fake process group (rank 0 of `tp` ranks, CPU).

    python -m distplan.validate.tp_probe --cases CASES.json      # prints one JSON result per case

Each case is {"model": ModelSpec fields, "train": {"seq_len", "micro_batch", "precision" (bf16: a bf16
module; fp32; bf16-mixed: fp32 module under CPU autocast), "attention"},
"tp", "sequence_parallel"}. The reference decoder's block (`validate.model.Block`) is split by
`parallelize_module` with torchtitan's Llama plan (`torchtitan/models/llama3/infra/parallelize.py`
`apply_tp`, names mapped to ours): attn_norm/mlp_norm `SequenceParallel` (with SP), attn and mlp
`PrepareModuleInput` (Shard(1) with SP, else Replicate, to Replicate), wq/wk/wv and w_gate/w_up (fc)
`ColwiseParallel`, wo and w_down (proj) `RowwiseParallel` (output Shard(1) with SP, else Replicate);
the attention then runs heads / tp local heads. Measured on rank 0: the bytes autograd saves in the
block's forward (`saved_tensors_hooks`, each storage once, parameters and the shared RoPE tables
excluded; the block input counted, as a norm saves it) and the collectives of its forward and backward (`CommDebugMode`). The fake process group
executes no collective, so step time is not measured. One process per call: the fake group is
initialised once.
"""

from __future__ import annotations

import argparse
import json
import sys

from distplan.planner.model import ModelSpec

from .matrix import HF_TP_TYPES
from .model import Block, Decoder, rope_tables


def _plan(block, sp: bool):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    inp = Shard(1) if sp else Replicate()
    plan = {
        "attn": PrepareModuleInput(input_layouts=(inp, None, None), desired_input_layouts=(Replicate(), None, None)),
        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=inp),
        "mlp": PrepareModuleInput(input_layouts=(inp,), desired_input_layouts=(Replicate(),)),
    }
    if block.mlp.kind == "swiglu":
        plan.update({"mlp.w_gate": ColwiseParallel(), "mlp.w_up": ColwiseParallel(),
                     "mlp.w_down": RowwiseParallel(output_layouts=inp)})
    else:
        plan.update({"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=inp)})
    if sp:
        plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
    return plan


def _storage(x):
    """The storage behind a saved tensor: a DTensor's local shard, an async collective's waited result."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    x = x._local_tensor if isinstance(x, DTensor) else x
    if isinstance(x, AsyncCollectiveTensor):
        x = x.trigger_wait()
    return x.untyped_storage()


def _saved_bytes_hook(skip_tensors):
    """A `saved_tensors_hooks` pack function counting each saved storage once (parameters and `skip_tensors`
    excluded), and the list it appends the storages' bytes to."""
    skip = {_storage(t).data_ptr() for t in skip_tensors}
    seen, kept = set(), []

    def pack(z):
        st = _storage(z)
        if st.data_ptr() not in skip and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            kept.append(st.nbytes())
        return z

    return pack, kept


def _setup(case: dict):
    """(model spec, tp, sequence parallel, train dict, micro-batch, seq len, dtype, 1-D CPU mesh), seeded."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh


    spec = ModelSpec(**case["model"])
    t, sp = int(case["tp"]), bool(case.get("sequence_parallel"))
    tr = case["train"]
    b, s = int(tr["micro_batch"]), int(tr["seq_len"])
    dtype = torch.bfloat16 if tr["precision"] == "bf16" else torch.float32
    mesh = init_device_mesh("cpu", (t,))
    torch.manual_seed(0)
    return spec, t, sp, tr, b, s, dtype, mesh


def run_case(case: dict) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    spec, t, sp, tr, b, s, dtype, mesh = _setup(case)
    block = Block(spec, tr.get("attention", "sdpa")).to(dtype)
    parallelize_module(block, mesh, _plan(block, sp))
    block.attn.heads //= t  # the local heads (torchtitan's Attention views with -1 heads)
    block.attn.kv_heads //= t
    local_s = -(-s // t) if sp else s
    x = torch.randn(b, local_s, spec.hidden, dtype=dtype, requires_grad=True)
    cos, sin = rope_tables(s, spec.head_dim) if spec.position == "rope" else (None, None)

    pack, kept = _saved_bytes_hook(list(block.parameters()) + [z for z in (cos, sin) if z is not None])

    import contextlib
    amp = (torch.autocast("cpu", dtype=torch.bfloat16) if tr["precision"] == "bf16-mixed"
           else contextlib.nullcontext())  # autocast: fp32 parameters, 16-bit matmuls
    comm = CommDebugMode()
    with comm:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda z: z), amp:
            out = block(x, cos, sin)
        fwd = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    out = out._local_tensor if isinstance(out, DTensor) else out
    comm2 = CommDebugMode()
    with comm2:
        out.float().sum().backward()
    bwd = {str(k).split(".")[-1]: v for k, v in comm2.get_comm_counts().items()}
    return {"saved_bytes": sum(kept), "forward": fwd, "backward": bwd,
            "local_out_shape": list(out.shape)}


def _root_plan(embedding: str, norm: str, head: str, sp: bool) -> dict:
    """torchtitan's plan outside the blocks: the token embedding `RowwiseParallel` (output Shard(1) with SP,
    else Replicate), the final norm `SequenceParallel` (with SP), the LM head `ColwiseParallel` with its
    output kept a DTensor sharded over the vocabulary (loss parallel)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    seq = Shard(1) if sp else Replicate()
    plan = {embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            head: ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        plan[norm] = SequenceParallel()
    return plan


def parallelize_decoder(model, mesh, sp: bool):
    """Split the reference decoder (`validate.model.Decoder`, RoPE, untied head) over the 1-D tensor-parallel
    `mesh` in place, as torchtitan's `apply_tp` does: the token embedding `RowwiseParallel` (input
    Replicate, output Shard(1) with SP, else Replicate), the final norm `SequenceParallel` (with SP), the
    LM head `ColwiseParallel` (output Shard(-1), kept a DTensor: loss parallel), each block by `_plan`,
    the attention's head counts divided by tp (torchtitan's Attention views with -1 heads)."""
    from torch.distributed.tensor.parallel import parallelize_module

    spec, t = model.spec, mesh.size()
    if spec.position != "rope" or spec.tie_embeddings:
        raise ValueError(f"tp={t}: the tensor-parallel probe runs RoPE models with an untied LM head "
                         f"(position={spec.position!r}, tie_embeddings={spec.tie_embeddings})")
    parallelize_module(model, mesh, _root_plan("tok_embeddings", "norm", "output", sp))
    for block in model.layers:
        parallelize_module(block, mesh, _plan(block, sp))
        block.attn.heads //= t
        block.attn.kv_heads //= t
    model.loss_parallel = True
    return model




def parallelize_hf(model, mesh, sp: bool):
    """Split a transformers causal LM (`HF_TP_TYPES`, tied head or not) over the 1-D tensor-parallel `mesh` in
    place, with the plan torchtitan applies to transformers models
    (`torchtitan/experiments/transformers_modeling_backend/infra/parallelize.py`, `apply_non_moe_tp`): the
    token embedding `RowwiseParallel` (output Shard(1) with SP, else Replicate), the final norm
    `SequenceParallel` (with SP), the LM head `ColwiseParallel` with its output kept a DTensor sharded over
    the vocabulary (loss parallel); per decoder layer input_layernorm / post_attention_layernorm
    `SequenceParallel` (with SP), self_attn `PrepareModuleInput` of its `hidden_states` keyword to
    Replicate, q/k/v_proj `ColwiseParallel`, o_proj `RowwiseParallel`, mlp `PrepareModuleInput`,
    gate/up_proj `ColwiseParallel`, down_proj `RowwiseParallel`; Qwen3's q_norm/k_norm
    `SequenceParallel(sequence_dim=2)` (the head dimension: a replicated weight over local heads).
    transformers' attention views its projections with -1 heads, so each rank runs heads / tp.
    The loss stays transformers' own (`ForCausalLMLoss` on the sharded logits, under `loss_parallel()`:
    `ctx.loss_context()` enters it because `model.loss_parallel` is set); with SP the embedding's output
    holds s / tp tokens, so the probe passes the positions (`HFWorkload.loss`, `model.tp_positions`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    cfg, t = model.config, mesh.size()
    kind = getattr(cfg, "model_type", None)
    if kind not in HF_TP_TYPES:
        raise ValueError(f"tp={t}: the tensor-parallel probe splits transformers models of type "
                         f"{', '.join(HF_TP_TYPES)}, not {kind!r}")
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    seq = Shard(1) if sp else Replicate()
    parallelize_module(model, mesh, _root_plan("model.embed_tokens", "model.norm", "lm_head", sp))
    for layer in model.model.layers:
        plan = {"self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
                "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=seq)}
        if sp:
            plan.update({"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()})
        if hasattr(layer.self_attn, "q_norm"):
            plan.update({"self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                         "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)})
        parallelize_module(layer, mesh, plan)
    if tied:
        # `parallelize_module` gave the embedding and the head a DTensor each; both are Shard(0) over the
        # vocabulary, so the head takes the embedding's again, as `tie_weights` had it
        model.lm_head.weight = model.model.embed_tokens.weight
    model.loss_parallel = True
    model.tp_positions = sp
    return model


def run_model_case(case: dict) -> dict:
    """The whole reference decoder (RoPE models) under torchtitan's plan: blocks as `run_case`, the
    token embedding `RowwiseParallel` (output Shard(1) with SP, else Replicate), the final norm
    `SequenceParallel` (with SP), the LM head `ColwiseParallel` with sharded logits and the loss under
    `loss_parallel()`. Measured: the bytes autograd saves in the forward (parameters excluded)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    spec, t, sp, tr, b, s, dtype, mesh = _setup(case)
    model = Decoder(spec, tr.get("attention", "sdpa")).to(dtype)
    parallelize_decoder(model, mesh, sp)
    tokens = torch.randint(0, spec.vocab, (b, s))
    targets = torch.randint(0, spec.vocab, (b, s))

    pack, kept = _saved_bytes_hook(model.parameters())

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda z: z), loss_parallel():
        x = model.tok_embeddings(tokens)
        cos, sin = rope_tables(s, spec.head_dim)
        for block in model.layers:
            x = block(x, cos, sin)
        logits = model.output(model.norm(x))
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    with loss_parallel():
        loss.backward()
    return {"saved_bytes": sum(kept)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", required=True, help="JSON file: a list of cases")
    args = ap.parse_args(argv)
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    with open(args.cases) as f:
        cases = json.load(f)
    worlds = {int(c["tp"]) for c in cases}
    if len(worlds) != 1:
        raise SystemExit("tp_probe: one tp per call (the fake process group is initialised once)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=worlds.pop())
    try:
        for c in cases:
            print(json.dumps(run_model_case(c) if c.get("whole_model") else run_case(c)), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
