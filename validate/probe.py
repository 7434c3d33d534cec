"""The probe that runs on every rank: one strategy, a few training steps, a JSON of what was measured.

    torchrun --nproc-per-node=W -m distplan.validate.probe --spec SPEC.json --out RESULT.json   # gpu, cpu
    python -m distplan.validate.probe --spec SPEC.json --out RESULT.json                        # fake

Modes: `gpu` (NCCL, one rank per GPU, peak from `torch.cuda.max_memory_allocated`), `cpu` (gloo, CPU
tensors, peak from the storage tracker), `fake` (one process, rank 0 of `world_size` ranks on the fake
process group: real allocations, collectives issued and counted but not executed, so data is garbage and
step time is not measured).

Protocol: the tracker starts before the model exists (baseline:
what the allocator holds then, on GPU; 0 for the tracker by construction); model built with a fixed
seed, wrapped (`wrap.py`), two warm-up steps (optimizer state, FSDP lazy init, DDP's bucket rebuild in the second forward,
cuBLAS workspace),
peak reset, `steps` measured steps (memory and collectives), then `steps` timing steps with the tracker
off. Rank 0 gathers every rank's peak and writes the result atomically; a rank that fails writes its
error unless a result is already there, and exits 1 so torchrun stops the others.

A spec with a "module" object builds that workload (`workload.py`) instead of the reference decoder:
`{"factory": "pkg.mod:fn", "input_shape": [...], "path": dir}` (any `nn.Module`: its parameter-owning
direct children are the FSDP units, wrapped in a non-reentrant `checkpoint_wrapper` for checkpointing
'full'; random input of that shape; cross-entropy against class 0 for a 2-D output, else the sum) or
`{"hf_config": path, "micro_batch": B, "seq_len": T, "layers": L}` (a Hugging Face causal LM: its decoder
layers are the units, transformers' own checkpointing for 'full', random token ids, its own loss).
With DISTPLAN_MEMORY_SNAPSHOT set, rank 0 on CUDA also dumps the allocator's history (validate/snapshot.py).
A spec with `"checkpoint": {"mode": "full" | "full-offload" | "sharded", "dir": path}` then saves model and
optimizer state, measured by the same tracker, and reports every rank's save peak under "checkpoint"
(validate/checkpoint.py).

Known limitations: one batch of random tokens is reused every step; `checkpointing='selective'` runs as
the reference decoder implements it (see `unmeasured`); CPU offload (`train.cpu_offload`, wrap.py) means
something only on a GPU, where `max_memory_allocated` leaves the host's memory out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys

from distplan.planner.config import checkpoint_every
from distplan.planner.model import ModelSpec
from distplan.planner.strategies import get_strategy
from distplan.planner.workload.traced_model import from_spec

from .checkpoint import save_checkpoint
from .cp import head_tail_indices, hf_context_parallel
from .guard import set_pdeathsig
from .measure import CATEGORIES, StepTimer, StreamTags, Tracker
from .model import Decoder
from .preload import preload  # noqa: F401  (launch.py and warm.py call the probe module's preload)
from .tp_probe import parallelize_decoder, parallelize_hf
from .wrap import wrap

MODES = ("gpu", "cpu", "fake")
SNAPSHOT_ENV = "DISTPLAN_MEMORY_SNAPSHOT"
ALLOC_EVENTS_ENV = "DISTPLAN_ALLOC_EVENTS"
"""A path: rank 0 writes its storage allocations and frees there (JSON list, host order), from model
construction to the end of the measured steps, for `planner.allocator.replay`."""
"""Set to a file path: on CUDA, rank 0 records every allocation from the baseline on and dumps
`torch.cuda.memory._snapshot()` there after the measured steps (`python -m distplan.validate.snapshot`)."""


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {msg[0] if msg else ''}".strip()
    return text[:400]


def _is_oom(e: BaseException) -> bool:
    import torch

    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and "can't allocate memory" in str(e)


def write_json(path: str, obj: dict, clobber: bool = True) -> bool:
    """Atomic write (tmp + rename); with clobber=False, only if `path` does not exist yet."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    if clobber:
        os.replace(tmp, path)
        return True
    try:
        os.link(tmp, path)  # fails if path exists: the first error wins
        return True
    except FileExistsError:
        return False
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


