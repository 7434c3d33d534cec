"""The probe specs of one set of `distplan validate`'s options (`_build`): every check of the options
(exit 2, one line naming the flag) made before any probe runs, the model resolved and checked to fit."""

from __future__ import annotations

import os

import click

from distplan.planner import api
from distplan.planner.allocator import parse_alloc_conf
from distplan.planner.api import predict_probe
from distplan.planner.cli import UserError, use_trace
from distplan.planner.config import TrainConfig
from distplan.planner.hf_config import read_hf_config
from distplan.planner.model import ModelSpec
from distplan.planner.module_plan import check_hf_config, probe_kernel_workspaces
from distplan.planner.strategies import NAMES, get_strategy
from distplan.planner.tp import TP_STRATEGIES
from distplan.planner.units import fmt_bytes
from distplan.planner.workload.limits import user_code_limits
from distplan.planner.workload.trace import check_factory
from distplan.planner.workload.traced_model import parse_shape
from distplan.planner.workload.traced_model import hf_path

from . import matrix as mx
from .matrix import HF_PP_TYPES, HF_TP_TYPES
from . import runner
from .render import _param_count, describe_model
from .runner import _full_param_bytes


RAM_FRACTION = 0.5
"""A user-given model must fit in this fraction of free RAM (CPU), across all local ranks."""

PP_PROBE_STRATEGIES = ("single", "ddp", "zero3")
"""What `validate --pp` runs on each stage by default; on request also zero1 (DDP with
ZeroRedundancyOptimizer over the stage's ranks) and zero2, which under pipeline stages is zero3's twin
(FSDP2 with reshard_after_forward off, torchtitan's choice with PP)."""


