"""Launch probes and run a validation session: predict, probe, compare, append.

Owns the process side of `distplan validate`:

- `detect_hardware()` asks a subprocess what torch sees (GPUs, names, memory, bf16), so the CLI process
  never initialises CUDA (where torch can see no GPU, torch/version.py and the environment answer
  without the 4-second import: `gpu_free_hardware`); `choose_mode()` turns that into where probes run: GPUs -> `gpu` (NCCL, one rank
  per GPU); `--simulate-world-size N` -> `fake` (one process, rank 0 of N on the fake process group);
  no GPU -> `cpu` (gloo, 2 processes).
- `ProbeRun` / `run_probe()` (validate/probe_run.py, named here too) launch one probe under a guard (`python -m distplan.validate.guard`, in a
  session of its own) that kills the probe if distplan dies, even by SIGKILL, and removes its temp
  folder: `python -m torch.distributed.run --nnodes=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:0
  --local-addr=127.0.0.1 --nproc-per-node=W -m distplan.validate.probe --spec S --out R` (gpu: a
  rendezvous that never leaves the machine, so no network is needed; `--nnodes N --rdzv-endpoint E
  --rdzv-backend c10d` across nodes), the same through `python -m distplan.validate.launch` on the CPU
  (torchrun in a process that has imported the probe's modules, its workers forked from it: `launcher`),
  or `python -m distplan.validate.probe ...` (fake). On the CPU, with two or more in a run, a fake probe or
  a one-node gloo probe's launcher is a fork of one warm process that has imported the probe
  (`start_warm`, validate/warm.py). TMPDIR points
  inside the probe's temp folder (torchelastic's `torchelastic_*` goes with it). A timeout, an error,
  Ctrl-C or SIGTERM kill the whole probe: the guard's group, its descendants, and the torchrun workers
  (sessions of their own) found by the temp folder on their command lines (SIGTERM, then SIGKILL after
  a grace period). The probe's own result says ok / oom / error; without a result file the run is
  `crashed` (reason: a failed rendezvous in one line, else the last meaningful stderr line) or `timeout`.
- `run_validation()` runs a list of specs (fake probes several at a time, torchrun probes alone), asks
  the planner for each prediction (`distplan.planner.api.predict_probe`), compares, and appends one record
  per probe to the JSON-lines file the moment it ends. Fake probes on one GPU run side by side only while
  their predicted device needs (`gpu_need_bytes`) fit in 90% of its memory together, so `--jobs` cannot
  turn a probe that fits into a measured OOM; a probe that shared the GPU is marked `shared_gpu` and its
  step time is reported, not judged.

Known limitations: across nodes, only the node that hosts rank 0 gets the result file; the other nodes
record status `remote` (verdict SKIP) when their launcher exits cleanly. No retry of failed probes (use `--resume` after fixing).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
import time

from distplan.planner.api import predict_probe, resolve_model
from distplan.planner.config import installed_torch, torch_build, torch_version_file
from distplan.planner.footprint import CUDA_CONTEXT_BYTES
from distplan.planner.model import ModelSpec

from .compare import DEFAULT_TOLERANCE, compare
from .results import ResultsFile, done, read_records
from .warm import WarmStarter

# one probe's run is `probe_run`'s; these names are the runner's as before (the command and the tests use them)
from .probe_run import (DEFAULT_CPU_RANKS, DEFAULT_TIMEOUT_S, KILL_GRACE_S, STACKS_AT_ENV, ProbeRun,  # noqa: F401
                        Terminated, _last_error_line, _rendezvous_failure, check_loopback, handle_termination,
                        hung_stacks, launcher, local_rendezvous, probe_argv, probe_base_env, run_probe,
                        stacks_after_s, warm_startable)

# -- hardware -------------------------------------------------------------------------------------

_HW_SCRIPT = r"""
import json, sys
try:
    import torch
except Exception as e:
    print(json.dumps({"error": f"cannot import torch: {e}"})); sys.exit(0)
out = {"torch_version": torch.__version__, "gpus": 0, "gpu_names": [], "gpu_memory_bytes": [], "bf16": True,
       "cpu_count": __import__("os").cpu_count()}
try:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out["gpus"] = n
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        out["gpu_names"].append(p.name); out["gpu_memory_bytes"].append(int(p.total_memory))
    if n:
        out["bf16"] = bool(torch.cuda.is_bf16_supported())
except Exception as e:
    out["cuda_error"] = str(e)
print(json.dumps(out))
"""

_hw_cache: dict | None = None


def _torch_version_file() -> str | None:

    return torch_version_file()


def _torch_build() -> dict | None:
    """torch/version.py's `__version__`, `cuda` and `hip` (planner.config.torch_build), without importing
    torch (a 4-second import on a small CPU machine); None when torch is not installed or a field is
    missing (then torch is asked)."""

    path = _torch_version_file()
    build = torch_build(path) if path else {}
    return build if all(k in build for k in ("__version__", "cuda", "hip")) else None


def _hidden_devices(var: str) -> bool:
    """True when `var` (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES) hides every device: set and empty, or
    its first entry invalid (the runtime stops at the first invalid entry: "-1" means none)."""
    value = os.environ.get(var)
    return value is not None and (not value.strip() or value.split(",")[0].strip().startswith("-"))


def gpu_free_hardware() -> dict | None:
    """The hardware record without the subprocess, where torch can see no GPU whatever it would do: a CPU
    build of torch (torch/version.py: `cuda` and `hip` None), every device hidden by
    CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES, or a CUDA build on a Linux machine with no NVIDIA driver
    (no /dev/nvidiactl: `torch.cuda.is_available()` is False there). None otherwise (ask torch)."""
    build = _torch_build()
    if build is None:
        return None
    if build["hip"] is not None:
        gpu_free = _hidden_devices("HIP_VISIBLE_DEVICES") or _hidden_devices("CUDA_VISIBLE_DEVICES")
    elif build["cuda"] is not None:
        gpu_free = _hidden_devices("CUDA_VISIBLE_DEVICES") or (
            sys.platform.startswith("linux") and not os.path.exists("/dev/nvidiactl"))
    else:
        gpu_free = True
    if not gpu_free:
        return None
    return {"torch_version": build["__version__"], "gpus": 0, "gpu_names": [], "gpu_memory_bytes": [],
            "bf16": True, "cpu_count": os.cpu_count()}


def detect_hardware(timeout_s: float = 120.0) -> dict:
    """{"torch_version", "gpus", "gpu_names", "gpu_memory_bytes", "bf16", "cpu_count", "ram_bytes"} or
    {"error": ...} when torch cannot be imported. Where no GPU can be seen (`gpu_free_hardware`) from
    torch's files; else torch answers in a subprocess, so this process never initialises CUDA. Cached per
    process."""
    global _hw_cache
    if _hw_cache is not None:
        return dict(_hw_cache)
    hw = gpu_free_hardware()
    if hw is not None:
        hw["ram_bytes"] = available_ram_bytes()
        _hw_cache = hw
        return dict(hw)
    try:
        cp = subprocess.run([sys.executable, "-c", _HW_SCRIPT], capture_output=True, text=True,
                            timeout=timeout_s)
        line = [ln for ln in cp.stdout.splitlines() if ln.startswith("{")]
        hw = json.loads(line[-1]) if line else {"error": _last_error_line(cp.stderr) or "no answer"}
    except (subprocess.TimeoutExpired, OSError) as e:
        hw = {"error": f"hardware probe failed: {e}"}
    hw["ram_bytes"] = available_ram_bytes()
    _hw_cache = hw
    return dict(hw)


def available_ram_bytes() -> int | None:
    """The memory new processes can take without swapping: Linux's MemAvailable (free pages plus the page
    cache and reclaimable slabs it can drop, proc(5), /proc/meminfo), else the free pages alone (MemFree:
    on a machine that has read a few GB of files, half of what is really there)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