RENDEZVOUS_CONNECT_S = 20.0
"""How long a torchrun worker tries to reach the rendezvous store (MASTER_ADDR:MASTER_PORT) before it
fails with one line; without it, init_process_group retries for the whole probe timeout."""


def check_rendezvous(limit_s: float = RENDEZVOUS_CONNECT_S) -> None:
    """Fail fast, in one line, when this worker cannot open a TCP connection to the store torchrun
    started (MASTER_ADDR:MASTER_PORT): no network, a down loopback, a firewall."""
    import socket
    import time

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return
    deadline = time.monotonic() + limit_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2.0):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConnectionError(f"rendezvous: cannot connect to {host}:{port} within {limit_s:g} s "
                                      f"({e.strerror or e})") from None
            time.sleep(0.2)


def _die_with_launcher() -> None:
    """A probe started by `distplan validate` (DISTPLAN_PROBE_DIR set) dies when its launcher does:
    torchelastic starts workers in sessions of their own, out of reach of the runner's process group
    kill (validate/guard.py)."""
    if not os.environ.get("DISTPLAN_PROBE_DIR"):
        return

    import signal

    parent = os.getppid()
    if set_pdeathsig(signal.SIGKILL) and (os.getppid() != parent or parent == 1):
        os._exit(1)  # the launcher died before prctl took effect


def nvml_process_bytes(pid: int | None = None, nvml=None) -> tuple[int | None, int]:
    """(device bytes NVML reports for process `pid`, summed over the GPUs it is on; how many GPUs).

    `nvmlDeviceGetComputeRunningProcesses` lists, per GPU, each compute process's `usedGpuMemory`:
    everything the process holds there (CUDA context, caching-allocator segments, NCCL's buffers),
    the figure nvidia-smi prints. Each NVML call is guarded on its own (gpustat's way): no driver, a
    PID NVML does not see (a container's own PID namespace) or a figure NVML cannot give
    (`usedGpuMemory` None) gives (None, 0), never an exception. `nvml` is the pynvml module (a fake in
    tests)."""
    pid = os.getpid() if pid is None else pid
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
    except Exception:
        return None, 0
    total, found = 0, 0
    try:
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception:
            return None, 0
        for i in range(count):
            try:
                procs = nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(i))
            except Exception:
                continue
            used = [getattr(p, "usedGpuMemory", None) for p in procs if getattr(p, "pid", None) == pid]
            used = [u for u in used if isinstance(u, int) and not isinstance(u, bool) and u >= 0]
            if used:
                total += sum(used)
                found += 1
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return (total, found) if found else (None, 0)


