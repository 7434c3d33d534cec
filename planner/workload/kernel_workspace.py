"""cuDNN's convolution workspaces, measured on this machine's GPU, one convolution call at a time.

A convolution on CUDA asks the caching allocator for a workspace while it runs (`Conv_v8.cpp`: the
execution plan's `getWorkspaceSize()`, allocated for the call and freed after it). Its size is that of
the engine cuDNN's heuristics pick for the exact call (shapes, dtype, strides, output mask, GPU, cuDNN
version), which no formula gives: on an H100 with cuDNN 9.19, the MNIST CNN's second convolution's
backward took 7 MiB at batch 32 and 34 MiB at batch 128. `torch.cuda.max_memory_allocated` counts it;
no tensor owns it, so the probes' tracker does not.

`measure(kernels)` runs each distinct call recorded by `trace.profile_module` (its segments'
`kernels`: the arguments of `aten.convolution` / `aten.convolution_backward`) on the GPU with that
layer's tensors only, twice (the second with cuDNN's plan cached, as in a training step), and returns
{key: bytes}: the allocator's peak during the call minus what was allocated before and minus the
call's outputs. The planner adds a workspace at the instant its call runs (`module_plan`). No GPU, no
figures: the plan then says the workspaces are not counted.
"""

from __future__ import annotations

import sys


def available() -> str | None:
    """The local CUDA GPU's name, or None (no torch, no CUDA)."""
    try:
        import torch
    except ImportError:
        return None
    try:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # a broken driver is the same as none for this purpose
        return None


def _round(n: int) -> int:
    """The caching allocator's rounding of a request (512-byte multiples, `CUDACachingAllocator.cpp`)."""
    return max(512, -(-n // 512) * 512) if n else 0


def _one(args: dict) -> int:
    import torch

    dev = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args["dtype"])
    x = torch.randn(args["input"], device=dev, dtype=dtype)
    w = torch.randn(args["weight"], device=dev, dtype=dtype)
    b = torch.randn(args["weight"][1 if args["transposed"] else 0] * (args["groups"] if args["transposed"] else 1),
                    device=dev, dtype=dtype) if args["bias"] else None
    conv = (args["stride"], args["padding"], args["dilation"], args["transposed"], args["output_padding"],
            args["groups"])

    def forward():
        return torch.ops.aten.convolution(x, w, b, *conv)

    if args["phase"] == "forward":
        call = forward
    else:
        g = torch.randn_like(forward())
        bias_sizes = [b.shape[0]] if b is not None else None

        def call():
            return torch.ops.aten.convolution_backward(g, x, w, bias_sizes, *conv, args["output_mask"])

    worst = 0
    for _ in range(2):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        outs = call()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        made = sum(_round(o.numel() * o.element_size()) for o in outs if isinstance(o, torch.Tensor))
        worst = max(worst, peak - base - made)
        del outs
    return max(0, int(worst))


def measure(kernels) -> dict:
    """{key: workspace bytes} for every distinct convolution in `kernels` (dicts with "key" and
    "args"); {} when there is no CUDA GPU here."""
    if available() is None:
        return {}
    import torch

    out: dict = {}
    for k in kernels:
        if k["key"] not in out:
            try:
                out[k["key"]] = _one(k["args"])
            except Exception as exc:  # noqa: BLE001 - one call that cannot run here is left unmeasured
                print(f"distplan: cuDNN workspace of {k['key']!r} not measured: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
    torch.cuda.empty_cache()
    return out
