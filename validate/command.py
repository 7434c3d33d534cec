"""`distplan validate`: run real probes and compare them with the planner's prediction.

Owns the command's options, its checks of user input (exit 2, one line naming the flag), the header that
says where probes run, the progress line, the tables and the exit code (0 all PASS, 1 any FAIL, 130 on
Ctrl-C). The work itself lives in the rest of `distplan.validate` (runner, matrix, results, compare), none of
which imports torch at import time. The `distplan` command finds this one and `calibrate` through the
package's entry points (group `distplan.commands`): the planner never imports `validate`.

`--module PKG.MOD:FACTORY --input-shape N,...` validates any nn.Module against the `--module` plan.

Known limitations: `--matrix` uses its own model shapes (model flags and --module are refused with it); across nodes
(`--nnodes`) the same command must be started on every node and only rank 0's node gets results.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys

import click
import yaml
from tabulate import tabulate

from distplan.planner import api
from distplan.planner.allocator import parse_alloc_conf
from distplan.planner.api import predict_probe
from distplan.planner.cli import UserError, use_trace
from distplan.planner.cli import _hub_config as _estimate_hub_config
from distplan.planner.config import ATTENTION, CHECKPOINTING, GRAD_SYNC, OFFLOAD, TrainConfig
from distplan.planner.model import ModelSpec
from distplan.planner.module_plan import check_hf_config, probe_kernel_workspaces
from distplan.planner.precision import OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS
from distplan.planner.strategies import NAMES, get_strategy
from distplan.planner.tp import TP_STRATEGIES
from distplan.planner.units import fmt_bytes, fmt_seconds
from distplan.planner.workload.trace import check_factory
from distplan.planner.workload.traced_model import parse_shape
from distplan.planner.workload.traced_model import hf_path

from . import matrix as mx
from . import runner
from .compare import ABS_FLOOR_BYTES, rule_text
from .pp_probe import HF_PP_TYPES
from .results import ResultsFile, check_results_path
from .runner import MAX_FAKE_WORLD, _full_param_bytes
from .tp_probe import HF_TP_TYPES

MODEL_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab")
COMPONENTS = ("params", "grads", "optimizer", "activations", "comm_buffers", "temporaries")
RAM_FRACTION = 0.5
"""A user-given model must fit in this fraction of free RAM (CPU), across all local ranks."""

PP_PROBE_STRATEGIES = ("single", "ddp", "zero3")
"""What `validate --pp` runs on each stage by default; on request also zero1 (DDP with
ZeroRedundancyOptimizer over the stage's ranks) and zero2, which under pipeline stages is zero3's twin
(FSDP2 with reshard_after_forward off, torchtitan's choice with PP)."""


def _strategies(ctx, param, values):
    out = []
    for v in values or ():
        if not str(v).replace(",", "").strip():
            raise click.BadParameter(f"{v!r} names no strategy; accepted: all, {', '.join(NAMES)}")
        for part in str(v).split(","):
            part = part.strip()
            if not part:
                continue
            if part.lower() == "all":
                out.extend(NAMES)
                continue
            try:
                out.append(get_strategy(part).name)
            except ValueError:
                raise click.BadParameter(f"{part!r} is not a strategy; accepted: all, {', '.join(NAMES)}")
    return tuple(dict.fromkeys(out))


def _positive_int(ctx, param, value):
    if value is not None and value < 1:
        raise click.BadParameter(f"{value} must be a positive integer (>= 1)")
    return value


def _fake_world(ctx, param, value):

    value = _positive_int(ctx, param, value)
    if value is not None and value > MAX_FAKE_WORLD:
        raise click.BadParameter(f"{value} is more than {MAX_FAKE_WORLD}: rank 0 of the fake process group holds "
                                 f"per-rank buffers for every rank in one process; accepted: 1..{MAX_FAKE_WORLD}")
    return value


class _OneLineErrors(click.Command):
    """Every usage error of `validate` is one line `Error: ...` with exit code 2, no usage banner
    (`cli.UserError`), whether raised while parsing the options or in the command."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:
            raise _one_line(e) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            raise _one_line(e) from None


def _one_line(e: click.UsageError) -> click.UsageError:

    if isinstance(e, UserError):
        return e
    return UserError(" ".join(e.format_message().split("\n")))


def _tolerance(ctx, param, value):
    if not (0 < value < 100):
        raise click.BadParameter(f"{value:g} is not a percentage in (0, 100), e.g. 5 for 5%")
    return value


def _timeout(ctx, param, value):
    if value is not None and not value > 0:
        raise click.BadParameter(f"{value:g} must be a positive number of seconds")
    return value


def _hub_config(ctx, param, value):
    """--hf-config: a Hub id that names no local file becomes its cached config.json (as estimate's)."""
    return _estimate_hub_config(ctx, param, value)


@click.command("validate", cls=_OneLineErrors)
@click.option("--strategy", "strategies", multiple=True, callback=_strategies, metavar="NAME",
              help=f"Strategy to probe (repeatable, comma-separated, or 'all'; default all): {', '.join(NAMES)}.")
@click.option("--model", default=None, help="Catalog model name (must fit this machine).")
@click.option("--params", default=None, help="Parameter count such as 50M (scaled Llama shape; must fit this machine).")
@click.option("--hf-config", default=None, callback=_hub_config, metavar="PATH|ID",
              help="A Hugging Face config.json to read the architecture from (or the folder holding one), or a Hub id such as "
                   "Qwen/Qwen2.5-0.5B[@revision] (its config.json from the Hugging Face cache, downloaded if missing).")
@click.option("--front-end", "front_end", type=click.Choice(("auto", "analytic", "trace")), default="auto",
              show_default=True, help="--hf-config: 'trace' probes the transformers model itself against the "
              "trace's plan (needs transformers); 'analytic' probes the reference decoder of that shape; "
              "'auto' traces when transformers is installed.")
@click.option("--module", "module_factory", default=None, metavar="PKG.MOD:FACTORY",
              help="Any nn.Module from a factory (as `estimate --module`); needs --input-shape.")
@click.option("--input-shape", default=None, metavar="N,C,H,W", help="Example input shape for --module, batch first.")
@click.option("--layers", type=int, default=None, callback=_positive_int)
@click.option("--hidden", type=int, default=None, callback=_positive_int)
@click.option("--heads", type=int, default=None, callback=_positive_int)
@click.option("--kv-heads", type=int, default=None, callback=_positive_int)
@click.option("--ffn-hidden", type=int, default=None, callback=_positive_int)
@click.option("--vocab", type=int, default=None, callback=_positive_int)
@click.option("--seq-len", type=int, default=None, callback=_positive_int, help="Default 64 on CPU, 256 on GPU.")
@click.option("--micro-batch", type=int, default=2, show_default=True, callback=_positive_int)
@click.option("--grad-accum", type=int, default=1, show_default=True, callback=_positive_int)
@click.option("--grad-sync", type=click.Choice(GRAD_SYNC), default="last", show_default=True,
              help="With --grad-accum > 1: no_sync (FSDP2: set_requires_gradient_sync(False)) on all but the "
                   "last micro-step, or reduce on every micro-step.")
@click.option("--precision", type=click.Choice(PRECISIONS), default=None,
              help="Default fp32 on CPU, bf16-mixed on GPU (fp16-mixed without bf16).")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adamw", show_default=True)
@click.option("--optimizer-impl", type=click.Choice(OPTIMIZER_IMPLS), default="foreach", show_default=True)
@click.option("--activation-checkpointing", "checkpointing", type=click.Choice(CHECKPOINTING), default="none",
              show_default=True)
@click.option("--attention", type=click.Choice(ATTENTION), default="sdpa", show_default=True)
@click.option("--cpu-offload", "cpu_offload", type=click.Choice(OFFLOAD), default="none", show_default=True,
              help="params: FSDP1 CPUOffload(offload_params=True), FSDP2 CPUOffloadPolicy (the other strategies "
                   "have none). GPU only (on the CPU, host and device memory are one); the reference decoder.")
@click.option("--alloc-conf", "alloc_conf", default=None, metavar="CONF",
              help="PYTORCH_CUDA_ALLOC_CONF for the probes (e.g. expandable_segments:True); the prediction's "
                   "reserved peak follows it. Default: the probes inherit this shell's.")
@click.option("--init", "init", type=click.Choice(("meta", "device")), default=None,
              help="How an --hf-config or --module model is built for FSDP (zero2, zero3, fsdp, fsdp-grad-op, hsdp, "
                   "fsdp-no-shard): meta (the default with --hf-config: on the meta device, wrapped there, then each "
                   "rank makes only its shards, torchtitan's way and what `estimate --hf-config` plans) or device "
                   "(the whole model on the device first, then wrapped; the default with --module). DDP, ZeRO-1 and "
                   "single build on the device.")
@click.option("--tp", type=int, default=1, show_default=True, callback=_positive_int,
              help="Tensor-parallel degree: the reference decoder split with torchtitan's Llama plan (with "
                   "--hf-config: the transformers model with torchtitan's plan for transformers models, predicted "
                   "by the analytic front end) over a (world / tp, tp) mesh; strategies single (tp ranks), "
                   "zero2, zero3 (FSDP2 on the dp dimension). Default strategies with --tp: those three.")
@click.option("--sequence-parallel", "sequence_parallel", is_flag=True, default=False,
              help="With --tp: sequence parallelism (torchtitan's default).")
@click.option("--cp", type=int, default=1, show_default=True, callback=_positive_int,
              help="Context-parallel degree: the reference decoder with ring attention (torch's "
                   "_templated_ring_attention) over a (world / (cp x tp), cp, tp) mesh, the strategy over the "
                   "dp x cp ranks; CPU probes only (gloo or the fake process group).")
@click.option("--pp", type=int, default=1, show_default=True, callback=_positive_int,
              help="Pipeline stages: the reference decoder split evenly and run by torch.distributed.pipelining "
                   "(gloo, one process per stage; with a data-parallel strategy, 2 replicas per stage); "
                   "strategies single, ddp, zero1, zero2, zero3.")
@click.option("--pp-schedule", "pp_schedule", type=click.Choice(("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb",
                                                                  "zbv")),
              default="1f1b", show_default=True,
              help="With --pp: the schedule the probe runs (interleaved and zero-bubble ones: 2 stages per rank; "
                   "DDP and ZeRO-1 run under 1f1b only; the zero-bubble ones without checkpointing).")
@click.option("--pp-microbatches", "pp_microbatches", type=int, default=None, callback=_positive_int,
              help="With --pp: micro-batches per step (default 2 x --pp).")
@click.option("--matrix", is_flag=True, help="Run the standard matrix (all strategies x 3 shapes x 2 world sizes "
              "x checkpointing x precision) instead of one probe per strategy.")
@click.option("--simulate-world-size", type=int, default=None, callback=_fake_world, metavar="N",
              help="Run as rank 0 of N ranks (at most 4096) on the fake process group (collectives counted, "
                   "not executed). The default where this machine has fewer than 2 GPUs (or --nproc 1): "
                   "rank 0 of 8.")
@click.option("--nproc", type=int, default=None, callback=_positive_int,
              help="Processes per node (default: the GPUs here, or 2 gloo ranks on CPU).")
@click.option("--nnodes", type=int, default=1, show_default=True, callback=_positive_int)
@click.option("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="Rendezvous endpoint for --nnodes > 1.")
@click.option("--tolerance", type=float, default=5.0, show_default=True, callback=_tolerance,
              help="Allowed |peak error| in percent (components: twice this, or 64 KiB).")
@click.option("--out", "out_path", default="distplan-results.jsonl", show_default=True,
              type=click.Path(dir_okay=False), help="JSON-lines file; one record appended per probe.")
@click.option("--resume", is_flag=True, help="Skip probes whose id (same inputs) already has a final record in --out.")
@click.option("--timeout", "timeout_s", type=float, default=300.0, show_default=True, callback=_timeout,
              help="Seconds per probe before its process group is killed.")
@click.option("--steps", type=int, default=3, show_default=True, callback=_positive_int,
              help="Training steps per probe (after one warm-up step).")
@click.option("--jobs", type=int, default=None, callback=_positive_int,
              help="CPU slots for concurrent probes (a gloo probe takes one per rank; default: CPU cores, "
                   "1 on GPU machines).")
@click.option("--json", "as_json", is_flag=True, help="Print the final report as one JSON object.")
@click.option("--plan", "plan_path", default=None, type=click.Path(dir_okay=False), metavar="FILE",
              help="A YAML list of probe groups, each a mapping of this command's options (hf-config, strategy, "
                   "precision, activation-checkpointing, simulate-world-size, alloc-conf, ...) over the ones "
                   "given here (paths relative to the working directory): every group is checked first, then all "
                   "probes run as one session in the file's order (--out, --resume, --jobs, --timeout, "
                   "--tolerance, --json are the session's).")
@click.option("--dry-run", "dry_run", is_flag=True,
              help="Check the options (and every --plan group, including that each probe fits this machine) and "
                   "list the probes with the device memory each is predicted to need; run nothing.")
@click.option("--probe-cmd", default=None, hidden=True, help="Replace the probe launcher (tests).")
@click.pass_context
def validate_command(ctx, strategies, model, params, hf_config, front_end, module_factory, input_shape, layers, hidden, heads, kv_heads, ffn_hidden,
                     vocab, seq_len, micro_batch, grad_accum, grad_sync, precision, optimizer, optimizer_impl,
                     checkpointing, attention, cpu_offload, alloc_conf, init, tp, sequence_parallel, cp, pp, pp_schedule,
                     pp_microbatches, matrix, simulate_world_size, nproc, nnodes, rdzv_endpoint,
                     tolerance, out_path, resume, timeout_s, steps, jobs, as_json, plan_path, dry_run, probe_cmd):
    """Run real torchrun probes and compare measured memory and collectives with the prediction.

    Where probes run: 2 GPUs or more here -> torchrun + NCCL, one rank per GPU; --simulate-world-size N
    -> one process as rank 0 of N on the fake process group (also the default, N=8, with one GPU or
    --nproc 1: a world of 1 validates no distributed strategy); no GPU -> CPU, gloo, 2 processes.
    Every probe is appended to --out the moment it ends. SIGTERM or Ctrl-C kill the running probes and
    remove their temp folders; the records already written stay.
    """


    try:
        check_results_path(out_path)  # before anything runs: a probe's result must have somewhere to go
    except ValueError as e:
        raise UserError(str(e))
    if nnodes > 1 and not rdzv_endpoint:
        raise click.BadParameter(f"--nnodes={nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)",
                                 param_hint="'--rdzv-endpoint'")
    hw_cache: dict = {}

    def get_hw() -> dict:
        if not hw_cache:
            hw = runner.detect_hardware()
            if hw.get("error"):
                raise click.ClickException(f"distplan validate needs torch ({hw['error']}); "
                                           f"install it with: pip install 'distplan[validate]'")
            hw_cache.update(hw)
        return hw_cache

    given = {k: ctx.params[k] for k in GROUP_OPTIONS}  # what a --plan group may set, as given here
    if plan_path is not None:
        groups = _plan_groups(ctx, plan_path, given, get_hw)
    else:
        groups = [_build(given, get_hw)]
    specs = [s for g in groups for s in g["specs"]]
    matrix = any(g["matrix"] for g in groups)
    hw = get_hw()
    if jobs is None:
        jobs = 1 if hw.get("gpus") else max(1, min(8, int(hw.get("cpu_count") or os.cpu_count() or 1)))
    tol = tolerance / 100.0
    err = sys.stderr
    modes = list(dict.fromkeys((s["mode"], s["world_size"]) for s in specs))
    if not probe_cmd and nnodes == 1 and any(s["mode"] in ("cpu", "gpu") for s in specs):
        why = runner.check_loopback()  # milliseconds; a torchrun probe without it waits for its timeout
        if why:
            raise click.ClickException(why)
    count = f"{len(specs)} probe{'s' if len(specs) != 1 else ''}"
    if plan_path is not None:
        header = [f"distplan validate --plan {plan_path}: {count} in {len(groups)} groups"]
        header += [f"  group {i}: {len(g['specs'])} probe{'s' if len(g['specs']) != 1 else ''}, model "
                   f"{g['model_label']}" for i, g in enumerate(groups, 1)]
    else:
        header = [f"distplan validate: {count}, model {groups[0]['model_label']}"]
        if groups[0]["model_about"]:
            header.append(f"  {groups[0]['model_about']}")
    notes = list(dict.fromkeys(g["mode_note"] for g in groups if g["mode_note"] and
                               any(s["mode"] == "fake" for s in g["specs"])))
    header += [f"  {n}" for n in notes]
    header += ["  " + runner.describe_mode(m, w, hw) for m, w in modes]
    header.append(f"  {rule_text(tol)}")
    header.append(f"  results -> {out_path}" + (" (resume)" if resume else ""))
    click.echo("\n".join(header), file=err if as_json else None)
    if dry_run:
        _list_probes(specs, hw)
        ctx.exit(0)

    progress = _Progress(len(specs), err)
    results = ResultsFile(out_path)
    restore = runner.handle_termination()
    try:
        records = runner.run_validation(
            specs, out_path, tolerance=tol, timeout_s=timeout_s,
            probe_cmd=shlex.split(probe_cmd) if probe_cmd else None, nnodes=nnodes,
            rdzv_endpoint=rdzv_endpoint, resume=resume, jobs=jobs, on_event=progress.event, results=results,
            device_memory_bytes=min(hw.get("gpu_memory_bytes") or [0]) or None)
    except (KeyboardInterrupt, runner.Terminated) as e:
        progress.clear()
        what = "terminated" if isinstance(e, runner.Terminated) else "interrupted"
        click.echo(f"{what}: {results.appended} probe{'s' if results.appended != 1 else ''} saved to "
                   f"{out_path}; run again with --resume to continue", file=err)
        ctx.exit(128 + e.signum if isinstance(e, runner.Terminated) else 130)
    finally:
        restore()
    progress.clear()

    failed = [r for r in records if r.get("verdict") not in ("PASS", "SKIP")]
    if as_json:
        report = {"out": out_path, "tolerance": tol, "rule": rule_text(tol),
                  "where": [runner.describe_mode(m, w, hw) for m, w in modes],
                  "probes": records, "summary": summarize(records) if len(records) > 1 else None,
                  "passed": sum(r.get("verdict") == "PASS" for r in records), "failed": len(failed),
                  "ok": not failed}
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        click.echo(render_table(records))
        why = render_why(records)
        if why:
            click.echo(why)
        detail = render_detail(records[0]) if len(records) == 1 else ""
        if detail:
            click.echo(detail)
        if matrix or len(records) > 1:
            click.echo(render_summary(records))
        skipped = sum(r.get("verdict") == "SKIP" for r in records)
        if failed:
            click.echo("\n" + FAIL_MEANS.format(tol=tol, ctol=2 * tol))
        click.echo(f"{len(records) - len(failed) - skipped}/{len(records)} PASS"
                   + (f"; {skipped} SKIP (rank 0 on another node)" if skipped else "")
                   + (f"; {len(failed)} FAIL" if failed else "") + f"; records in {out_path}")
    ctx.exit(1 if failed else 0)


GROUP_OPTIONS = (
    "strategies", "model", "params", "hf_config", "front_end", "module_factory", "input_shape", "layers",
    "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len", "micro_batch", "grad_accum", "grad_sync",
    "precision", "optimizer", "optimizer_impl", "checkpointing", "attention", "cpu_offload", "alloc_conf",
    "init", "tp", "sequence_parallel", "cp", "pp", "pp_schedule", "pp_microbatches", "matrix", "simulate_world_size",
    "nproc", "nnodes", "steps", "probe_cmd")
"""The command's parameters that describe probes, what `_build` reads (the rest are the session's: --out,
--resume, --jobs, --timeout, --tolerance, --json, --plan, --dry-run); a --plan group sets any of them but
the session's --nnodes and the tests' --probe-cmd (SESSION_OPTIONS)."""


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
                                   dict(model=model, params=params, hf_config=hf_config, **overrides))
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
    if hf:
        _check_fits(specs, hw, nnodes, hint="shorten it with --layers 2 and a smaller --seq-len",
                    hf_config=hf_config)
    model_label = (f"{hf_config} (transformers, {module_spec['layers'] or 'all'} layers) at "
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
    if user_model:
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
        if alloc_conf:  # runner.ProbeRun exports it to the probe; the id tells the records apart
            s["train"]["alloc_conf"] = alloc_conf
            s["id"] += f"/alloc={alloc_conf}"
        s["device_type"] = "cuda" if hw.get("gpus") else "cpu"
        if hw.get("gpus") and hw.get("gpu_names"):
            s["gpu_name"] = hw["gpu_names"][0]  # sizes the cuBLAS workspaces in the prediction


def _list_probes(specs: list[dict], hw: dict) -> None:
    """--dry-run: one line per probe, in the order they would run, with the device bytes the scheduler
    reserves for it beside other probes on a GPU (runner.gpu_need_bytes), and the total."""


    rows = []
    for s in specs:
        try:
            pred = predict_probe(s)
            peak = fmt_bytes(int(pred["memory"]["peak_allocated"]))
        except Exception as e:  # noqa: BLE001 - listed, not fatal: validate records the planner's failure too
            pred, peak = None, f"not predicted ({type(e).__name__})"
        need = fmt_bytes(runner.gpu_need_bytes(s, pred)) if hw.get("gpus") and s["mode"] == "fake" else "-"
        rows.append([s["id"], s["mode"], peak, need])
    click.echo(tabulate(rows, headers=["probe", "mode", "predicted peak", "GPU need beside others"],
                        disable_numparse=True))
    click.echo(f"{len(specs)} probe{'s' if len(specs) != 1 else ''} (dry run: nothing ran)")


SESSION_OPTIONS = ("out", "resume", "jobs", "timeout", "tolerance", "json", "plan", "dry-run", "nnodes",
                   "rdzv-endpoint", "probe-cmd")
"""Options a --plan group may not set: they belong to the whole session (one results file, one scheduler)."""


def _plan_groups(ctx, plan_path: str, given: dict, get_hw) -> list[dict]:
    """Every group of a --plan file built into probe specs (`_build`), before any probe runs. A group is
    a mapping of the command's long option names (without the dashes) to values: a list joins with
    commas (strategy), true sets a flag; the options given on the command line apply where a group is
    silent. Errors are one line naming the file, the group (from 1) and the option."""


    where = f"--plan={plan_path!r}"
    try:
        with open(plan_path) as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise UserError(f"{where}: cannot read it ({e.strerror or e})")
    except yaml.YAMLError as e:
        raise UserError(f"{where}: not valid YAML ({' '.join(str(e).split())})")
    if not isinstance(doc, list) or not doc or not all(isinstance(g, dict) for g in doc):
        raise UserError(f"{where}: expected a non-empty YAML list of mappings (one per probe group), e.g. "
                        f"- {{hf-config: config.json, strategy: all}}")
    defaults = {k: v for k, v in given.items() if k != "probe_cmd"}
    out = []
    for i, group in enumerate(doc, 1):
        argv = []
        for key, value in group.items():
            key = str(key)
            flag = key.replace("_", "-")
            if flag in SESSION_OPTIONS:
                raise UserError(f"{where}: group {i}: {flag!r} is set for the whole session, on the command "
                                f"line, not in a group")
            if isinstance(value, bool):
                if value:
                    argv.append(f"--{flag}")
                continue
            if value is None:
                continue
            argv += [f"--{flag}", ",".join(map(str, value)) if isinstance(value, list) else str(value)]
        try:
            sub = validate_command.make_context("validate", argv, parent=ctx)
        except click.UsageError as e:
            raise UserError(f"{where}: group {i}: {_one_line(e).format_message()}")
        flags = {o.lstrip("-"): param.name for param in validate_command.params for o in param.opts}
        named = {flags[str(k).replace("_", "-")] for k in group}
        p = {k: (sub.params[k] if k in named else defaults.get(k)) for k in GROUP_OPTIONS}
        p["probe_cmd"] = given["probe_cmd"]
        try:
            out.append(_build(p, get_hw))
        except click.UsageError as e:
            raise UserError(f"{where}: group {i}: {_one_line(e).format_message()}")
    return out


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

def _module_spec(factory, input_shape, matrix: bool, user_model: bool, given: dict) -> dict:
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
        check_factory(factory, shape, os.getcwd())
    except ValueError as e:
        raise click.UsageError(str(e).splitlines()[0])
    return {"factory": factory, "input_shape": list(shape), "path": os.getcwd()}


def _hf_spec(hf_config, layers, micro_batch, seq_len, other_overrides: dict, model, params) -> dict:
    """The probe spec's "module" object for --hf-config with the trace front end: the transformers model
    itself (planner/workload/traced_model.py), at --layers depth when given."""
    if model is not None or params is not None:
        raise click.UsageError("--hf-config and --model/--params: give only one model")
    given = [f"--{k.replace('_', '-')}" for k, v in other_overrides.items() if v is not None]
    if given:
        raise click.UsageError(f"{', '.join(given)} with --hf-config and the trace front end: only --layers "
                               f"applies (edit the config.json, or use --front-end analytic)")
    try:
        check_hf_config(hf_config, seq_len)
    except ValueError as e:
        flag = "--seq-len" if str(e).startswith("--seq-len") else "--hf-config"
        raise click.BadParameter(str(e).split(": ", 1)[-1], param_hint=f"'{flag}'")
    return {"hf_config": hf_path(hf_config), "micro_batch": micro_batch, "seq_len": seq_len, "layers": layers}


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
    """A user-given model must fit this machine: the predicted peak per rank, or the whole model in fp32
    while it is built if that is more (`runner._full_param_bytes`: every probe builds its model whole
    before wrapping shards it; a 7B model is 29 GB then and 0.5 GB per rank of 64 after `fully_shard`),
    x local ranks <= half the free RAM (CPU ranks, fake rank 0) or <= the GPU's memory (GPU ranks)."""
    flag = next((f"--{k.replace('_', '-')}={v}" for k, v in flags.items() if v is not None), "the model")
    for spec in specs:
        try:
            peak = int(predict_probe(spec)["memory"]["peak_allocated"])
        except Exception:
            if spec.get("module"):  # a traced model that cannot be predicted: the probe's record says why
                continue
            n = _param_count(spec["model"])
            peak = 16 * n  # fp32 params + grads + Adam's two states, unsharded
        if spec["mode"] == "gpu" or (spec["mode"] == "fake" and hw.get("gpus")):
            cap = min(hw.get("gpu_memory_bytes") or [0])
            local = 1
            where = f"one {hw.get('gpu_names', ['GPU'])[0]} ({fmt_bytes(cap)})"
        else:
            ram = hw.get("ram_bytes")
            if not ram:
                continue
            cap = int(RAM_FRACTION * ram)
            local = 1 if spec["mode"] == "fake" else max(1, spec["world_size"] // max(1, nnodes))
            where = f"half the free RAM ({fmt_bytes(cap)}) across {local} local rank{'s' if local > 1 else ''}"
        built = _full_param_bytes(spec)
        what = ""
        if built > peak:
            peak, what = built, " (the whole model in fp32 while it is built, before it is wrapped)"
        if cap and peak * local > cap:
            raise click.UsageError(
                f"{flag}: probe {spec['id']} needs about {fmt_bytes(peak)} per rank{what}, more than {where}; "
                + (hint or "validate a smaller model (e.g. --params 20M, or --layers/--hidden)")
                + " and let `distplan estimate` extrapolate")


def _param_count(model: dict) -> int:

    fields = set(ModelSpec.__dataclass_fields__)
    return ModelSpec(**{k: v for k, v in model.items() if k in fields}).param_count()


# -- output ------------------------------------------------------------------------------------------

class _Progress:
    """One updating line on a terminal; one line per finished probe otherwise."""

    def __init__(self, total: int, stream):
        self.total, self.stream, self.done, self.running = total, stream, 0, []
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self._width = 0

    def event(self, kind, index, spec, record):
        if kind == "start":
            self.running.append(spec["id"])
        elif kind in ("done", "skip"):
            self.done += 1
            if spec["id"] in self.running:
                self.running.remove(spec["id"])
            line = (f"[{self.done}/{self.total}] {spec['id']}: "
                    + ("resumed " if kind == "skip" else "")
                    + f"{record.get('status')} {record.get('verdict')}"
                    + (f" ({record['measurement'].get('wall_s'):.1f} s)" if kind == "done"
                       and record["measurement"].get("wall_s") is not None else ""))
            if self.tty:
                self._write("\r" + " " * self._width + "\r" + line + "\n")
                self._width = 0
            else:
                self._write(line + "\n")
        if self.tty and self.running:
            bar_n = 20 * self.done // max(1, self.total)
            line = f"[{'#' * bar_n}{'.' * (20 - bar_n)}] {self.done}/{self.total} running {', '.join(self.running)}"
            line = line[:150]
            self._write("\r" + line + " " * max(0, self._width - len(line)))
            self._width = len(line)

    def clear(self):
        if self.tty and self._width:
            self._write("\r" + " " * self._width + "\r")
            self._width = 0

    def _write(self, s):
        self.stream.write(s)
        self.stream.flush()


def _pct(e) -> str:
    return "n/a" if e is None else f"{e * 100:+.1f}%"


def _b(n) -> str:
    return "-" if n is None else fmt_bytes(n)


def _row(rec: dict) -> list:
    spec, cmp = rec.get("inputs") or {}, rec.get("comparison") or {}
    peak = cmp.get("peak") or {}
    pred_peak = peak.get("predicted", ((rec.get("prediction") or {}).get("memory") or {}).get("peak_allocated"))
    meas_peak = peak.get("measured", ((rec.get("measurement") or {}).get("memory") or {}).get("peak_allocated"))
    worst = cmp.get("worst_component")
    worst_s = _worst_cell(cmp) if worst else "-"
    coll = cmp.get("collectives")
    coll_s = "-" if not coll or coll.get("exact") is None else ("exact" if coll["exact"] else "DIFF")
    status = rec.get("status")
    if status == "oom":
        meas_s = "OOM"
    else:
        meas_s = _b(meas_peak) if status == "ok" else status
    world = f"{spec.get('world_size')}" + (" fake" if spec.get("mode") == "fake" else "")
    return [spec.get("strategy"), (spec.get("model") or {}).get("name"), world,
            (spec.get("train") or {}).get("checkpointing"), (spec.get("train") or {}).get("precision"),
            _b(pred_peak), meas_s, _pct(peak.get("error")), worst_s, coll_s,
            rec.get("verdict") + (" (resumed)" if rec.get("resumed") else "")]


def _worst_cell(cmp: dict) -> str:
    """`grads -40.7% (-176.00 KiB; with temporaries within 10%)`: the component whose ratio is worst,
    and, when that ratio is beyond the component tolerance, the bytes and the rule that judged it."""

    name = cmp.get("worst_component")
    cell = (cmp.get("components") or {}).get(name) or {}
    err, diff = cell.get("error"), cell.get("abs_error_bytes")
    out = f"{name} {_pct(err)}"
    ctol = cmp.get("component_tolerance") or 0.1
    floor = cmp.get("abs_floor_bytes") or ABS_FLOOR_BYTES
    floor_s = f"{floor // 1024} KiB" if floor % 1024 == 0 else fmt_bytes(floor)
    if diff is None or (err is not None and abs(err) <= ctol):
        return out
    signed = ("-" if diff < 0 else "+") + fmt_bytes(abs(diff))
    if cell.get("judged_with"):
        other = [c for c in cell["judged_with"].split("+") if c != name]
        return f"{out} ({signed}; with {', '.join(other)} within {ctol:.0%})"
    if abs(diff) <= floor:
        return f"{out} ({signed}, under the {floor_s} floor)"
    return f"{out} ({signed}, beyond {ctol:.0%} and the {floor_s} floor)"


def render_table(records: list[dict]) -> str:

    headers = ["strategy", "model", "world", "ckpt", "precision", "pred peak", "meas peak", "error",
               "worst component", "collectives", "verdict"]
    return tabulate([_row(r) for r in records], headers=headers, disable_numparse=True)


def render_why(records: list[dict]) -> str:
    """Below the table, in full: why each probe that did not PASS got its verdict."""
    lines = []
    for r in records:
        if r.get("verdict") == "PASS":
            continue
        reasons = (r.get("comparison") or {}).get("reasons") or ["no reason recorded"]
        lines.append(f"{r.get('verdict')} {r.get('id')}:")
        lines += [f"  - {x}" for x in reasons]
    return ("\nwhy\n" + "\n".join(lines)) if lines else ""


FAIL_MEANS = ("FAIL means the planner's prediction and this machine's measurement disagree beyond the rule "
              "(peak off by more than {tol:.0%}, a component by more than {ctol:.0%} and the 64 KiB floor, or "
              "collective calls that differ), or the probe did not finish (crashed, timed out, raised, "
              "out of memory where the prediction said it fits); the reasons are listed under 'why'.")


def describe_model(m: dict, default: bool = False) -> str | None:
    """One line saying what a reference-decoder model is: layers, width, heads, vocabulary, parameters."""
    try:
        n = _param_count(m)
    except Exception:  # noqa: BLE001 - a description, never an error
        return None
    kv = f" ({m['kv_heads']} KV)" if m.get("kv_heads") and m.get("kv_heads") != m.get("heads") else ""
    what = "the default probe model: " if default else ""
    return (f"{m.get('name')}: {what}a Llama-style decoder, {m.get('layers')} layers, hidden {m.get('hidden')}, "
            f"{m.get('heads')} heads{kv}, FFN {m.get('ffn_hidden')}, vocab {m.get('vocab')}, "
            f"{_count(n)} parameters")


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def render_detail(rec: dict) -> str:
    """Per-component predicted vs measured, and the collective table, for one probe."""

    cmp = rec.get("comparison") or {}
    out = []
    comps = cmp.get("components") or {}
    if comps:
        rows = []
        for name in COMPONENTS:
            c = comps.get(name) or {}
            ok = "unmeasured" if c.get("unmeasured") else ("ok" if c.get("ok") else "OUT")
            rows.append([name, _b(c.get("predicted")), _b(c.get("measured")), _pct(c.get("error")),
                         _b(c.get("abs_error_bytes")), ok])
        p = cmp.get("peak") or {}
        rows.append(["peak_allocated", _b(p.get("predicted")), _b(p.get("measured")), _pct(p.get("error")),
                     _b(p.get("abs_error_bytes")),
                     f"{'ok' if p.get('ok') else 'OUT'} ({p.get('predicted_phase')} / {p.get('measured_phase')})"])
        out.append("\nmemory (bytes on the most loaded rank)")
        out.append(tabulate(rows, headers=["component", "predicted", "measured", "error", "abs diff", "judged"],
                            disable_numparse=True))
    coll = cmp.get("collectives") or {}
    if coll.get("rows"):
        rows = [[r["op"], r["group_size"], r["dtype"], _b(r["message_bytes"]), r["predicted_calls"],
                 r["measured_calls"], "yes" if r["match"] else "NO"] for r in coll["rows"]]
        out.append("\ncollectives per probe run (matched by op, group, dtype, message bytes)")
        out.append(tabulate(rows, headers=["op", "group", "dtype", "message", "predicted calls",
                                           "counted calls", "match"], disable_numparse=True))
    st = cmp.get("step_time") or {}
    if st.get("measured") is not None or st.get("predicted") is not None:
        pred = (f"predicted {fmt_seconds(st['predicted'])}" if st.get("predicted") is not None
                else "not predicted off the GPU")
        meas = f"measured {fmt_seconds(st['measured'])}" if st.get("measured") is not None else "not measured"
        err = f", error {_pct(st['error'])}" if st.get("error") is not None else ""
        if st.get("judged"):
            why = f"judged: within {st.get('tolerance', 0.15):.0%} for a GPU-bound step"
        elif st.get("shared_gpu"):
            why = "reported, not judged: other probes ran on the GPU beside it (--jobs > 1)"
        elif st.get("bound") == "host":
            why = "reported, not judged: predicted host-bound, the time is the host issuing eager ops"
        else:
            why = "reported, not judged: time is judged on a GPU only"
        out.append(f"\nstep time: {pred}, {meas}{err} ({why})")
    if cmp.get("reasons") and rec.get("verdict") == "PASS":  # notes; a FAIL's reasons are under 'why'
        out.append("\n" + "\n".join(f"  - {r}" for r in cmp["reasons"]))
    return "\n".join(out)


def summarize(records: list[dict]) -> dict:
    """Per strategy: probes, passes, and median/max |error| of the peak and each component."""
    by: dict[str, list[dict]] = {}
    for r in records:
        by.setdefault((r.get("inputs") or {}).get("strategy"), []).append(r)
    out = {}
    for strategy, recs in by.items():
        row = {"probes": len(recs), "pass": sum(r.get("verdict") == "PASS" for r in recs)}
        for name in ("peak",) + COMPONENTS:
            errs = []
            for r in recs:
                cmp = r.get("comparison") or {}
                cell = cmp.get("peak") if name == "peak" else (cmp.get("components") or {}).get(name)
                if cell and cell.get("error") is not None:
                    errs.append(abs(cell["error"]))
            row[name] = ({"median_abs_error": statistics.median(errs), "max_abs_error": max(errs)}
                         if errs else None)
        out[strategy] = row
    return out


def render_summary(records: list[dict]) -> str:

    rows = []
    for strategy, row in summarize(records).items():
        cells = []
        for name in ("peak",) + COMPONENTS:
            s = row[name]
            cells.append("-" if s is None else
                         f"{s['median_abs_error'] * 100:.1f} / {s['max_abs_error'] * 100:.1f}")
        rows.append([strategy, f"{row['pass']}/{row['probes']}"] + cells)
    return ("\nsummary: median / max |error| in % per strategy\n"
            + tabulate(rows, headers=["strategy", "pass", "peak", *COMPONENTS], disable_numparse=True))
