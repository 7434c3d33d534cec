"""`distplan calibrate`'s measurements of this machine: matmuls, memory bandwidth, attention, kernel launches,
a host step, collectives. It imports torch (through the reference decoder); `calibrate_command` imports it
only when the command runs."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from distplan.planner.model import ModelSpec

from .calibrate_fit import COLLECTIVE_OPS, CalibrationError, attention_flops
from .model import Decoder
from .wrap import wrap


# -- measurement (torch inside) --------------------------------------------------------------------

def check_device(device: str) -> None:
    """CalibrationError unless torch is installed and `device` ('cuda' or 'cpu') is usable here."""
    if device not in ("cuda", "cpu"):
        raise CalibrationError(f"--device={str(device)[:40]!r}: accepted: cuda, cpu")
    try:
        import torch
    except ImportError:
        raise CalibrationError("distplan calibrate needs torch: pip install 'distplan[validate]'") from None
    if device == "cuda" and not torch.cuda.is_available():
        why = "this torch has no CUDA" if torch.version.cuda is None and not getattr(torch.version, "hip", None) \
            else "no GPU is visible"
        raise CalibrationError(f"--device cuda: no GPU found ({why}, torch {torch.__version__}); "
                               f"accepted here: --device cpu (measures the CPU, to test the pipeline)")


class _Clock:
    """Times a callable on one device: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: str):
        import torch
        self.torch = torch
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def run(self, fn: Callable[[], Any], reps: int) -> float:
        """Seconds per call of `reps` back-to-back calls."""
        if self.cuda:
            start = self.torch.cuda.Event(enable_timing=True)
            end = self.torch.cuda.Event(enable_timing=True)
            self.sync()
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e-3 / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps

    def best(self, fn: Callable[[], Any], target_s: float, trials: int = 3, max_reps: int = 1000) -> float:
        """Fastest of `trials` timings of about `target_s` each, after one warm-up call."""
        fn()
        self.sync()
        one = self.run(fn, 1)
        reps = max(1, min(max_reps, int(target_s / max(one, 1e-7))))
        return min(self.run(fn, reps) for _ in range(trials))


def _dtype(device: str):
    """bf16 on a GPU that has it (fp16 on one without, e.g. V100, T4), fp32 on the CPU."""
    import torch
    if device != "cuda":
        return torch.float32
    try:
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # older torch: no including_emulation
        bf16 = torch.cuda.is_bf16_supported()
    return torch.bfloat16 if bf16 else torch.float16


def _dtype_name(device: str) -> str:
    import torch
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[_dtype(device)]


def measure_matmul(device: str, shapes: Sequence[tuple[int, int, int]], target_s: float = 0.02,
                   step: Callable[[str], None] | None = None) -> list[tuple[int, int, int, float]]:
    """(m, n, k, seconds) of `torch.matmul` of an (m, k) by a (k, n) matrix, bf16 on a GPU, fp32 on the CPU."""
    import torch
    clock, dt, out = _Clock(device), _dtype(device), []
    for m, n, k in shapes:
        if step:
            step(f"matmul {m}x{n}x{k}")
        a = torch.randn(m, k, device=device, dtype=dt)
        b = torch.randn(k, n, device=device, dtype=dt)
        c = torch.empty(m, n, device=device, dtype=dt)
        out.append((m, n, k, clock.best(lambda: torch.matmul(a, b, out=c), target_s)))
        del a, b, c
    return out