DEFAULT_FAKE_WORLD = 8
"""The world a probe simulates on the fake process group when this machine has too few GPUs (or, on
CPU, ranks) for a distributed strategy: one node of 8 GPUs, the usual server."""
MAX_FAKE_WORLD = 4096
"""Largest `--simulate-world-size`: the fake process group's rank 0 holds per-rank state for every rank
in one process (FSDP's all-gather output is world x the shard, DDP/ZeRO size buckets and partitions
by world), so beyond a few thousand ranks the probe measures the bookkeeping, not the strategy; 4096
ranks is 512 nodes of 8 GPUs."""


CPU_RANKS_PER_CORE = 4
"""The most gloo ranks a CPU core runs (`--nproc` on a machine without GPUs): each is a process with
torch imported, and oversubscribed ranks only wait on each other."""


def choose_mode(hw: dict, simulate_world_size: int | None = None, nproc: int | None = None,
                nnodes: int = 1, explain: bool = False):
    """(mode, world_size) for a run on this machine; see the module docstring. With `explain`, a third
    item: None, or the one line that says why probes run on the fake process group although nobody
    asked (fewer than 2 ranks here: one GPU, or `--nproc 1`; a world of 1 validates no distributed
    strategy, so rank 0 of `DEFAULT_FAKE_WORLD` on the fake process group instead)."""
    note = None
    if simulate_world_size:
        if simulate_world_size > MAX_FAKE_WORLD:
            raise ValueError(f"--simulate-world-size={simulate_world_size}: at most {MAX_FAKE_WORLD} (rank 0 of "
                             f"the fake process group keeps per-rank buffers for every rank in one process)")
        mode, world = "fake", int(simulate_world_size)
    else:
        gpus = int(hw.get("gpus") or 0)
        if gpus:
            per_node = nproc or gpus
            if per_node > gpus:
                raise ValueError(f"--nproc={per_node}: this machine has {gpus} GPU(s); accepted: 1..{gpus}, "
                                 f"or --simulate-world-size for more ranks")
            mode, world = "gpu", per_node * nnodes
        else:
            cores = int(hw.get("cpu_count") or os.cpu_count() or 1)
            most = max(DEFAULT_CPU_RANKS, CPU_RANKS_PER_CORE * cores)
            if nproc and nproc > most:
                raise ValueError(f"--nproc={nproc}: this machine has {cores} CPU core{'s' if cores != 1 else ''} "
                                 f"and no GPU; accepted: 1..{most} CPU ranks ({CPU_RANKS_PER_CORE} a core), or "
                                 f"--simulate-world-size for more ranks")
            mode, world = "cpu", (nproc or DEFAULT_CPU_RANKS) * nnodes
        if world < 2:
            have = (f"{gpus} GPU here" if gpus and not nproc else f"--nproc {nproc}" if nproc
                    else "1 rank here")
            note = (f"{have}, and a distributed strategy needs 2 ranks or more: probing rank 0 of "
                    f"{DEFAULT_FAKE_WORLD} on the fake process group (as --simulate-world-size "
                    f"{DEFAULT_FAKE_WORLD}; give that flag for another world)")
            mode, world = "fake", DEFAULT_FAKE_WORLD
    return (mode, world, note) if explain else (mode, world)


def describe_mode(mode: str, world_size: int, hw: dict) -> str:
    """The header line saying where probes run and what that means for the numbers."""
    if mode == "fake":
        where = (f"on {hw['gpu_names'][0]}" if hw.get("gpus") else "on CPU")
        return (f"fake process group {where}: rank 0 of {world_size}, real allocations, "
                f"collectives counted, not executed (no step time)")
    if mode == "gpu":
        name = hw.get("gpu_names", ["GPU"])[0] if hw.get("gpu_names") else "GPU"
        return (f"{world_size} x {name}, NCCL, torchrun: memory from torch.cuda.max_memory_allocated, "
                f"collectives counted, step time measured")
    return (f"CPU, gloo, {world_size} process{'es' if world_size != 1 else ''}: memory from the storage "
            f"tracker, collectives counted, no GPU step time")


# -- a session ------------------------------------------------------------------------------------

def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def default_predict(spec: dict) -> dict:
    return predict_probe(spec)


