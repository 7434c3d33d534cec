"""Precision recipes and optimizer state: bytes per parameter, per gradient, per optimizer state.

A recipe says what dtype each tensor has in the PyTorch-native implementation:
- `fp32`: fp32 params, grads, activations.
- `bf16` / pure low precision: the module cast with `.to(bfloat16)`; grads and optimizer states bf16.
- `bf16-mixed` / `fp16-mixed`: fp32 params and grads (the "master" copy is the parameter itself),
  16-bit compute: `torch.autocast` for single/ddp/zero1 (whose weight cache holds a 16-bit copy of every
  Linear weight from its forward use to the end of the autocast region) and
  `MixedPrecision(param_dtype=16-bit, reduce_dtype=fp32)` / `MixedPrecisionPolicy` for FSDP1/FSDP2
  (all-gathers in 16 bits, gradients reduced in fp32). ZeRO paper §3 counts the same recipe as
  2+2+12 = 16 bytes/param; PyTorch's native recipe holds 4+4+8 = 16 bytes/param of model state.

Optimizer states follow `torch/optim/*.py` `_init_group`: states are `torch.zeros_like(p)` in the
param's dtype, created lazily at the first step.
"""

from __future__ import annotations

from math import prod

from dataclasses import dataclass

from .strategies import FSDP2

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adamw-8bit", "adafactor")
OPTIMIZER_IMPLS = ("foreach", "fused", "for-loop")


@dataclass(frozen=True)
class Precision:
    name: str
    param_bytes: int
    """Bytes of one stored (sharded) parameter element."""
    grad_bytes: int
    """Bytes of one gradient element as `.grad` holds it (and as DDP buckets / FSDP reduce it)."""
    compute_bytes: int
    """Bytes of one activation element (the dtype matmuls run in)."""
    mixed: bool
    """16-bit compute over fp32 parameters (autocast or FSDP mixed precision)."""

    @property
    def compute_dtype(self) -> str:
        return {4: "float32", 2: "bfloat16" if "bf16" in self.name else "float16"}[self.compute_bytes]


_RECIPES = {
    "fp32": Precision("fp32", 4, 4, 4, False),
    "bf16-mixed": Precision("bf16-mixed", 4, 4, 2, True),
    "fp16-mixed": Precision("fp16-mixed", 4, 4, 2, True),
    "bf16": Precision("bf16", 2, 2, 2, False),
}


def get_precision(name: str) -> Precision:
    if name not in _RECIPES:
        raise ValueError(f"unknown precision {name!r}; accepted: {', '.join(PRECISIONS)}")
    return _RECIPES[name]


def optimizer_state_elems(optimizer: str, shapes: list[tuple]) -> tuple[int, float]:
    """(state elements in the param dtype, extra bytes) for one rank's parameter tensors.

    adam/adamw: exp_avg + exp_avg_sq (`torch/optim/adam.py` `_init_group`); sgd-momentum: one
    momentum_buffer (`torch/optim/sgd.py`, a clone of the first grad); adafactor: factored second moment,
    row + column vectors for matrices, full for vectors, no first moment (`torch/optim/_adafactor.py`).
    adamw-8bit (bitsandbytes, not PyTorch-native): 2 one-byte states + one fp32 absmax per 2048-element
    block, reported as extra bytes. The per-parameter `step` counters are scalars and ignored.
    """
    n = sum(prod(s) for s in shapes)
    if optimizer in ("adam", "adamw"):
        return 2 * n, 0.0
    if optimizer == "sgd":
        return 0, 0.0
    if optimizer == "sgd-momentum":
        return n, 0.0
    if optimizer == "adafactor":
        elems = 0
        for s in shapes:
            if len(s) >= 2:
                elems += prod(s[:-1]) + prod(s[:-2] + s[-1:])
            else:
                elems += prod(s)
        return elems, 0.0
    if optimizer == "adamw-8bit":
        return 0, 2.0 * n + 2 * 4.0 * n / 2048
    raise ValueError(f"unknown optimizer {optimizer!r}; accepted: {', '.join(OPTIMIZERS)}")


def optimizer_conflict(optimizer: str, family: str) -> str | None:
    """Why `optimizer` does not run under a strategy of `family` (strategies.Strategy.family), or None.

    torch.optim.Adafactor on FSDP2's parameters (DTensors sharded on dim 0, zero2/zero3): its factored row
    and column statistics are norms over the sharded rows, a `_NormPartial` placement that its in-place
    updates (`mul_`, `pow_`) cannot keep, so the first optimizer step raises (measured with torch 2.13.0,
    foreach and for-loop: `validate --optimizer adafactor`, Qwen2.5-0.5B and a Llama on 8 fake ranks).
    FSDP1 runs it on the flat parameters, where it factors nothing (one vector per unit: its second moment
    is as large as the parameters); DDP and ZeRO-1 on the real shapes."""
    if optimizer == "adafactor" and family == FSDP2:
        return ("torch.optim.Adafactor fails on FSDP2's sharded DTensor parameters (an in-place update of its "
                "row/column norms, a _NormPartial placement: measured with torch 2.13)")
    return None
