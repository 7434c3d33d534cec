"""Record the allocation traces of the `--module` examples on the CPU, for tests/test_alloc_trace.py
(`test_module_trace_against_recorded_traces`).

    python benchmarks/alloc_modules.py OUT.json.gz [CASE_PREFIX,...]
    python benchmarks/alloc_modules.py --fsdp OUT.json.gz [CASE_PREFIX,...]   # FSDP2 and FSDP1
    python benchmarks/alloc_modules.py --checkpointing OUT.json.gz [CASE_PREFIX,...]   # full / every-2
    python benchmarks/alloc_modules.py --deep OUT.json.gz [CASE_PREFIX,...]   # a 16-block ViT
    python benchmarks/alloc_modules.py --bf16 OUT.json.gz [CASE_PREFIX,...]   # pure bf16, fp16-mixed

The MNIST CNN and the CIFAR ResNet (examples/), batch 32, under single, ddp and zero1 (rank 0 of 8 on the
fake process group; single: one process): MNIST fp32 and bf16-mixed (CPU autocast) with Adam (and, single,
AdamW's fused and for-loop kernels), CIFAR fp32 with SGD-momentum and with AdamW over two accumulated
micro-steps; every probe with `DISTPLAN_ALLOC_EVENTS`
(validate.measure.Tracker writes every storage allocation, free and collective touch in host order), so the
trace front end's written run (alloc_trace.logged_step_events from the traced step's own allocations) is
compared with what the probe allocated. About a minute on 2 cores.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alloc_record import record, selected  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = [  # (name, factory, input shape, precision, optimizer, implementation, grad_accum, strategies)
    ("mnist-fp32", "examples.mnist_cnn:make_model", [32, 1, 28, 28], "fp32", "adam", "foreach", 1, None),
    ("mnist-bf16", "examples.mnist_cnn:make_model", [32, 1, 28, 28], "bf16-mixed", "adam", "foreach", 1, None),
    ("mnist-fused", "examples.mnist_cnn:make_model", [32, 1, 28, 28], "fp32", "adamw", "fused", 1, ("single",)),
    ("mnist-for-loop", "examples.mnist_cnn:make_model", [32, 1, 28, 28], "fp32", "adamw", "for-loop", 1,
     ("single",)),
    ("cifar-fp32", "examples.cifar_resnet:make_model", [32, 3, 32, 32], "fp32", "sgd-momentum", "foreach", 1, None),
    ("cifar-accum", "examples.cifar_resnet:make_model", [32, 3, 32, 32], "fp32", "adamw", "foreach", 2, None),
]
STRATEGIES = ("single", "ddp", "zero1")
FSDP_RUNS = [  # `--fsdp`: the same models under FSDP2 (the CIFAR ResNet's BatchNorm refuses FSDP2's bf16-mixed)
    ("mnist-fp32", "examples.mnist_cnn:make_model", [32, 1, 28, 28], "fp32", "adam", "foreach", 1, None),
    ("mnist-bf16", "examples.mnist_cnn:make_model", [32, 1, 28, 28], "bf16-mixed", "adam", "foreach", 1, None),
    ("cifar-fp32", "examples.cifar_resnet:make_model", [32, 3, 32, 32], "fp32", "sgd-momentum", "foreach", 1, None),
    ("cifar-accum", "examples.cifar_resnet:make_model", [32, 3, 32, 32], "fp32", "adamw", "foreach", 2, None),
    ("cifar-bf16", "examples.cifar_resnet:make_model", [32, 3, 32, 32], "bf16-mixed", "sgd-momentum", "foreach", 1,
     ("fsdp", "fsdp-grad-op", "hsdp", "fsdp-no-shard")),
]
FSDP_STRATEGIES = ("zero2", "zero3", "fsdp", "fsdp-grad-op", "hsdp", "fsdp-no-shard")
CKPT_RUNS = [  # `--checkpointing`: full and every-2 activation checkpointing of the units (checkpoint_wrapper)
    ("mnist-fp32-full", "examples.mnist_cnn:make_model", [32, 1, 28, 28], "fp32", "adam", "foreach", 1, None),
    ("mnist-bf16-full", "examples.mnist_cnn:make_model", [32, 1, 28, 28], "bf16-mixed", "adam", "foreach", 1, None),
    ("cifar-fp32-full", "examples.cifar_resnet:make_model", [32, 3, 32, 32], "fp32", "sgd-momentum", "foreach", 1,
     None),
    ("cifar-fp32-every-2", "examples.cifar_resnet:make_model", [32, 3, 32, 32], "fp32", "adamw", "foreach", 2, None),
    ("cifar-bf16-full", "examples.cifar_resnet:make_model", [32, 3, 32, 32], "bf16-mixed", "sgd-momentum", "foreach",
     1, ("single", "ddp", "fsdp", "fsdp-no-shard")),
]
CKPT_STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op", "fsdp-no-shard")
DEEP_RUNS = [  # `--deep`: a ViT of 16 nn.TransformerEncoderLayer blocks (examples/vit_tiny.py make_deep)
    ("vit16-fp32", "examples.vit_tiny:make_deep", [16, 3, 32, 32], "fp32", "adamw", "foreach", 1, None),
    ("vit16-bf16", "examples.vit_tiny:make_deep", [16, 3, 32, 32], "bf16-mixed", "adamw", "foreach", 1, None),
    ("vit16-bf16-full", "examples.vit_tiny:make_deep", [16, 3, 32, 32], "bf16-mixed", "adamw", "foreach", 1, None),
    ("vit16-fp32-every-2", "examples.vit_tiny:make_deep", [16, 3, 32, 32], "fp32", "adamw", "foreach", 2, None),
]
DEEP_STRATEGIES = ("single", "ddp", "zero2", "zero3", "fsdp")
BF16_RUNS = [  # `--bf16`: pure bf16 training (the module cast after it is built, validate/wrap.py), and fp16-mixed
    ("mnist-bf16pure", "examples.mnist_cnn:make_model", [32, 1, 28, 28], "bf16", "adamw", "foreach", 1, None),
    ("cifar-bf16pure", "examples.cifar_resnet:make_model", [32, 3, 32, 32], "bf16", "sgd-momentum", "foreach", 1,
     None),
    ("vit-bf16pure-full", "examples.vit_tiny:make_model", [32, 3, 32, 32], "bf16", "adamw", "foreach", 1, None),
    # fp16-mixed as the fake process group runs it (no GradScaler: validate/wrap.py)
    ("mnist-fp16", "examples.mnist_cnn:make_model", [32, 1, 28, 28], "fp16-mixed", "adam", "foreach", 1, None),
]
BF16_STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-no-shard")


def cases(fsdp: bool = False, ckpt: bool = False, deep: bool = False, bf16: bool = False) -> list[dict]:
    out = []
    runs = BF16_RUNS if bf16 else DEEP_RUNS if deep else CKPT_RUNS if ckpt else FSDP_RUNS if fsdp else RUNS
    for name, factory, shape, precision, optimizer, impl, accum, strategies in runs:
        for s in strategies or (BF16_STRATEGIES if bf16 else DEEP_STRATEGIES if deep else CKPT_STRATEGIES if ckpt
                                else FSDP_STRATEGIES if fsdp else STRATEGIES):
            world = 1 if s == "single" else 8
            out.append({"id": f"{name}/{s}", "strategy": s, "world_size": world, "gpus_per_node": world,
                        "mode": "cpu" if s == "single" else "fake", "device_type": "cpu",
                        "model": {"name": factory},
                        "train": {"seq_len": 1, "micro_batch": shape[0], "grad_accum": accum, "grad_sync": "last",
                                  "precision": precision, "optimizer": optimizer, "optimizer_impl": impl,
                                  "checkpointing": "every-2" if name.endswith("every-2") else "full"
                                  if ckpt or name.endswith("-full") else "none", "attention": "sdpa"},
                        "steps": 1, "seed": 0, "module": {"factory": factory, "input_shape": shape}})
    return out


def main(argv: list[str]) -> int:
    from distplan.validate.runner import run_probe
    fsdp, ckpt, deep, bf16 = "--fsdp" in argv, "--checkpointing" in argv, "--deep" in argv, "--bf16" in argv
    argv = [a for a in argv if a not in ("--fsdp", "--checkpointing", "--deep", "--bf16")]

    def run(case, path, tmp):
        spec = dict(case, module=dict(case["module"], path=ROOT))
        m = run_probe(spec, env={"DISTPLAN_ALLOC_EVENTS": path}, timeout_s=600)
        return m, {case["id"]: path}, dict(case, torch_version=m.get("torch_version"))

    return record(argv[0], selected(cases(fsdp, ckpt, deep, bf16), argv),
                  "CPU runs of validate.probe (--module) with DISTPLAN_ALLOC_EVENTS (benchmarks/alloc_modules.py)",
                  run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