def make_record(spec: dict, prediction: dict | None, prediction_error: str | None, measurement: dict,
                tolerance: float) -> dict:
    if prediction_error:
        measurement = dict(measurement, prediction_error=prediction_error)
    comparison = compare(prediction, measurement, tolerance)
    return {"id": spec.get("id"), "inputs": spec, "prediction": prediction,
            "prediction_error": prediction_error, "measurement": measurement, "comparison": comparison,
            "verdict": comparison["verdict"], "status": measurement.get("status"),
            "device": measurement.get("device"), "torch_version": measurement.get("torch_version"),
            "date": measurement.get("date") or _now()}


def with_fits(prediction: dict | None, device_memory_bytes: int | None) -> dict | None:
    if prediction is None or "fits" in prediction or not device_memory_bytes:
        return prediction
    peak = (prediction.get("memory") or {}).get("peak_allocated")
    if peak is None:
        return prediction
    return dict(prediction, fits=bool(peak <= device_memory_bytes),
                fits_source=f"predicted peak_allocated <= device memory {device_memory_bytes} B")


GPU_SHARE = 0.90
"""Fraction of the GPU's memory that probes running side by side on one GPU may be predicted to need
together (`run_validation`); the rest is slack for what the prediction does not hold (other processes'
CUDA contexts are counted per probe)."""


def _shares_gpu(spec: dict) -> bool:
    """A fake-process-group probe on a GPU: one process, which `--jobs` may run beside others on the same
    device (a torchrun probe, mode 'gpu', takes every GPU and runs alone)."""
    return spec.get("mode") == "fake" and spec.get("device_type") == "cuda"


def _full_param_bytes(spec: dict) -> int:
    """fp32 bytes of the probe's model, all of it: the probes build it whole on the device (the reference
    decoder in place, a module on the CPU then `.to(device)`) before any wrapper shards it. 0 where the
    planner does not read the model's size from its spec (an `nn.Module` factory, a config the analytic
    front end does not read)."""
    try:
        module = spec.get("module") or {}
        if module.get("hf_config"):
            model, _ = resolve_model(hf_config=module["hf_config"],
                                     overrides={"layers": module.get("layers"), "vocab": module.get("vocab")})
        elif module:
            return 0
        else:
            model = ModelSpec(**spec["model"])
        return 4 * int(model.param_count())
    except (ValueError, KeyError, TypeError):
        return 0


def gpu_need_bytes(spec: dict, prediction: dict | None) -> int:
    """Device bytes a probe sharing a GPU is expected to hold at most: the larger of its predicted reserved
    peak (else its allocated peak) and the whole model built before wrapping, plus a CUDA context
    (planner.footprint.CUDA_CONTEXT_BYTES). With no prediction, only the model and the context."""
    mem = (prediction or {}).get("memory") or {}
    peak = int(mem.get("peak_reserved") or mem.get("peak_allocated") or 0)
    return max(peak, _full_param_bytes(spec)) + CUDA_CONTEXT_BYTES


WARM_MIN_PROBES = 2
"""A validation run with this many warm-startable probes or more starts the warm process: its imports
are one probe's, so it pays from the second probe on."""


def start_warm(specs: list[dict], probe_cmd: list[str] | None, nnodes: int = 1):
    """A `warm.WarmStarter` for this run's CPU probes, or None (too few of them, a GPU in sight, a custom
    launcher, or it could not start)."""
    if probe_cmd is not None or os.environ.get("DISTPLAN_WARM_START", "1") == "0":
        return None
    if sum(warm_startable(s, nnodes) for s in specs) < WARM_MIN_PROBES or gpu_free_hardware() is None:
        return None
    try:  # started with the probes' environment: libgomp reads OMP_NUM_THREADS when it loads
        return WarmStarter(probe_base_env())
    except OSError:
        return None


def spec_cost(spec: dict, capacity: int) -> int:
    """Slots a probe takes: one per local process on CPU; a GPU probe takes the machine."""
    if spec.get("mode") == "gpu":
        return capacity
    if spec.get("mode") == "fake":
        return 1
    return min(capacity, int(spec.get("world_size", 1)))


