"""The planner's prediction for a `distplan validate --module` probe (`predict_module_probe`, api.predict_probe's
shape for a traced model): the trace of module_plan.py in the regime the probe runs, walked on the probe's world,
its reserved peak paired with the analytic twin's where the probe is a transformers model on a GPU, and the step
time the probe should measure."""

from __future__ import annotations

import sys
from dataclasses import replace

from distplan.planner.workload.traced_model import from_spec

from .compute import _gpu
from .config import Cluster, checkpoint_every
from .hardware import catalog_name
from .kernels import step_bound
from .memory import COMPONENTS
from .module_desc import FSDP2_BATCHNORM_ERRORS, ModuleDesc, ModuleModel, ModuleTrain, _regime, fsdp2_batchnorm_failure
from .module_plan import _traced, estimate_module_memory
from .module_step import module_collectives, module_time, traced_compute
from .module_twin import analytic_twins, pair_reserved, pair_tied, twin_time
from .strategies import Strategy, get_strategy


def predict_module_probe(spec: dict) -> dict:
    """The planner's prediction for a `distplan validate --module` probe (api.predict_probe's shape).

    The module is profiled on fake tensors in the regime the strategy runs it in, exactly as
    `distplan estimate --module` does, then walked by `estimate_module_memory` on the probe's world.
    """

    mod = spec["module"]
    if mod.get("path") and mod["path"] not in sys.path:
        sys.path.insert(0, mod["path"])  # where `distplan validate --module` was run
    work = from_spec(mod)
    shape = work.input_shape
    t = spec["train"]
    st = get_strategy(spec["strategy"])
    precision = t.get("precision", "fp32")
    device = spec.get("device_type") or ("cuda" if spec.get("mode") == "gpu" else "cpu")
    kernels = "cuda" if device == "cuda" else "cpu"
    ckpt = t.get("checkpointing", "none")
    every = checkpoint_every("none" if ckpt in ("selective", "selective-op") else ckpt)
    d = _traced(work, _regime(precision, st.family), kernels, every)
    if _regime(precision, st.family, d.batchnorm) != _regime(precision, st.family):  # FSDP1's BatchNorm units
        d = _traced(work, _regime(precision, st.family, True), kernels, every)
    d = d.for_precision(precision)
    workspaces = mod.get("kernel_workspaces") or {}  # measured on the probing GPU (validate_cmd)
    model = ModuleModel(d.name, work.label, d.param_count(), d.units, layers=len(d.units))
    train = ModuleTrain(model, precision=precision, optimizer=t.get("optimizer", "adamw"),
                        optimizer_impl=t.get("optimizer_impl", "foreach"),
                        checkpointing="none" if ckpt in ("selective", "selective-op") else ckpt,
                        grad_accum=int(t.get("grad_accum", 1)), grad_sync=t.get("grad_sync", "last"),
                        input_shape=shape, torch_version=spec.get("torch_version") or "",
                        alloc_conf=t.get("alloc_conf") or "", seq_len=shape[1] if work.kind == "hf" else "-")
    world = int(spec["world_size"])
    gpn = int(spec.get("gpus_per_node") or world)
    cluster = Cluster(gpus=world, gpus_per_node=gpn, gpu_memory_bytes=10**15,
                      gpu_name=spec.get("gpu_name") or "h100-sxm", nics_per_node=gpn)
    backend = {"gpu": "nccl", "cpu": "gloo", "fake": "fake"}.get(spec.get("mode"), "nccl")
    # (the fake process group runs rank 0 alone: its ZeRO-1 partition, which need not be the most loaded; measured:
    # a ViT's, 11% below the most loaded rank's optimizer state)
    # the probe built the model on the device, or on the meta device for FSDP (spec "init", validate/probe.py)
    init = "meta" if spec.get("init") == "meta" and st.fsdp else "device"
    mem = estimate_module_memory(d, train, cluster, st, device=device, backend=backend, workspaces=workspaces,
                                 rank=0 if spec.get("mode") == "fake" else None, init=init)
    out = {k: int(mem.components[k]) for k in COMPONENTS}
    out.update(workspace=int(mem.workspace), peak_allocated=int(mem.peak_allocated), peak_phase=mem.peak_phase)
    twin = None
    if device == "cuda" and work.kind == "hf":
        # judged on a GPU where the analytic front end's replay pairs with the trace (built as the probe built
        # it); a margin is not a prediction to judge
        kw = {"hf_config": mod["hf_config"], "layers": mod.get("layers"), "seq_len": shape[1],
              "micro_batch": shape[0], "precision": precision, "optimizer": train.optimizer,
              "optimizer_impl": train.optimizer_impl, "activation_checkpointing": ckpt,
              "grad_accum": train.grad_accum, "grad_sync": train.grad_sync, "alloc_conf": t.get("alloc_conf", ""),
              "torch_version": spec.get("torch_version") or "", "attention": work.attention}
        twin, _ = analytic_twins(kw, cluster, device, backend, init=init)
        if twin is not None:
            pair_tied(mem, d, twin(st.name, shape[0]))
            pair_reserved(mem, twin(st.name, shape[0]))  # (where its own run is not written)
    if device == "cuda" and (mem.reserved_replay is not None or mem.reserved_from is not None):
        out["peak_reserved"] = int(mem.peak_reserved)  # a margin is not a prediction to judge
    colls = [{"op": c.op, "group_size": c.group_size, "dtype": c.dtype, "message_bytes": int(c.message_bytes),
              "calls": int(c.calls)} for c in module_collectives(d, train, cluster, st.name)]
    step, bound = _probe_step_time(spec, d, train, cluster, st, twin, shape[0]) if device == "cuda" else (None, None)
    pred = {"memory": out, "collectives": colls, "step_time_s": step, "step_time_bound": bound}
    why = fsdp2_batchnorm_failure(d, precision) if st.fsdp2 else None
    if why:  # what PyTorch raises (CUDA's batch_norm; the CPU's)
        pred["fails"] = {"reason": why, "error_contains": list(FSDP2_BATCHNORM_ERRORS)}
    return pred


def _probe_step_time(spec: dict, d: ModuleDesc, train: ModuleTrain, cluster: Cluster, st: Strategy, twin,
                     batch: int) -> tuple[float | None, str | None]:
    """(step seconds, 'gpu' or 'host') a GPU probe of a traced model should measure, as `module_spec_plan`
    times the same run: the analytic twin's per-kernel model where the analytic front end reads the config,
    else the traced step's kernel census (`module_time`). On the fake process group the collectives return
    at once, so the exposed communication is left out (as api.predict_probe does for the reference decoder).
    'host' where the host issuing eager ops outlasts the GPU's kernels: reported by `validate`, not judged.
    (None, None) for a GPU the catalog does not name."""
    if spec.get("mode") not in ("gpu", "fake") or not spec.get("gpu_name"):
        return None, None
    cat = catalog_name(spec["gpu_name"])
    if not cat:
        return None, None
    cl = replace(cluster, gpu_name=cat)
    gpu = _gpu(cat)
    timed = twin_time(twin, st.name, batch, cl) if twin is not None else None
    if timed is not None:
        host_bound = step_bound(replace(twin.train, micro_batch=batch), gpu, st.family) == "host"
    else:
        timed = module_time(d, train, cl, module_collectives(d, train, cl, st.name), gpu, st)
        fwd_s, bwd_s, host_s = traced_compute(d, train, gpu)
        host_bound = host_s >= fwd_s + bwd_s
    step = timed.step_time_s - (timed.exposed_comm_s if spec.get("mode") == "fake" else 0.0)
    return step, "host" if host_bound else "gpu"