def _build(p: dict, get_hw) -> dict:
    """The probe specs of one set of the command's options `p` (the command line, or a --plan group):
    {"specs", "model_label", "model_about", "mode_note", "matrix"}. Every check of the options is made
    here, before any probe runs; `get_hw()` is the machine (runner.detect_hardware, asked once)."""
    matrix, tp, simulate_world_size, nproc, nnodes = (p[k] for k in ("matrix", "tp", "simulate_world_size", "nproc",
                                                                     "nnodes"))
    overrides = {k: p[k] for k in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab")}
    user_model = any(v is not None for v in (p["model"], p["params"], p["hf_config"], *overrides.values()))
    module_spec, hf_split = _probe_model(p, overrides, user_model)
    strategies, tp_default = _layout_strategies(p, module_spec, hf_split)

    hw = get_hw()
    device = "gpu" if hw.get("gpus") else "cpu"
    try:
        mode, world, mode_note = runner.choose_mode(hw, simulate_world_size, nproc, nnodes, explain=True)
    except ValueError as e:
        raise UserError(str(e))
    if not (simulate_world_size or nproc or tp_default) and nnodes == 1:
        mode, world, mode_note = _mesh_world(p, strategies, hw, mode, world, mode_note)

    if tp > 1 and tp_default:  # FSDP2 where the dp dimension has 2+ ranks (a dp of 1 shards nothing)
        strategies = tuple(s for s in strategies if not get_strategy(s).distributed
                           or (world % tp == 0 and world // tp >= 2))
    model_about = None
    precision = p["precision"]
    if matrix:
        specs = mx.standard_matrix(hw, strategies, fake_world=simulate_world_size, steps=p["steps"])
        model_label = ", ".join(mx.shapes_for(device))
    elif module_spec is not None:
        if precision is None:
            precision = mx.matrix_precisions(hw)[0]
        specs, model_label = _module_probe_specs(p, module_spec, strategies, precision, hw, mode, world)
    else:
        specs, model_label, model_about = _decoder_probe_specs(p, overrides, user_model, hf_split, strategies,
                                                               precision, hw, mode, world)
    _apply_session_options(p, specs, module_spec, hw)
    if module_spec is not None and hw.get("gpus"):
        # cuDNN's convolution workspaces, measured here once per call (planner/workload/kernel_workspace.py).
        module_spec["kernel_workspaces"] = probe_kernel_workspaces(module_spec, precision, strategies)
    return {"specs": specs, "model_label": model_label, "model_about": model_about, "mode_note": mode_note,
            "matrix": matrix}


def _probe_model(p: dict, overrides: dict, user_model: bool) -> tuple:
    """(module_spec: a --module or traced --hf-config model, or None; hf_split: an --hf-config model split by
    --tp, --pp or --cp, or None), the model options checked against --matrix, --init and --sequence-parallel."""
    (model, params, hf_config, front_end, module_factory, input_shape, layers, micro_batch, seq_len, attention,
     matrix, init, tp, pp, cp, sequence_parallel) = (p[k] for k in (
        "model", "params", "hf_config", "front_end", "module_factory", "input_shape", "layers", "micro_batch",
        "seq_len", "attention", "matrix", "init", "tp", "pp", "cp", "sequence_parallel"))
    module_spec = None
    if module_factory is not None or input_shape is not None:
        module_spec = _module_spec(module_factory, input_shape, matrix, user_model,
                                   dict(model=model, params=params, hf_config=hf_config, **overrides),
                                   p.get("timeout_s"))
    if hf_config is not None and module_spec is None:
        try:
            trace = use_trace({"hf_config": hf_config, "front_end": front_end})
        except ValueError as e:
            raise click.BadParameter(str(e).split(": ", 1)[1], param_hint="'--front-end'")
        if trace and not matrix:
            module_spec = _hf_spec(hf_config, layers, micro_batch, seq_len,
                                   {k: v for k, v in overrides.items() if k != "layers"}, model, params)
            if attention != "sdpa":  # the probe builds the model with attn_implementation="eager"
                module_spec["attention"] = attention
    if matrix and user_model:
        given = [f"--{k.replace('_', '-')}" for k, v in dict(model=model, params=params, hf_config=hf_config,
                                                              **overrides).items() if v is not None]
        raise click.UsageError(f"{', '.join(given)}: --matrix runs its own model shapes; drop "
                               f"{'it' if len(given) == 1 else 'them'} or drop --matrix")
    if sequence_parallel and tp == 1:
        raise click.BadParameter("needs --tp > 1 (it shards along the tensor-parallel group)",
                                 param_hint="'--sequence-parallel'")
    if init is not None and (module_spec is None or tp > 1 or pp > 1 or cp > 1):
        raise click.BadParameter(f"{init!r} is for an --hf-config or --module model under FSDP; the reference "
                                 f"decoder, --tp, --pp and --cp probes build on the device", param_hint="'--init'")
    hf_split = None  # --hf-config with --tp, --pp or --cp: the transformers model split by torchtitan's plan (TP),
    # into stages (PP) or over ring-attention ranks (CP), predicted by the analytic front end
    if (tp > 1 or pp > 1 or cp > 1) and module_spec is not None and "hf_config" in module_spec:
        hf_split, module_spec = module_spec, None
    return module_spec, hf_split


def _layout_strategies(p: dict, module_spec, hf_split) -> tuple:
    """(the strategies to probe, tp_default: --tp with no --strategy given), --strategy checked against
    --tp, --pp and --cp (and those against --matrix and --module)."""
    strategies, matrix, tp, pp, cp, pp_schedule, pp_microbatches = (p[k] for k in (
        "strategies", "matrix", "tp", "pp", "cp", "pp_schedule", "pp_microbatches"))
    tp_default = False
    if tp > 1:
        if matrix or module_spec is not None:
            raise click.UsageError(f"--tp={tp}: tensor-parallel probes run the reference decoder; drop "
                                   f"{'--matrix (it has its own tp probes)' if matrix else '--module'}")
        bad = [s for s in strategies if s not in TP_STRATEGIES]
        if bad:
            raise click.BadParameter(f"{', '.join(bad)} with --tp={tp}: the probes compose tensor parallelism "
                                     f"with {', '.join(TP_STRATEGIES)} (FSDP2 on the dp mesh dimension, "
                                     f"torchtitan's layout)", param_hint="'--strategy'")
        tp_default = not strategies
        strategies = strategies or TP_STRATEGIES
    if pp > 1 or pp_microbatches is not None:
        strategies = _pp_strategies(strategies, pp, cp, pp_schedule, pp_microbatches, matrix, module_spec, hf_split,
                                    tp)
    if cp > 1:
        if matrix or module_spec is not None:
            raise click.UsageError(f"--cp={cp}: context-parallel probes run the reference decoder or a transformers "
                                   f"model; drop {'--matrix (it has its own cp probes)' if matrix else '--module'}")
        single = [s for s in strategies if not get_strategy(s).distributed]
        if single:
            raise click.BadParameter(f"single with --cp={cp}: the cp ranks' gradients must be averaged; use a "
                                     f"data-parallel strategy", param_hint="'--strategy'")
        strategies = strategies or tuple(n for n in NAMES if get_strategy(n).distributed)
    return strategies or tuple(NAMES), tp_default


def _mesh_world(p: dict, strategies, hw: dict, mode: str, world: int, note: str | None) -> tuple:
    """(mode, world, note): the default world grown to the smallest the --tp x --cp mesh fits with a
    data-parallel dimension (FSDP2 over world / tp ranks: 2 or more; cp x tp divides the world), when a
    data-parallel strategy was asked for and neither --nproc nor --simulate-world-size was given. On the CPU
    that many gloo processes; on a machine with fewer GPUs, rank 0 of that world on the fake process group."""
    tp, cp = p["tp"], p["cp"] if p["pp"] == 1 else 1
    if tp * cp == 1 or not any(get_strategy(s).distributed for s in strategies):
        return mode, world, note
    need = tp * cp * (2 if cp == 1 else 1)
    if world % (tp * cp) == 0 and world // tp >= 2:
        return mode, world, note
    layout = " x ".join(f"{flag} {n}" for flag, n in (("--tp", tp), ("--cp", cp)) if n > 1)
    gpus = int(hw.get("gpus") or 0)
    if gpus and gpus < need:
        return "fake", need, (f"{layout} with a data-parallel dimension needs {need} ranks and this machine has "
                              f"{gpus} GPU(s): probing rank 0 of {need} on the fake process group (as "
                              f"--simulate-world-size {need})")
    return mode, need, (f"{layout} with a data-parallel dimension needs {need} ranks: running {need} "
                        f"{'processes' if mode == 'cpu' else 'GPUs'} (as --nproc {need})")


def _pp_strategies(strategies, pp: int, cp: int, pp_schedule: str, pp_microbatches, matrix, module_spec, hf_split,
                   tp: int) -> tuple:
    """The strategies of a --pp probe, --pp's options checked."""
    if pp == 1:
        raise click.BadParameter("needs --pp > 1", param_hint="'--pp-microbatches'")
    if matrix or module_spec is not None or tp > 1:
        raise click.UsageError(f"--pp={pp}: the pipeline probe runs the reference decoder or a transformers "
                               f"model alone; drop " + ("--matrix (it has its own pp probes)" if matrix else
                                                        "--module" if module_spec is not None else "--tp"))
    if hf_split and cp > 1:
        raise click.UsageError(f"--pp={pp} with --cp={cp}: the pipeline probe's context parallelism runs the "
                               f"reference decoder; drop --hf-config or --cp")
    if cp > 1 and any(not get_strategy(s).distributed for s in strategies):
        raise click.BadParameter(f"--cp={cp} with --pp={pp}: the probe runs cp under ddp, zero2 or zero3",
                                 param_hint="'--cp'")
    bad = [s for s in strategies if get_strategy(s).fsdp1]  # the probe wraps stages by ddp, zero1 or FSDP2
    if bad:
        raise click.BadParameter(f"{', '.join(bad)} with --pp={pp}: the pipeline probe runs each stage alone "
                                 f"(single) or over 2 replicas under ddp, zero1, zero2 or zero3 (FSDP2)",
                                 param_hint="'--strategy'")
    ddp = [s for s in strategies if get_strategy(s).ddp_reducer]
    if pp_schedule != "1f1b" and ddp:
        raise click.BadParameter(f"{ddp[0]} with --pp-schedule {pp_schedule}: torch's DDP reducer stops under it "
                                 f"(1f1b runs); use zero2 or zero3", param_hint="'--strategy'")
    defaults = PP_PROBE_STRATEGIES if pp_schedule == "1f1b" else ("single", "zero3")
    return strategies or tuple(s for s in defaults if not (cp > 1 and not get_strategy(s).distributed))


def _module_probe_specs(p: dict, module_spec: dict, strategies, precision: str, hw: dict, mode: str,
                        world: int) -> tuple:
    """(specs, model label) of a --module or traced --hf-config model's probes."""
    device = "gpu" if hw.get("gpus") else "cpu"
    steps, init, hf_config, nnodes = p["steps"], p["init"], p["hf_config"], p["nnodes"]
    hf = "hf_config" in module_spec
    if hf and not module_spec["seq_len"]:
        module_spec["seq_len"] = (mx.TRAIN_GPU if device == "gpu" else mx.TRAIN_CPU)["seq_len"]
    train = dict(seq_len=module_spec["seq_len"] if hf else 1,
                 micro_batch=module_spec["micro_batch"] if hf else module_spec["input_shape"][0],
                 grad_accum=p["grad_accum"], grad_sync=p["grad_sync"],
                 precision=precision, optimizer=p["optimizer"], optimizer_impl=p["optimizer_impl"],
                 checkpointing=p["checkpointing"], attention=p["attention"])
    specs = []
    for s in strategies:
        m, w = (("gpu" if device == "gpu" else "cpu"), 1) if not get_strategy(s).distributed else (mode, world)
        label = f"hf:{module_spec['hf_config']}" if hf else module_spec["factory"]
        sp = mx.make_spec(s, {"name": label}, w, m, steps=steps, **train)
        sp["module"] = module_spec
        if get_strategy(s).fsdp and (init or ("meta" if hf else "device")) == "meta":
            sp["init"] = "meta"  # built on the meta device (validate/wrap.py materialize)
            sp["id"] += "/init=meta"
        specs.append(sp)
    scaled = None
    if hf and module_spec["layers"] is None and module_spec.get("vocab") is None:
        scaled = _scale_to_machine(specs, module_spec, hw, nnodes)
    _check_fits(specs, hw, nnodes, hint="shorten it with --layers 1, a smaller --vocab or --seq-len" if hf else
                "give a smaller --input-shape or module", hf_config=hf_config,
                module=None if hf else module_spec["factory"])
    sizes = scaled or (f"{module_spec.get('layers') or 'all'} layers"
                       + (f", vocabulary {module_spec['vocab']:,}" if module_spec.get("vocab") else ""))
    model_label = (f"{hf_config} (transformers, {sizes}) at "
                   f"{module_spec['micro_batch']}x{module_spec['seq_len']} tokens, trace front end" if hf else
                   f"{module_spec['factory']} at input {tuple(module_spec['input_shape'])}")
    return specs, model_label


def _decoder_probe_specs(p: dict, overrides: dict, user_model: bool, hf_split, strategies, precision: str, hw: dict,
                         mode: str, world: int) -> tuple:
    """(specs, model label, model about) of the reference decoder's probes (a named or sized model, or an
    --hf-config model split by --tp, --pp or --cp)."""
    (model, params, hf_config, seq_len, micro_batch, checkpointing, attention, tp, sequence_parallel, cp, pp,
     steps, nnodes) = (p[k] for k in ("model", "params", "hf_config", "seq_len", "micro_batch", "checkpointing",
                                      "attention", "tp", "sequence_parallel", "cp", "pp", "steps", "nnodes"))
    device = "gpu" if hw.get("gpus") else "cpu"
    spec_model = _resolve_model(model, params, hf_config, overrides, device, implementation=hf_split is not None)
    if precision is None:
        precision = mx.matrix_precisions(hw)[0]
    if precision in ("bf16-mixed", "bf16") and device == "gpu" and not hw.get("bf16", True):
        raise click.BadParameter(f"{precision!r}: this GPU has no bf16; accepted here: fp32, fp16-mixed",
                                 param_hint="'--precision'")
    train = dict(seq_len=seq_len or (mx.TRAIN_GPU if device == "gpu" else mx.TRAIN_CPU)["seq_len"],
                 micro_batch=micro_batch, grad_accum=p["grad_accum"], grad_sync=p["grad_sync"], precision=precision,
                 optimizer=p["optimizer"], optimizer_impl=p["optimizer_impl"], checkpointing=checkpointing,
                 attention=attention)
    if spec_model.get("position") == "learned" and train["seq_len"] > spec_model.get("max_positions", 0):
        raise click.BadParameter(f"{train['seq_len']} exceeds the model's {spec_model['max_positions']} "
                                 f"learned positions", param_hint="'--seq-len'")
    specs = []
    if pp > 1:
        specs += _pp_probe_specs(p, spec_model, train, strategies, hf_split, hw)
        strategies = ()
    if tp > 1:
        _check_tp(tp, spec_model, train, strategies, mode, world, hw, hf=hf_split is not None)
        if hf_split and sequence_parallel and attention == "eager":
            # transformers sizes its materialized causal mask by the embedding output, s / tp tokens
            raise click.BadParameter("--attention eager with --sequence-parallel: the eager mask is s/tp long; "
                                     "drop one",
                                     param_hint="'--sequence-parallel'")
    if cp > 1 and pp == 1:
        _check_cp(cp, tp, spec_model, train, mode, world, hw, hf=hf_split is not None)
    for s in strategies:
        if not get_strategy(s).distributed:
            # tp ranks: real ones where there are (gloo on CPU, tp GPUs), else the fake group
            real = "cpu" if device == "cpu" else ("gpu" if int(hw.get("gpus") or 0) >= tp else "fake")
            m, w = (real if tp > 1 else ("gpu" if device == "gpu" else "cpu")), 1
        else:
            m, w = mode, world
        specs.append(mx.make_spec(s, spec_model, w, m, steps=steps, tp=tp,
                                  sequence_parallel=sequence_parallel, cp=cp, **train,
                                  model_name=f"hf:{hf_split['hf_config']}" if hf_split else None))
        if hf_split:
            specs[-1]["module"] = dict(hf_split, seq_len=train["seq_len"], micro_batch=micro_batch,
                                       **({"attention": attention} if attention != "sdpa" else {}))
    model_label = spec_model["name"]
    model_about = describe_model(spec_model, default=not user_model)
    if hf_split:
        model_label = (f"{hf_config} (transformers, {hf_split['layers'] or 'all'} layers) at {micro_batch}x"
                       f"{train['seq_len']} tokens, split " + " and ".join(
                           x for x, on in (("into pipeline stages", pp > 1),
                                           ("by torchtitan's tensor-parallel plan", tp > 1),
                                           ("over context-parallel ranks (ring attention)", cp > 1)) if on)
                       + ", analytic front end")
        model_about = None
    if user_model or not p["matrix"]:  # the matrix's own probes are sized for the machine they run on
        _check_fits(specs, hw, nnodes, model=model, params=params, hf_config=hf_config)
    return specs, model_label, model_about


def _pp_probe_specs(p: dict, spec_model: dict, train: dict, strategies, hf_split, hw: dict) -> list:
    """The pipeline probes' specs, one per strategy, --pp's layout checked against the model."""
    pp, cp, pp_schedule, pp_microbatches, micro_batch = (p[k] for k in ("pp", "cp", "pp_schedule",
                                                                       "pp_microbatches", "micro_batch"))
    _check_pp(pp, pp_schedule, pp_microbatches, spec_model, train, hw, hf=hf_split is not None)
    if cp > 1:
        _check_cp(cp, 1, spec_model, train, "cpu", pp * cp, hw)
    specs = []
    for s in strategies:
        specs.append(mx.pp_spec(s, spec_model, pp, pp_schedule, pp_microbatches or 2 * pp,
                                dp=2 if get_strategy(s).distributed and cp == 1 else 1, cp=cp,
                                checkpointing=p["checkpointing"], seq_len=train["seq_len"], micro_batch=micro_batch))
        if hf_split:
            name = f"hf:{hf_split['hf_config']}"
            specs[-1]["id"] = specs[-1]["id"].replace(f"/{spec_model['name']}/", f"/{name}/", 1)
            specs[-1]["model"]["name"] = name
            specs[-1]["module"] = dict(hf_split, seq_len=train["seq_len"], micro_batch=micro_batch)
    return specs


def _apply_session_options(p: dict, specs: list, module_spec, hw: dict) -> None:
    """--alloc-conf (or PYTORCH_CUDA_ALLOC_CONF) and --cpu-offload checked and set on every spec, with the
    device each probe runs on."""
    alloc_conf, cpu_offload, pp, tp, cp = (p[k] for k in ("alloc_conf", "cpu_offload", "pp", "tp", "cp"))
    if alloc_conf is None and os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        alloc_conf = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    if alloc_conf:
        try:
            parse_alloc_conf(alloc_conf, "--alloc-conf")
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    if cpu_offload != "none":
        if not hw.get("gpus"):
            raise click.BadParameter(f"{cpu_offload!r} needs a GPU: on the CPU, host and device memory are one, so "
                                     f"no probe can see what offload moves", param_hint="'--cpu-offload'")
        if module_spec is not None or pp > 1 or tp > 1 or cp > 1:
            raise click.BadParameter(f"{cpu_offload!r}: probed on the reference decoder without --tp/--pp/--cp "
                                     f"(the trace front end and the parallel layouts do not model offload)",
                                     param_hint="'--cpu-offload'")
    for s in specs:  # fake-process-group probes run on the GPU when there is one
        if cpu_offload != "none":
            s["train"]["cpu_offload"] = cpu_offload
            s["id"] += f"/offload={cpu_offload}"
        if alloc_conf:  # probe_run.ProbeRun exports it to the probe; the id tells the records apart
            s["train"]["alloc_conf"] = alloc_conf
            s["id"] += f"/alloc={alloc_conf}"
        s["device_type"] = "cuda" if hw.get("gpus") else "cpu"
        if hw.get("gpus") and hw.get("gpu_names"):
            s["gpu_name"] = hw["gpu_names"][0]  # sizes the cuBLAS workspaces in the prediction


def _check_tp(tp: int, spec_model: dict, train: dict, strategies, mode: str, world: int, hw: dict,
              hf: bool = False) -> None:
    """--tp with the reference decoder or a transformers model (`hf`: a type the probe splits,
    validate/tp_probe.HF_TP_TYPES, tied head or not): a RoPE model (the reference decoder: with an untied
    head) whose heads, kv heads and MLP width tp divides (the planner's check, named by flag), a world that tp
    divides for zero2/zero3."""

    if hf:
        _check_hf_split(f"--tp={tp}", spec_model, train, "the tensor-parallel probe splits", None, HF_TP_TYPES,
                        " (separate q/k/v and gate/up projections)")

    if spec_model.get("position", "rope") != "rope" or (spec_model.get("tie_embeddings") and not hf):
        raise click.BadParameter(f"--tp={tp}: the tensor-parallel probe runs RoPE models with an untied LM head; "
                                 f"{spec_model.get('name')} has position={spec_model.get('position')!r}, "
                                 f"tie_embeddings={spec_model.get('tie_embeddings')}", param_hint="'--tp'")
    try:
        TrainConfig(ModelSpec(**spec_model), tp=tp, seq_len=train["seq_len"], micro_batch=train["micro_batch"])
    except ValueError as e:
        raise click.BadParameter(str(e).replace("tp=", "--tp=", 1), param_hint="'--tp'")
    multi = [s for s in strategies if get_strategy(s).distributed]
    if multi and (world % tp or world // tp < 2):
        raise click.BadParameter(f"{', '.join(multi)} with --tp={tp} needs a world of 2 x {tp} ranks or a multiple "
                                 f"of {tp} above it (the dp mesh dimension shards over world / tp ranks), not "
                                 f"{world} ({mode}); set --simulate-world-size or --nproc", param_hint="'--tp'")


def _check_pp(pp: int, schedule: str, microbatches, spec_model: dict, train: dict, hw: dict,
              hf: bool = False) -> None:
    """--pp with the reference decoder or a transformers model (`hf`: a type the probe splits,
    validate/pp_probe.HF_PP_TYPES, under SDPA): fp32 on the CPU (the pipeline probe runs gloo), an untied
    RoPE model, the planner's own check of the split (named by flag)."""

    if hf:
        _check_hf_split(f"--pp={pp}", spec_model, train, "the pipeline probe splits",
                        "the pipeline probe calls transformers' layers without a mask, which only SDPA runs causally")

    if int(hw.get("gpus") or 0):
        raise click.BadParameter(f"--pp={pp}: the pipeline probe runs on the CPU only (gloo); set "
                                 f"CUDA_VISIBLE_DEVICES= to run it here", param_hint="'--pp'")
    if train["precision"] != "fp32" or train["grad_accum"] != 1 or train["checkpointing"] not in ("none", "full"):
        raise click.BadParameter(f"--pp={pp}: the pipeline probe runs fp32, --grad-accum 1 and checkpointing none "
                                 f"or full, not {train['precision']}, {train['grad_accum']}, {train['checkpointing']}",
                                 param_hint="'--pp'")
    if spec_model.get("position", "rope") != "rope" or spec_model.get("tie_embeddings"):
        raise click.BadParameter(f"--pp={pp}: the pipeline probe runs RoPE models with an untied LM head",
                                 param_hint="'--pp'")
    try:
        TrainConfig(ModelSpec(**spec_model), pp=pp, pp_schedule=schedule, pp_microbatches=microbatches or 2 * pp,
                    seq_len=train["seq_len"], micro_batch=train["micro_batch"], checkpointing=train["checkpointing"])
    except ValueError as e:
        raise click.BadParameter(str(e).replace("pp=", "--pp=", 1).replace("checkpointing", "--activation-checkpointing"),
                                 param_hint="'--pp'")


def _check_cp(cp: int, tp: int, spec_model: dict, train: dict, mode: str, world: int, hw: dict,
              hf: bool = False) -> None:
    """--cp with the reference decoder: a RoPE model, a sequence that 2 x cp divides (the planner's check),
    CPU probes, a world that cp x tp divides."""

    if int(hw.get("gpus") or 0):
        raise click.BadParameter(f"--cp={cp}: the context-parallel probe runs ring attention on the CPU only "
                                 f"(gloo or the fake process group); set CUDA_VISIBLE_DEVICES= to run it here",
                                 param_hint="'--cp'")
    if hf:
        _check_hf_split(f"--cp={cp}", spec_model, train, "the context-parallel probe runs",
                        "ring attention replaces transformers' SDPA call")
    if spec_model.get("position", "rope") != "rope":
        raise click.BadParameter(f"--cp={cp}: the context-parallel probe runs RoPE models; {spec_model.get('name')} "
                                 f"has position={spec_model.get('position')!r}", param_hint="'--cp'")
    try:
        TrainConfig(ModelSpec(**spec_model), tp=tp, cp=cp, seq_len=train["seq_len"], micro_batch=train["micro_batch"],
                    attention=train.get("attention", "sdpa"))
    except ValueError as e:
        raise click.BadParameter(str(e).replace("cp=", "--cp=", 1), param_hint="'--cp'")
    if world % (cp * tp):
        raise click.BadParameter(f"--cp={cp} needs a world that cp x tp = {cp * tp} divides, not {world} ({mode}); "
                                 f"set --simulate-world-size or --nproc", param_hint="'--cp'")


def _check_hf_split(flag: str, spec_model: dict, train: dict, what: str, why_sdpa: str | None,
                    types: tuple | None = None, why_types: str = "") -> None:
    """A transformers model for the tensor-parallel, pipeline or context-parallel probe: a model type whose
    modules it knows (`types`; default validate/pp_probe.HF_PP_TYPES), and under SDPA where `why_sdpa` says
    why it must be."""
    if types is None:
        types = HF_PP_TYPES
    hint = f"'{flag.split('=')[0]}'"
    kind = spec_model.get("hf_model_type")
    if kind not in types:
        raise click.BadParameter(f"{flag}: model_type {kind!r}: {what} {', '.join(types)}{why_types}", param_hint=hint)
    if why_sdpa and train.get("attention", "sdpa") != "sdpa":
        raise click.BadParameter(f"{flag}: {why_sdpa}; drop --attention eager", param_hint=hint)


# -- model resolution and fit check -----------------------------------------------------------------

def _module_spec(factory, input_shape, matrix: bool, user_model: bool, given: dict,
                 timeout_s: float | None = None) -> dict:
    """The probe spec's "module" object for --module/--input-shape, after checking the combination."""
    if factory is None:
        raise click.BadParameter(f"{input_shape!r} needs --module PKG.MOD:FACTORY", param_hint="'--input-shape'")
    if not input_shape:
        raise click.BadParameter(f"{factory!r} needs --input-shape, the example input's shape with the batch "
                                 f"first, e.g. 128,1,28,28", param_hint="'--module'")
    if matrix:
        raise click.UsageError("--module and --matrix: --matrix runs its own model shapes; drop one")
    if user_model:
        flags = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is not None]
        raise click.UsageError(f"--module and {', '.join(flags)}: give only one model")
    try:
        shape = parse_shape(input_shape, "--input-shape")
        # as `estimate --module` does, before any probe: the factory builds, the model runs on fake
        # tensors; a factory that raises or calls sys.exit() is one line, exit 2
        cwd = os.getcwd()
        with user_code_limits(timeout_s):  # in a child: the session's --timeout, a memory cap, one line
            check_factory(factory, shape, cwd)
    except ValueError as e:
        raise click.UsageError(str(e).splitlines()[0])
    return {"factory": factory, "input_shape": list(shape), "path": os.getcwd()}


def _hf_spec(hf_config, layers, micro_batch, seq_len, other_overrides: dict, model, params) -> dict:
    """The probe spec's "module" object for --hf-config with the trace front end: the transformers model
    itself (planner/workload/traced_model.py), at --layers depth when given."""
    if model is not None or params is not None:
        raise click.UsageError("--hf-config and --model/--params: give only one model")
    given = [f"--{k.replace('_', '-')}" for k, v in other_overrides.items() if v is not None and k != "vocab"]
    if given:
        raise click.UsageError(f"{', '.join(given)} with --hf-config and the trace front end: only --layers "
                               f"and --vocab apply (edit the config.json, or use --front-end analytic)")
    try:
        check_hf_config(hf_config, seq_len)
    except ValueError as e:
        flag = "--seq-len" if str(e).startswith("--seq-len") else "--hf-config"
        raise click.BadParameter(str(e).split(": ", 1)[-1], param_hint=f"'{flag}'")
    spec = {"hf_config": hf_path(hf_config), "micro_batch": micro_batch, "seq_len": seq_len, "layers": layers}
    if other_overrides.get("vocab"):
        spec["vocab"] = int(other_overrides["vocab"])
    return spec


def _resolve_model(model, params, hf_config, overrides: dict, device: str, implementation: bool = False) -> dict:
    """The spec's model dict: `distplan estimate`'s resolution, or the matrix's small Llama by default.
    `implementation`: a --hf-config model as transformers implements it (the analytic front end's terms for
    its modeling code, `ModelSpec.hf_model_type`), for a probe that runs the transformers model itself."""

    given = {k: v for k, v in overrides.items() if v is not None}
    if model is None and params is None and hf_config is None:
        name = "llama-small" if device == "gpu" else "llama-tiny"
        base = dict(mx.shapes_for(device)[name], name=name)
        if given:
            base.update(given)
            base["name"] = name + "(" + ",".join(f"{k}={v}" for k, v in given.items()) + ")"
            if "heads" in given and "kv_heads" not in given and base["heads"] % base["kv_heads"]:
                base["kv_heads"] = base["heads"]
        return _checked_model(base)
    try:
        spec = api.resolve_model(model=model, params=params, hf_config=hf_config, overrides=given, implementation=implementation)
    except ValueError as e:
        raise click.UsageError(str(e))
    if isinstance(spec, tuple):  # (ModelSpec, notes)
        spec = spec[0]
    if implementation:
        return mx.model_dict(spec)
    if spec.sandwich_norms or spec.attn_softcap or spec.final_softcap or spec.head_dim_override or spec.qk_norm:
        raise click.UsageError(f"--hf-config={hf_config}: --front-end analytic probes distplan's reference "
                               f"decoder, which has no Gemma-2 sandwich norms, soft-capping, Qwen3 q/k norms or "
                               f"head_dim other than hidden/heads; validate it with --front-end trace (needs "
                               f"transformers)")
    return mx.model_dict(spec)


def _checked_model(d: dict) -> dict:

    fields = set(ModelSpec.__dataclass_fields__)
    try:
        return ModelSpec(**{k: v for k, v in d.items() if k in fields}).to_dict()
    except ValueError as e:
        raise click.UsageError(str(e))


def _check_fits(specs: list[dict], hw: dict, nnodes: int, hint: str | None = None, **flags) -> None:
    """Every probe must fit this machine (`_misfit`); else one line naming the flag that sized it (the
    default model: its --micro-batch and --seq-len)."""
    flag = next((f"--{k.replace('_', '-')}={v}" for k, v in flags.items() if v is not None), None)
    if flag is None and specs:  # the default model at the sizes given: name them
        train = specs[0].get("train") or {}
        flag = f"--micro-batch={train.get('micro_batch')} --seq-len={train.get('seq_len')}"
        hint = hint or "give a smaller --micro-batch or --seq-len"
    for spec in specs:
        why = _misfit(spec, hw, nnodes)
        if why:
            raise click.UsageError(f"{flag}: {why}; "
                                   + (hint or "validate a smaller model (e.g. --params 20M, or --layers/--hidden)")
                                   + " and let `distplan estimate` extrapolate")


def _misfit(spec: dict, hw: dict, nnodes: int) -> str | None:
    """Why the probe does not fit this machine, or None: the predicted peak per rank, or the whole model in
    fp32 while it is built if that is more (`runner._full_param_bytes`: every probe builds its model whole
    before wrapping shards it; a 7B model is 29 GB then and 0.5 GB per rank of 64 after `fully_shard`),
    x local ranks <= half the free RAM (CPU ranks, fake rank 0) or <= the GPU's memory (GPU ranks)."""
    try:
        peak = int(predict_probe(spec)["memory"]["peak_allocated"])
    except Exception:
        if spec.get("module"):  # a traced model that cannot be predicted: the probe's record says why
            return None
        peak = 16 * _param_count(spec["model"])  # fp32 params + grads + Adam's two states, unsharded
    cap, local, where = _room(spec, hw, nnodes)
    built = _full_param_bytes(spec)
    what = ""
    if built > peak:
        peak, what = built, " (the whole model in fp32 while it is built, before it is wrapped)"
    if cap and peak * local > cap:
        return f"probe {spec['id']} needs about {fmt_bytes(peak)} per rank{what}, more than {where}"
    return None


def _room(spec: dict, hw: dict, nnodes: int) -> tuple[int, int, str]:
    """(bytes one machine gives the probe's ranks (0: unknown), its local ranks, the words for it)."""
    if spec["mode"] == "gpu" or (spec["mode"] == "fake" and hw.get("gpus")):
        cap = min(hw.get("gpu_memory_bytes") or [0])
        return cap, 1, f"one {hw.get('gpu_names', ['GPU'])[0]} ({fmt_bytes(cap)})"
    cap = int(RAM_FRACTION * (hw.get("ram_bytes") or 0))
    local = 1 if spec["mode"] == "fake" else max(1, spec["world_size"] // max(1, nnodes))
    return cap, local, f"half the free RAM ({fmt_bytes(cap)}) across {local} local rank{'s' if local > 1 else ''}"


SCALE_LADDER = ((2, None), (2, 32768), (1, 32768), (1, 8192), (1, 2048))
"""(decoder layers, largest vocabulary) tried in turn for an --hf-config probe too big for this machine when
neither --layers nor --vocab was given: depth first (the decoder layers are alike, and `distplan estimate`
extrapolates the traced layers to any depth), then the vocabulary (embedding and LM head, 2 x vocab x hidden
parameters: 1.05 B of Llama-3-8B's 8.03 B). Width is kept: it sets every kernel's shape."""


def _over_bound(spec: dict, hw: dict, nnodes: int) -> bool:
    """A bound before any trace: fp32 params + grads + Adam's two states (4 x the model built in fp32), whole,
    on each local rank, more than the machine gives."""
    cap, local, _ = _room(spec, hw, nnodes)
    return bool(cap) and 4 * _full_param_bytes(spec) * local > cap


def _scale_to_machine(specs: list[dict], module_spec: dict, hw: dict, nnodes: int) -> str | None:
    """Scale an --hf-config probe down the SCALE_LADDER to the first rung its probes fit this machine at
    (`module_spec` is shared by `specs`, changed in place); the words for what was scaled, or None when it
    fits as it is or no rung does (then `_check_fits` says why, at the model's own size)."""
    if all(_misfit(sp, hw, nnodes) is None for sp in specs):
        return None
    config = read_hf_config(module_spec["hf_config"])
    depth, vocab = int(config["layers"]), int(config["vocab"])
    for layers, top in SCALE_LADDER:
        module_spec["layers"] = min(layers, depth)
        module_spec["vocab"] = min(top, vocab) if top and top < vocab else None
        if any(_over_bound(sp, hw, nnodes) for sp in specs):
            continue
        if all(_misfit(sp, hw, nnodes) is None for sp in specs):
            return (f"{module_spec['layers']} of {depth} layers"
                    + (f", vocabulary {module_spec['vocab']:,} of {vocab:,}" if module_spec["vocab"] else "")
                    + ", scaled to this machine's memory; --layers, --vocab to choose")
    module_spec["layers"] = module_spec["vocab"] = None
    return None