def run_validation(specs: list[dict], out_path: str, *, tolerance: float = DEFAULT_TOLERANCE,
                   timeout_s: float = DEFAULT_TIMEOUT_S, probe_cmd: list[str] | None = None,
                   nnodes: int = 1, rdzv_endpoint: str | None = None, resume: bool = False,
                   jobs: int = 1, predict=None, on_event=None,
                   results: ResultsFile | None = None, device_memory_bytes: int | None = None) -> list[dict]:
    """Run every spec (skipping those already done when `resume`), append each record as it ends,
    and return the records in spec order. `on_event(kind, index, spec, record_or_None)` is called with
    kind 'skip', 'start' or 'done'. A KeyboardInterrupt kills the running probes and propagates; the
    records already appended stay in the file (pass `results` to read `results.appended` afterwards).
    `device_memory_bytes` (the GPU's total memory) fills in `fits` = predicted peak <= it when the
    prediction has no verdict of its own, so a measured OOM can be compared."""
    predict = predict or default_predict
    on_event = on_event or (lambda *a: None)
    results = results or ResultsFile(out_path)
    # the torch the probes run (this interpreter's) is part of their inputs: the prediction follows its
    # release where PyTorch's implementations differ, and a record re-predicted later does the same
    specs = [s if s.get("torch_version") else dict(s, torch_version=installed_torch()) for s in specs]
    existing = read_records(out_path) if resume else []
    records: dict[int, dict] = {}
    todo: list[int] = []
    for i, spec in enumerate(specs):
        prev = done(existing, spec) if resume else None
        if prev is not None:
            records[i] = dict(prev, resumed=True)
            on_event("skip", i, spec, records[i])
        else:
            todo.append(i)
    capacity = max(1, int(jobs))
    running: list[tuple[int, ProbeRun, dict | None, str | None]] = []
    predicted: dict[int, tuple[dict | None, str | None]] = {}
    gpu_budget = GPU_SHARE * device_memory_bytes if device_memory_bytes else None
    need: dict[int, int] = {}  # device bytes of each running probe that shares the GPU
    shared: set[int] = set()  # probes that had another one beside them on the GPU
    warm = start_warm([specs[i] for i in todo], probe_cmd, nnodes)
    try:
        while todo or running:
            used = sum(spec_cost(specs[i], capacity) for i, *_ in running)
            while todo and (not running or used + spec_cost(specs[todo[0]], capacity) <= capacity):
                i = todo[0]
                spec = specs[i]
                if i not in predicted:
                    try:
                        prediction, perr = predict(spec), None
                        prediction = with_fits(prediction, device_memory_bytes)
                    except Exception as e:  # the planner's failure is recorded, the probe still runs
                        prediction, perr = None, f"{type(e).__name__}: {e}"
                    predicted[i] = (prediction, perr)
                prediction, perr = predicted.pop(i)
                if gpu_budget and _shares_gpu(spec):
                    # side by side on one GPU only while their predicted needs fit together; a probe that
                    # needs more than the GPU has still runs, alone (its OOM is what validate judges)
                    n = gpu_need_bytes(spec, prediction)
                    if need and sum(need.values()) + n > gpu_budget:
                        predicted[i] = (prediction, perr)
                        break
                    need[i] = n
                todo.pop(0)
                on_event("start", i, spec, None)
                running.append((i, ProbeRun(spec, probe_cmd, timeout_s, nnodes, rdzv_endpoint, warm=warm),
                                prediction, perr))
                used += spec_cost(spec, capacity)
            still = []
            for item in running:
                i, run, prediction, perr = item
                measurement = run.poll()
                if measurement is None:
                    still.append(item)
                    continue
                need.pop(i, None)
                if i in shared:
                    measurement = dict(measurement, shared_gpu=True)
                rec = make_record(specs[i], prediction, perr, measurement, tolerance)
                results.append(rec)
                records[i] = rec
                on_event("done", i, specs[i], rec)
            running = still
            if len(need) > 1:  # still running together after this round's ends (starts are not GPU work)
                shared.update(need)
            if running:
                time.sleep(0.05)
    except BaseException:
        for _, run, *_ in running:
            run.abandon()
        raise
    finally:
        if warm is not None:
            warm.close()
    return [records[i] for i in sorted(records)]