def measure_bandwidth(device: str, nbytes: int, target_s: float = 0.02,
                      step: Callable[[str], None] | None = None) -> dict[str, float]:
    """Bytes read + written per second: 'copy' (`Tensor.copy_`, 2 x nbytes) and 'add'
    (`torch.add(a, b, out=c)`, 3 x nbytes), fp32 tensors of `nbytes` each."""
    import torch
    clock, n = _Clock(device), max(1, nbytes // 4)
    a = torch.ones(n, device=device)
    b = torch.ones(n, device=device)
    c = torch.empty(n, device=device)
    if step:
        step("memory bandwidth: copy")
    t_copy = clock.best(lambda: c.copy_(a), target_s)
    if step:
        step("memory bandwidth: add")
    t_add = clock.best(lambda: torch.add(a, b, out=c), target_s)
    return {"copy": 2 * 4 * n / t_copy, "add": 3 * 4 * n / t_add}


def measure_attention(device: str, shapes: Sequence[tuple[int, int, int, int]], target_s: float = 0.02,
                      step: Callable[[str], None] | None = None) -> list[dict]:
    """Forward and backward seconds of causal `scaled_dot_product_attention` at (b, heads, s, head_dim),
    flash backend where it runs (else the default choice, said in 'backend'). Backward = (forward +
    backward) - forward, the forward run with gradients enabled as in training."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    clock, dt, out = _Clock(device), _dtype(device), []
    for b, h, s, d in shapes:
        if step:
            step(f"attention b={b} heads={h} s={s} d={d}")
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dt, requires_grad=True) for _ in range(3))
        g = torch.randn(b, h, s, d, device=device, dtype=dt)

        def fwd():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd():
            torch.autograd.grad(fwd(), (q, k, v), g)

        backend = "flash"
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                t_f = clock.best(fwd, target_s)
                t_fb = clock.best(fwd_bwd, target_s)
        except RuntimeError:  # no flash kernel for this device/dtype: the default choice
            backend = "default"
            t_f = clock.best(fwd, target_s)
            t_fb = clock.best(fwd_bwd, target_s)
        out.append({"b": b, "heads": h, "s": s, "head_dim": d, "backend": backend,
                    "fwd_flops": attention_flops(b, h, s, d), "fwd_s": t_f, "bwd_s": max(t_fb - t_f, 1e-9)})
        del q, k, v, g
    return out


def measure_launch(device: str, ops: int = 256, trials: int = 5,
                   step: Callable[[str], None] | None = None) -> dict[str, float]:
    """Per-op host time and per-kernel GPU time of tiny eager ops (`x = x * 1.0001` on one element).

    GPU: a `torch.cuda._sleep` kernel holds the GPU while the host queues `ops` tiny kernels, so CUDA
    events around them measure back-to-back kernels (no CUDA graph), and perf_counter around the loop the
    host's issue time. The sleep is doubled until it outlasts the issue. CPU: both are the op's time.
    The catalog's `host_op_us` comes from `measure_host_step` (a whole step's ops cost the host more than
    a loop of one tiny op); `calibrate` keeps this one's `kernel_overhead_s`.
    """
    import torch
    if step:
        step("launch overhead")
    x = torch.ones(1, device=device)
    if device != "cuda":
        def loop():
            y = x
            for _ in range(ops):
                y = y * 1.0001
        loop()
        per = min(_timeit(loop) for _ in range(trials)) / ops
        return {"kernel_overhead_s": per, "host_op_s": per}
    (x * 1.0001).sum().item()  # the kernels loaded, the allocator warm
    cycles, gpu_best, host_best = 1_000_000, math.inf, math.inf
    for _ in range(trials + 8):
        s0, s1, s2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize()
        h0 = time.perf_counter()
        s0.record()
        torch.cuda._sleep(cycles)
        s1.record()
        y = x
        h1 = time.perf_counter()
        for _ in range(ops):
            y = y * 1.0001
        h2 = time.perf_counter()
        s2.record()
        s2.synchronize()
        slept = s0.elapsed_time(s1) * 1e-3
        if slept < 1.5 * (h2 - h0):  # the GPU may have caught up with the host: sleep longer, again
            cycles *= 2
            continue
        gpu_best = min(gpu_best, s1.elapsed_time(s2) * 1e-3 / ops)
        host_best = min(host_best, (h2 - h1) / ops)
    if not math.isfinite(gpu_best):
        raise RuntimeError("launch overhead: the sleep kernel never outlasted the host's issue time")
    return {"kernel_overhead_s": gpu_best, "host_op_s": host_best}


HOST_STEP_MODEL = dict(layers=4, hidden=256, heads=4, kv_heads=2, ffn_hidden=704, vocab=2048, max_positions=128,
                       mlp="swiglu", norm="rmsnorm", position="rope", tie_embeddings=False, linear_bias=False,
                       qkv_bias=False, name="calibrate-host-step")
"""A Llama-style reference decoder small enough that its training step is host-bound on any GPU."""


def count_aten_ops(fn: Callable[[], Any]) -> tuple[Any, int]:
    """(fn's result, the ATen ops it dispatched), counted with a TorchDispatchMode: every op the
    dispatcher runs, views and reshapes included, as the planner's host floor counts them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.ops += func.namespace == "aten"
            return func(*args, **(kwargs or {}))

    with _Count():
        out = fn()
    return out, _Count.ops


def reference_step(shape: dict, device: str = "cpu", precision: str = "fp32", checkpointing: str = "none",
                   tokens: tuple[int, int] = (2, 32)) -> tuple[Callable[[], Any], Callable[[], Any], Callable[[], None]]:
    """The reference decoder (`shape`: ModelSpec fields) wrapped as the `single` probe runs it (foreach
    AdamW), after three warm-up steps: (forward -> loss, backward(loss), optimizer step + zero_grad)."""
    import torch

    spec = ModelSpec(**shape)
    dev = torch.device(device)
    b, s = tokens
    train = dict(seq_len=s, micro_batch=b, grad_accum=1, precision=precision, optimizer="adamw",
                 optimizer_impl="foreach", checkpointing=checkpointing, attention="sdpa")
    torch.manual_seed(0)
    model, opt, ctx = wrap(Decoder(spec, "sdpa", checkpointing).to(dev), "single", train, 1, 1, dev)
    x = torch.randint(0, spec.vocab, (b, s), device=dev)
    y = torch.randint(0, spec.vocab, (b, s), device=dev)

    def forward():
        with ctx.autocast():
            return model(x, y)

    def optimizer():
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):  # optimizer state, the allocator's pools, lazy kernels
        forward().backward()
        optimizer()
    return forward, lambda loss: loss.backward(), optimizer


