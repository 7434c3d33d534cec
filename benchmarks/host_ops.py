"""ATen ops one eager training step dispatches, counted, against the planner's host-floor count.

The host floor of the time model (planner/kernels.py `host_ops`, `optimizer_host_ops`) is the number of
ATen ops the host dispatches per step times the host time per op. This script counts them on the reference
decoder (`distplan.validate.model.Decoder`) with a TorchDispatchMode (views included), one feature at a
time, at 2 and 3 layers so that one block's ops and the ops outside the blocks separate, and prints the
count next to the planner's: forward, backward (with the recompute under checkpointing) and the
optimizer (foreach AdamW), per block and outside.

Run: python benchmarks/host_ops.py   (CPU, about a minute; needs torch)
"""

from __future__ import annotations

import torch

from distplan.planner.activations import regime_for
from distplan.planner.config import TrainConfig
from distplan.planner.kernels import host_ops, optimizer_host_ops, param_tensors
from distplan.planner.model import ModelSpec
from distplan.validate.calibrate_measure import count_aten_ops, reference_step
from distplan.validate.matrix import SHAPES_CPU

VARIANTS = {
    "llama": {}, "mha": dict(kv_heads=4), "gelu": dict(mlp="gelu"), "layernorm": dict(norm="layernorm"),
    "learned": dict(position="learned"), "qkv_bias": dict(qkv_bias=True), "linear_bias": dict(linear_bias=True),
    "tied": dict(tie_embeddings=True),
    "gpt2-like": dict(mlp="gelu", norm="layernorm", position="learned", linear_bias=True, kv_heads=4,
                      tie_embeddings=True),
}


def counted(shape: dict, precision: str, checkpointing: str) -> dict:
    """ATen ops per phase ('fwd', 'bwd', 'opt') of a training step of the reference decoder."""
    forward, backward, optimizer = reference_step(shape, precision=precision, checkpointing=checkpointing)
    loss, fwd = count_aten_ops(forward)
    return {"fwd": fwd, "bwd": count_aten_ops(lambda: backward(loss))[1], "opt": count_aten_ops(optimizer)[1]}


def main() -> None:
    torch.set_num_threads(1)
    base = dict(SHAPES_CPU["llama-tiny"], name="host-ops")
    print(f"{'precision':10} {'checkpointing':13} {'variant':11} {'block fwd/bwd/opt':>22} "
          f"{'outside fwd/bwd/opt':>22}   (counted | planned)")
    worst = 0.0
    for precision in ("fp32", "bf16-mixed", "bf16"):
        for ck in ("none", "full", "selective", "selective-op"):
            for name, change in VARIANTS.items():
                shape = dict(base, **change)
                a, b = counted(dict(shape, layers=2), precision, ck), counted(dict(shape, layers=3), precision, ck)
                blk = [b[k] - a[k] for k in ("fwd", "bwd", "opt")]
                out = [a[k] - 2 * v for k, v in zip(("fwd", "bwd", "opt"), blk)]
                spec = ModelSpec(**dict(shape, layers=3))
                tr = TrainConfig(model=spec, seq_len=32, micro_batch=2, precision=precision, checkpointing=ck)
                f, bw, of, ob = host_ops(tr, regime_for(tr, "single"))
                per_block = param_tensors(spec) - param_tensors(ModelSpec(**dict(shape, layers=2)))
                opt_out = optimizer_host_ops(tr, param_tensors(spec)) - 3 * 2 * per_block
                total_c = 3 * sum(blk) + sum(out)
                total_p = 3 * (f + bw + 2 * per_block) + of + ob + opt_out
                worst = max(worst, abs(total_p / total_c - 1))
                print(f"{precision:10} {ck:13} {name:11} {'/'.join(map(str, blk)):>10} | "
                      f"{f:.0f}/{bw:.0f}/{2 * per_block} {'/'.join(map(str, out)):>10} | {of:.0f}/{ob:.0f}/{opt_out:.0f}"
                      f"   step at 3 layers {total_c} | {total_p:.0f} ({total_p / total_c - 1:+.1%})")
    print(f"worst |planned / counted - 1| of a 3-layer step: {worst:.1%}")


if __name__ == "__main__":
    main()