class Probe:
    def __init__(self, spec: dict):
        self.spec = spec
        self.mode = spec.get("mode", "cpu")
        self.world_size = int(spec.get("world_size", 1))
        self.rank = 0
        self.tracker = None
        self.device = None
        self.baseline = 0
        self.result = {
            "id": spec.get("id"), "status": "error", "error": None, "mode": self.mode, "backend": None,
            "device": None, "world_size": self.world_size, "measured_ranks": [], "torch_version": None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "memory": None, "collectives": [], "step_time_s": None, "unmeasured": [],
        }

    # -- setup ---------------------------------------------------------------------------------
    def init(self) -> None:
        import torch
        import torch.distributed as dist

        self.result["torch_version"] = torch.__version__
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: accepted values are {', '.join(MODES)}")
        timeout = datetime.timedelta(seconds=float(self.spec.get("timeout_s", 300)))
        if self.mode == "fake":
            from torch.testing._internal.distributed.fake_pg import FakeStore

            self.device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
            if self.device.type == "cpu":  # as torchrun does: one thread per process unless told
                torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world_size,
                                    timeout=timeout)
            self.result["measured_ranks"] = [0]
            self.result["unmeasured"].append("step time (fake process group executes no collective)")
            self.result["unmeasured"].append("ranks other than 0 (fake process group: one process)")
        else:
            env_world = int(os.environ.get("WORLD_SIZE", "0"))
            if env_world != self.world_size:
                raise ValueError(f"spec world_size={self.world_size} but the launcher started "
                                 f"WORLD_SIZE={env_world or 'unset'} processes; run under "
                                 f"torchrun --nproc-per-node={self.world_size}")
            self.rank = int(os.environ["RANK"])
            if self.mode == "gpu":
                if not torch.cuda.is_available():
                    raise RuntimeError("mode='gpu' but torch.cuda.is_available() is False; use mode 'cpu'")
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(self.device)
                check_rendezvous()
                dist.init_process_group("nccl", device_id=self.device, timeout=timeout)
            else:
                self.device = torch.device("cpu")
                check_rendezvous()
                dist.init_process_group("gloo", timeout=timeout)
            self.result["measured_ranks"] = list(range(self.world_size))
        self.result["backend"] = dist.get_backend()
        self.result["device"] = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                                 else "cpu")
        if self.device.type == "cpu":
            self.result["unmeasured"].append(
                "allocator peak (CPU: live tensor storages from the storage tracker, no caching allocator)")

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> None:
        import torch

        # (lazy: measure and wrap import torch; the launcher imports this module without it)

        spec = self.spec
        train, module, work, mspec, steps, seq, mb, accum, sync_every, ckpt, every = self._run_options()
        cuda = self.device.type == "cuda"
        tracker, tags = self._start_recording(cuda)
        with tracker, (tags or contextlib.nullcontext()):
            torch.manual_seed(int(spec.get("seed", 0)))
            model, units, meta, extra = self._built_model(module, work, mspec, train, ckpt, every, cuda)
            model, dp_mesh, dp_world, cp, cp_rank, cp_context = self._parallelized(model, module, work, meta, seq)
            model, opt, ctx = wrap(model, spec["strategy"], train, dp_world,
                                   int(spec.get("gpus_per_node", self.world_size)), self.device,
                                   fake=self.mode == "fake", units=units, dp_mesh=dp_mesh, meta=meta)
            if self.mode == "fake" and train.get("precision") == "fp16-mixed" and self.device.type == "cuda":
                self.result["unmeasured"].append("GradScaler (fake process group: garbage gradients)")
            tracker.roles = ctx.roles
            batches = self._batches(module, work, mspec, train, extra, seq, mb, accum, cp, cp_rank)
            step = self._step(model, opt, ctx, work if module else None, batches, tracker, tags, sync_every,
                              accum, cp_context)
            self._measured_steps(step, steps, tracker, cuda)
        self._record_memory(complete=True)
        self.result["collectives"] = tracker.collective_list(steps)
        if spec.get("checkpoint"):  # after the measured steps: optimizer state exists, gradients freed
            with tracker:
                self.result["checkpoint"] = save_checkpoint(model, opt, spec["checkpoint"], tracker,
                                                            self.rank)
        if tracker.events is not None:
            with open(os.environ[ALLOC_EVENTS_ENV], "w") as f:
                json.dump(tracker.events, f)
        if cuda and os.environ.get(SNAPSHOT_ENV) and self.rank == 0:
            torch.cuda.memory._dump_snapshot(os.environ[SNAPSHOT_ENV])
            torch.cuda.memory._record_memory_history(enabled=None)

        if self.mode != "fake" or cuda:  # fake PG on a GPU: the compute part (collectives return at once)
            timer = StepTimer(self.device)
            for _ in range(steps):
                with timer:
                    step()
            self.result["step_time_s"] = timer.median()
        self._gather()
        self.result["status"] = "ok"

    def _run_options(self) -> tuple:
        """The spec's run options, checked: (train, module, work, mspec, steps, seq_len, micro_batch, grad_accum,
        sync_every, checkpointing, every: checkpoint every K-th layer or 0)."""
        spec, train = self.spec, dict(self.spec.get("train", {}))
        work = mspec = None
        module = spec.get("module")  # {"factory": "pkg.mod:fn", "input_shape": [...], "path": dir} or None
        if module:
            if module.get("path") and module["path"] not in sys.path:
                sys.path.insert(0, module["path"])  # where the user ran `distplan validate --module`
            work = from_spec(module)
        else:
            mspec = ModelSpec(**spec["model"])
        steps = int(spec.get("steps", 3))
        if steps <= 0:
            raise ValueError(f"steps={steps}: must be a positive integer")
        seq, mb, accum = int(train.get("seq_len", 64)), int(train.get("micro_batch", 1)), int(train.get("grad_accum", 1))
        for k, v in (("seq_len", seq), ("micro_batch", mb), ("grad_accum", accum)):
            if v <= 0:
                raise ValueError(f"train.{k}={v}: must be a positive integer")
        grad_sync = train.get("grad_sync", "last")
        if grad_sync not in ("last", "every"):
            raise ValueError(f"train.grad_sync={grad_sync!r}: accepted values are last, every")
        sync_every = grad_sync == "every"  # else no_sync / set_requires_gradient_sync(False) but on the last
        ckpt = train.get("checkpointing", "none")
        if module and ckpt in ("selective", "selective-op"):
            self.result["unmeasured"].append(f"checkpointing={ckpt!r} is not defined for a module; ran as 'none'")
            ckpt = "none"
        every = checkpoint_every(ckpt)
        if ckpt not in ("none", "full", "selective", "selective-op") and not every:
            self.result["unmeasured"].append(
                f"checkpointing={ckpt!r} (the reference decoder implements only 'none' and 'full'; ran as 'none')")
        return train, module, work, mspec, steps, seq, mb, accum, sync_every, ckpt, every

    def _start_recording(self, cuda: bool) -> tuple:
        """(the tracker, the stream tags or None): the baseline bytes and the snapshot's history started."""
        import torch

        if cuda:
            torch.cuda.synchronize()
            self.baseline = torch.cuda.memory_allocated(self.device)
            if os.environ.get(SNAPSHOT_ENV) and self.rank == 0:
                # every allocation from here on, with its Python and C++ stack (validate/snapshot.py)
                torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="all", stacks="all")

        tracker = self.tracker = Tracker(settle_waits=self.mode == "cpu")  # gloo: see Tracker
        tags = None
        if os.environ.get(ALLOC_EVENTS_ENV) and self.rank == 0:
            tracker.events = []
            # on the CPU, each backward node's stream as a GPU would run it (measure.StreamTags)
            tags = StreamTags(tracker) if not cuda else None
        return tracker, tags

    def _built_model(self, module, work, mspec, train: dict, ckpt: str, every: int, cuda: bool) -> tuple:
        """(model, units: the wrapping units of a --module or transformers model or None, meta: built on the
        meta device, extra: the inputs' extra arguments)."""
        import torch

        spec = self.spec
        units, extra = None, {}
        init = spec.get("init", "device")
        if init not in ("device", "meta"):
            raise ValueError(f"init={init!r}: accepted values are device, meta")
        # meta: built on the meta device and wrapped there, each rank materializing only what FSDP keeps
        # (validate/wrap.py `materialize`); DDP and one GPU hold the whole model anyway: built on the device
        meta = bool(module) and init == "meta" and get_strategy(spec["strategy"]).fsdp
        if module:
            with torch.device("meta") if meta else contextlib.nullcontext():
                model = work.build()
            if not isinstance(model, torch.nn.Module):
                raise TypeError(f"--module={work.label!r} returned {type(model).__name__}, "
                                f"not an nn.Module")
            if not meta:
                model = model.to(self.device)
            extra = {"vocab": work.vocab(model)} if work.kind == "hf" else {}
            units = work.units(model)
            if every:
                units = work.enable_checkpointing(model, units, every)
            units = [m for _, m in units]
        elif cuda:  # built in place (no CPU copy of a large model)
            with torch.device(self.device):
                model = Decoder(mspec, train.get("attention", "sdpa"), ckpt)
        else:  # (a torch.device context costs a torch._dynamo import through __torch_function__)
            model = Decoder(mspec, train.get("attention", "sdpa"), ckpt)
        return model, units, meta, extra

    def _parallelized(self, model, module, work, meta: bool, seq: int) -> tuple:
        """(model, dp_mesh, dp_world, cp, cp_rank, cp_context): the model split by the spec's tp or cp."""
        spec = self.spec
        tp, dp_mesh, dp_world = int(spec.get("tp", 1)), None, self.world_size
        cp, cp_rank = int(spec.get("cp", 1)), 0
        cp_context = None
        if meta and (cp > 1 or tp > 1 or spec.get("sequence_parallel")):
            raise ValueError("init='meta' with tp or cp: the probes parallelize a model built on the device")
        if cp > 1:
            if module and work.kind != "hf":
                raise ValueError("cp: the context-parallel probe runs the reference decoder or a transformers "
                                 "model (--hf-config), not --module")
            model, dp_mesh, cp_rank = self._context_parallel(model, cp, tp, bool(spec.get("sequence_parallel")),
                                                             seq, hf=bool(module))
            cp_context = getattr(model, "cp_context", None)  # a transformers model's (validate/cp.py)
            dp_world = self.world_size // tp  # FSDP/DDP over the flattened (dp, cp) ranks
        elif tp > 1 or spec.get("sequence_parallel"):
            if module and work.kind != "hf":
                raise ValueError("tp: the tensor-parallel probe runs the reference decoder or a transformers "
                                 "model (--hf-config), not --module")
            model, dp_mesh = self._tensor_parallel(model, tp, bool(spec.get("sequence_parallel")),
                                                   hf=bool(module))
            dp_world = self.world_size // tp
        return model, dp_mesh, dp_world, cp, cp_rank, cp_context

    def _batches(self, module, work, mspec, train: dict, extra: dict, seq: int, mb: int, accum: int, cp: int,
                 cp_rank: int) -> list:
        """This rank's micro-batches of one step (`accum` of them), seeded by its data rank."""
        import torch

        spec = self.spec
        tp = int(spec.get("tp", 1))
        # the ranks of one context-parallel group share their sequences (each keeps its positions)
        data_rank = self.rank if cp == 1 else self.rank // (cp * tp)
        gen = torch.Generator().manual_seed(int(spec.get("seed", 0)) + 1000 + data_rank)
        if module:
            dtype = torch.bfloat16 if train.get("precision") == "bf16" else torch.float32
            batches = [work.inputs(torch, dtype, gen, self.device, **extra) for _ in range(accum)]
            if cp > 1:  # this rank's positions of each sequence (validate/cp.py head_tail_indices)
                keep = head_tail_indices(seq, cp, cp_rank, self.device)
                batches = [tuple(x[:, keep].contiguous() for x in b_) for b_ in batches]
        else:
            batches = [(torch.randint(0, mspec.vocab, (mb, seq), generator=gen).to(self.device),
                        torch.randint(0, mspec.vocab, (mb, seq), generator=gen).to(self.device))
                       for _ in range(accum)]
            if cp > 1:  # this rank's positions of each sequence (validate/cp.py head_tail_indices)
                keep = head_tail_indices(seq, cp, cp_rank, self.device)
                batches = [(x[:, keep].contiguous(), y[:, keep].contiguous()) for x, y in batches]
        return batches

    @staticmethod
    def _step(model, opt, ctx, work, batches: list, tracker, tags, sync_every: bool, accum: int, cp_context):
        """One optimizer step over `batches` (a --module's `work` computes its loss), the tracker's phases set."""
        def forward(batch):
            if work is None:
                return model(*batch)
            return work.loss(model, batch)[0]

        # a transformers model under CP: ring attention in place of SDPA through forward and backward (the
        # recompute of a checkpointed layer runs in backward)
        cp_scope = cp_context or contextlib.nullcontext

        def step():
            for i, batch in enumerate(batches):
                with ctx.sync(sync_every or i == accum - 1), ctx.loss_context(), cp_scope():
                    tracker.phase = "forward"
                    if tags is not None:
                        tags.reset()
                    with ctx.autocast():
                        loss = forward(batch) / accum
                    tracker.phase = "backward"
                    (ctx.scaler.scale(loss) if ctx.scaler is not None else loss).backward()
                    del loss
            tracker.phase = "optimizer"
            if ctx.scaler is not None:
                ctx.scaler.step(opt)
                ctx.scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            tracker.phase = "idle"
        return step

    def _measured_steps(self, step, steps: int, tracker, cuda: bool) -> None:
        """The warm-up steps, then `steps` counted by the tracker from a reset peak."""
        import torch

        # warm-up: optimizer state, FSDP lazy init, and DDP's bucket rebuild (in the 2nd forward)
        for _ in range(int(self.spec.get("warmup_steps", 2))):
            step()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
        tracker.reset_peak()
        tracker.counting = True
        for _ in range(steps):
            step()
        tracker.counting = False
        if cuda:
            torch.cuda.synchronize()

    def _tensor_parallel(self, model, tp: int, sp: bool, hf: bool = False):
        """(the model split over the tp dimension of a (dp, tp) mesh, the dp dimension's mesh), as
        torchtitan builds it (`ParallelDims.build_mesh`: dp outer, tp inner, so a TP group is tp
        consecutive ranks) and splits the model (`validate.tp_probe.parallelize_decoder`; a transformers
        model: `parallelize_hf`)."""
        from torch.distributed.device_mesh import init_device_mesh


        if tp < 2 or self.world_size % tp:
            raise ValueError(f"tp={tp}: must be >= 2 and divide world_size={self.world_size} (sequence_parallel "
                             f"needs tp >= 2)")
        mesh = init_device_mesh(self.device.type, (self.world_size // tp, tp), mesh_dim_names=("dp", "tp"))
        if self.spec.get("train", {}).get("precision") == "bf16":
            model = model.to(__import__("torch").bfloat16)  # before the split: DTensor parameters stay bf16
        (parallelize_hf if hf else parallelize_decoder)(model, mesh["tp"], sp)
        return model, mesh["dp"]

    def _context_parallel(self, model, cp: int, tp: int, sp: bool, seq_len: int, hf: bool = False):
        """(the model with ring attention over the cp dimension of a (dp, cp, tp) mesh, the mesh FSDP/DDP
        run on, this rank's cp index). torchtitan's order (`ParallelDims.build_mesh`: dp_shard, cp, tp
        from outer to inner) and its FSDP mesh: dp and cp flattened (`dp_shard_cp`), since the cp ranks
        hold different tokens of the same sequences and their gradients are averaged like dp's."""
        from torch.distributed.device_mesh import init_device_mesh

        if cp < 2 or self.world_size % (cp * tp):
            raise ValueError(f"cp={cp}: must be >= 2 and cp * tp = {cp * tp} must divide world_size={self.world_size}")
        mesh = init_device_mesh(self.device.type, (self.world_size // (cp * tp), cp, tp),
                                mesh_dim_names=("dp", "cp", "tp"))
        if tp > 1:
            if self.spec.get("train", {}).get("precision") == "bf16":
                model = model.to(__import__("torch").bfloat16)
            (parallelize_hf if hf else parallelize_decoder)(model, mesh["tp"], sp)
        cp_rank = mesh["cp"].get_local_rank()
        if hf:
            hf_context_parallel(model, mesh["cp"].get_group(), cp_rank, cp, seq_len)
        else:
            model.context_parallel(mesh["cp"].get_group(), cp_rank, cp, seq_len)
        dp_mesh = mesh["dp", "cp"]._flatten("dp_cp") if tp > 1 else None
        return model, dp_mesh, cp_rank

    # -- results -------------------------------------------------------------------------------
    def _record_memory(self, complete: bool) -> None:
        import torch

        t = self.tracker
        if t is None:
            return
        cuda = self.device is not None and self.device.type == "cuda"
        mem = {
            "peak_allocated": None, "per_rank_peak_allocated": None, "peak_reserved": None,
            "baseline": self.baseline, "peak_phase": t.peak_phase, "components": t.components(),
            "source": "torch.cuda.max_memory_allocated" if cuda else "storage tracker",
            "tracker_peak_allocated": t.peak_bytes,
        }
        if t.quiesce_timeouts:  # gloo waits whose worker threads did not settle (validate/measure.py)
            mem["gloo_settle_timeouts"] = t.quiesce_timeouts
        if cuda:
            mem["peak_allocated"] = torch.cuda.max_memory_allocated(self.device) - self.baseline
            mem["peak_reserved"] = torch.cuda.max_memory_reserved(self.device)
            # What NVML shows for this process now (rank 0's; not a peak), beside the allocator's
            # segments at the same moment: the difference is what lives outside the caching allocator.
            nvml_bytes, gpus = nvml_process_bytes()
            if nvml_bytes is not None:
                mem["nvml_process_bytes"] = nvml_bytes
                mem["nvml_gpus"] = gpus
                mem["reserved_at_nvml"] = torch.cuda.memory_reserved(self.device)
            try:  # the NCCL whose allocations planner/footprint.py models (checked there: 2.27.5 to 2.30.7)
                mem["nccl_version"] = ".".join(str(x) for x in torch.cuda.nccl.version())
            except Exception:  # a build without NCCL
                pass
        else:
            mem["peak_allocated"] = t.peak_bytes
        mem["per_rank_peak_allocated"] = [mem["peak_allocated"]]
        self.result["memory"] = mem

    def _gather(self) -> None:
        """Every rank's peak, components and phase to rank 0 (an int64 all_gather; no pickling)."""
        import torch
        import torch.distributed as dist


        if self.mode == "fake" or self.world_size == 1:
            return
        phases = ("setup", "forward", "backward", "optimizer", "idle")
        mine = self.result["memory"]
        row = [mine["peak_allocated"], mine["tracker_peak_allocated"], mine["peak_reserved"] or 0,
               phases.index(mine["peak_phase"]) if mine["peak_phase"] in phases else 0]
        row += [mine["components"][c] for c in CATEGORIES]
        device = self.device if self.device.type == "cuda" else torch.device("cpu")
        local = torch.tensor(row, dtype=torch.int64, device=device)
        rows = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(rows, local)
        rows = [r.tolist() for r in rows]
        worst = max(range(self.world_size), key=lambda r: rows[r][0])
        w = rows[worst]
        mine.update({
            "peak_allocated": w[0], "tracker_peak_allocated": w[1],
            "peak_reserved": w[2] if mine["peak_reserved"] is not None else None,
            "peak_phase": phases[w[3]], "components": dict(zip(CATEGORIES, w[4:])),
            "per_rank_peak_allocated": [r[0] for r in rows], "peak_rank": worst,
        })


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distplan.validate.probe", description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True, help="probe spec JSON file")
    ap.add_argument("--out", required=True, help="result JSON file (written by rank 0, atomically)")
    args = ap.parse_args(argv)
    _die_with_launcher()
    if os.environ.get("RANK", "0") == "0" and os.path.exists(args.out):
        os.unlink(args.out)  # a stale result would shadow this run's error (errors never clobber)
    try:
        with open(args.spec) as f:
            spec = json.load(f)
    except (OSError, ValueError) as e:
        probe = Probe({})
        probe.result["error"] = _one_line(e)
        write_json(args.out, probe.result, clobber=False)
        return 1
    probe = Probe(spec)
    try:
        probe.init()
        probe.run()
    except BaseException as e:  # noqa: BLE001 - every failure is a result
        if isinstance(e, KeyboardInterrupt):
            raise
        oom = _is_oom(e)
        probe.result["status"] = "oom" if oom else "error"
        probe.result["error"] = _one_line(e)
        probe.result["error_rank"] = probe.rank
        try:
            if probe.tracker is not None:
                probe._record_memory(complete=False)
        except Exception:  # noqa: BLE001
            pass
        write_json(args.out, probe.result, clobber=False)
        return 1
    if probe.rank == 0:
        write_json(args.out, probe.result)
    try:
        import torch.distributed as dist

        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