def measure_host_step(device: str, steps: int = 7, step: Callable[[str], None] | None = None) -> dict[str, float]:
    """Host time per dispatched ATen op of a whole eager training step, as the planner's host floor
    counts it (`planner.kernels.host_ops`, `optimizer_host_ops`): the reference decoder (HOST_STEP_MODEL,
    fp32, 2 x 128 tokens, foreach AdamW, no checkpointing) stepped `steps` times; one step's ATen ops
    counted (`count_aten_ops`), the median step timed without the counter. The GPU work of this model
    is a small fraction of its host time, so the step measures the host: Python, the dispatcher, autograd
    and the launches, which a tiny-op loop (`measure_launch`) undercounts."""
    import statistics

    import torch

    if step:
        step("host time per op (a host-bound training step)")
    forward, backward, optimizer = reference_step(HOST_STEP_MODEL, device, tokens=(2, 128))

    def one():
        backward(forward())
        optimizer()

    _, ops = count_aten_ops(one)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        one()
        sync()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"host_op_s": med / max(1, ops), "host_step_s": med, "host_step_ops": ops}


def _timeit(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _device_info(device: str) -> dict:
    import platform

    import torch
    info = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
            "hip": getattr(torch.version, "hip", None), "date": _dt.date.today().isoformat()}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(device_name=torch.cuda.get_device_name(0), memory_bytes=int(p.total_memory),
                    device_count=torch.cuda.device_count(), uuid=str(getattr(p, "uuid", "") or ""),
                    sm_count=int(p.multi_processor_count))
        try:
            info["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # no NCCL in this build (ROCm: RCCL reports the same way, or not)
            info["nccl"] = None
    else:
        name = platform.processor() or platform.machine() or "cpu"
        try:
            with open("/proc/cpuinfo") as fh:
                for line in fh:
                    if line.startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        try:
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            mem = 16 * 2**30
        info.update(device_name=f"CPU {name}", memory_bytes=int(mem), device_count=1, nccl=None)
    info["nccl_algo"] = os.environ.get("NCCL_ALGO")
    return info


def _nvml_peak_bandwidth(uuid: str) -> float | None:
    """Peak memory bandwidth from NVML: max memory clock x 2 (double data rate) x bus width / 8."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            u = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
            h = pynvml.nvmlDeviceGetHandleByUUID(u) if uuid else pynvml.nvmlDeviceGetHandleByIndex(0)
            mhz = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
            bits = pynvml.nvmlDeviceGetMemoryBusWidth(h)
        finally:
            pynvml.nvmlShutdown()
        return 2.0 * mhz * 1e6 * bits / 8 if mhz and bits else None
    except Exception:
        return None


# -- collectives: one process per rank ------------------------------------------------------------

def _free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_worker(rank: int, world: int, port: int, backend: str, sizes: list, ops: list,
                       algo: str | None, out_path: str) -> None:
    """One rank: init on 127.0.0.1, time each op at each size (max over ranks), rank 0 writes JSON."""
    if algo:
        os.environ["NCCL_ALGO"] = algo
    import datetime

    import torch
    import torch.distributed as dist
    kw = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        kw["device_id"] = dev
    else:
        dev = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), **kw)
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
    results: dict[str, Any] = {}
    try:
        for op in ops:
            rows, error = [], None
            for size in sizes:
                elems = max(world, (size // 4) // world * world)
                big = torch.ones(elems, device=dev)
                part = torch.ones(elems // world, device=dev)
                if op == "all_reduce":
                    fn = lambda: dist.all_reduce(big)  # noqa: E731
                elif op == "all_gather":
                    fn = lambda: dist.all_gather_into_tensor(big, part)  # noqa: E731
                else:
                    fn = lambda: dist.reduce_scatter_tensor(part, big)  # noqa: E731
                try:
                    for _ in range(3):
                        fn()
                except (RuntimeError, ValueError, NotImplementedError) as e:  # e.g. gloo without this op
                    error = " ".join(str(e).split())[:200]
                    break
                reps = max(3, min(100, int(2**27 // (elems * 4))))
                sync()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                sync()
                t = torch.tensor([(time.perf_counter() - t0) / reps], device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                rows.append([elems * 4, float(t.item())])
                del big, part
            results[op] = {"sizes": rows, "error": error}
    finally:
        if rank == 0:
            Path(out_path).write_text(json.dumps(results))
        dist.destroy_process_group()


def measure_collectives(device: str, world: int, sizes: Sequence[int], ops: Sequence[str] = COLLECTIVE_OPS,
                        algo: str | None = None, timeout_s: float = 300.0) -> dict:
    """{op: {"sizes": [[S, seconds], ...], "error": str|None}} over `world` spawned ranks on 127.0.0.1:
    NCCL on GPUs 0..world-1 ('cuda'), gloo on the CPU ('cpu'). `algo` sets NCCL_ALGO in the ranks."""
    import tempfile

    import torch.multiprocessing as mp
    backend = "nccl" if device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="distplan-calibrate-") as tmp:
        out_path = os.path.join(tmp, "collectives.json")
        ctx = mp.start_processes(_collective_worker, args=(world, _free_port(), backend, list(sizes), list(ops),
                                                           algo, out_path),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"collectives did not finish in {timeout_s:.0f} s")
        finally:
            for p in ctx.processes:  # only the ranks started here
                if p.is_alive():
                    p.terminate()
        return json.loads(Path(out_path).read_text())
