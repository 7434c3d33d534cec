"""`distplan validate`: run real probes and compare them with the planner's prediction.

Owns the command's options, the header that says where probes run and the exit code (0 all PASS, 1 any
FAIL, 130 on Ctrl-C); its checks of user input (exit 2, one line naming the flag) and the probe specs are
`probe_specs`', the progress line and the tables `render`'s. The work itself lives in the rest of `distplan.validate` (runner, matrix, results, compare), none of
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
import sys

import click
from tabulate import tabulate

from distplan.planner.api import predict_probe
from distplan.planner.cli import INT, UserError
from distplan.planner.cli import _hub_config as _estimate_hub_config
from distplan.planner.config import ATTENTION, CHECKPOINTING, GRAD_SYNC, OFFLOAD
from distplan.planner.precision import OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS
from distplan.planner.strategies import NAMES, get_strategy
from distplan.catalog.yaml_guard import Refused, read_yaml
from distplan.planner.units import LIMITS, fmt_bytes, short_repr
from distplan.planner.workload.limits import user_code_limits

from . import runner
from .compare import rule_text
from .matrix import KNOWN_GAPS
from .probe_specs import _build
from .render import FAIL_MEANS, _Progress, render_detail, render_summary, render_table, render_why, summarize
from .results import ResultsFile, ResultsWriteError, check_results_path
from .runner import MAX_FAKE_WORLD

MODEL_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab")


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
    """A positive integer, within the planner's bound where it has one (`units.LIMITS`: --seq-len,
    --micro-batch, --layers, ...); whether the probe fits this machine is `probe_specs._check_fits`'s."""
    if value is not None and value < 1:
        raise click.BadParameter(f"{value} must be a positive integer (>= 1)")
    bound = LIMITS.get(param.name) if value is not None else None
    if bound and value > bound[1]:
        raise UserError(f"{param.opts[0]}={value}: accepted: an integer from {bound[0]:,} to {bound[1]:,} "
                        f"({bound[2]})")
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
@click.option("--layers", type=INT, default=None, callback=_positive_int)
@click.option("--hidden", type=INT, default=None, callback=_positive_int)
@click.option("--heads", type=INT, default=None, callback=_positive_int)
@click.option("--kv-heads", type=INT, default=None, callback=_positive_int)
@click.option("--ffn-hidden", type=INT, default=None, callback=_positive_int)
@click.option("--vocab", type=INT, default=None, callback=_positive_int)
@click.option("--seq-len", type=INT, default=None, callback=_positive_int, help="Default 64 on CPU, 256 on GPU.")
@click.option("--micro-batch", type=INT, default=2, show_default=True, callback=_positive_int)
@click.option("--grad-accum", type=INT, default=1, show_default=True, callback=_positive_int)
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
@click.option("--tp", type=INT, default=1, show_default=True, callback=_positive_int,
              help="Tensor-parallel degree: the reference decoder split with torchtitan's Llama plan (with "
                   "--hf-config: the transformers model with torchtitan's plan for transformers models, predicted "
                   "by the analytic front end) over a (world / tp, tp) mesh; strategies single (tp ranks), "
                   "zero2, zero3 (FSDP2 on the dp dimension). Default strategies with --tp: those three.")
@click.option("--sequence-parallel", "sequence_parallel", is_flag=True, default=False,
              help="With --tp: sequence parallelism (torchtitan's default).")
@click.option("--cp", type=INT, default=1, show_default=True, callback=_positive_int,
              help="Context-parallel degree: the reference decoder with ring attention (torch's "
                   "_templated_ring_attention) over a (world / (cp x tp), cp, tp) mesh, the strategy over the "
                   "dp x cp ranks; CPU probes only (gloo or the fake process group).")
@click.option("--pp", type=INT, default=1, show_default=True, callback=_positive_int,
              help="Pipeline stages: the reference decoder split evenly and run by torch.distributed.pipelining "
                   "(gloo, one process per stage; with a data-parallel strategy, 2 replicas per stage); "
                   "strategies single, ddp, zero1, zero2, zero3.")
@click.option("--pp-schedule", "pp_schedule", type=click.Choice(("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb",
                                                                  "zbv")),
              default="1f1b", show_default=True,
              help="With --pp: the schedule the probe runs (interleaved and zero-bubble ones: 2 stages per rank; "
                   "DDP and ZeRO-1 run under 1f1b only; the zero-bubble ones without checkpointing).")
@click.option("--pp-microbatches", "pp_microbatches", type=INT, default=None, callback=_positive_int,
              help="With --pp: micro-batches per step (default 2 x --pp).")
@click.option("--matrix", is_flag=True, help="Run the standard matrix (all strategies x 3 shapes x 2 world sizes "
              "x checkpointing x precision) instead of one probe per strategy.")
@click.option("--simulate-world-size", type=INT, default=None, callback=_fake_world, metavar="N",
              help="Run as rank 0 of N ranks (at most 4096) on the fake process group (collectives counted, "
                   "not executed). The default where this machine has fewer than 2 GPUs (or --nproc 1): "
                   "rank 0 of 8.")
@click.option("--nproc", type=INT, default=None, callback=_positive_int,
              help="Processes per node (default: the GPUs here, or 2 gloo ranks on CPU).")
@click.option("--nnodes", type=INT, default=1, show_default=True, callback=_positive_int)
@click.option("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="Rendezvous endpoint for --nnodes > 1.")
@click.option("--tolerance", type=float, default=5.0, show_default=True, callback=_tolerance,
              help="Allowed |peak error| in percent (components: twice this, or 64 KiB).")
@click.option("--out", "out_path", default="distplan-results.jsonl", show_default=True,
              type=click.Path(dir_okay=False), help="JSON-lines file; one record appended per probe.")
@click.option("--resume", is_flag=True, help="Skip probes whose id (same inputs) already has a final record in --out.")
@click.option("--timeout", "timeout_s", type=float, default=300.0, show_default=True, callback=_timeout,
              help="Seconds per probe before its process group is killed.")
@click.option("--steps", type=INT, default=3, show_default=True, callback=_positive_int,
              help="Training steps per probe (after one warm-up step).")
@click.option("--jobs", type=INT, default=None, callback=_positive_int,
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
    given["timeout_s"] = timeout_s  # the session's: user code run before any probe gets it too
    # --module's code outside the probes (the check, the predictions): in a child under the session's
    # --timeout and a memory cap (planner/workload/isolated.py), until the command ends
    ctx.with_resource(user_code_limits(timeout_s))
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
    header = _session_header(plan_path, groups, specs, modes, hw, tol, out_path, resume)
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
    except ResultsWriteError as e:  # disk full: the records before it are on disk, the probes stopped
        progress.clear()
        raise click.ClickException(str(e)) from None
    except (KeyboardInterrupt, runner.Terminated) as e:
        progress.clear()
        what = "terminated" if isinstance(e, runner.Terminated) else "interrupted"
        click.echo(f"{what}: {results.appended} probe{'s' if results.appended != 1 else ''} saved to "
                   f"{out_path}; run again with --resume to continue", file=err)
        ctx.exit(128 + e.signum if isinstance(e, runner.Terminated) else 130)
    finally:
        restore()
    progress.clear()

    failed = [r for r in records if r.get("verdict") not in ("PASS", "KNOWN", "SKIP")]
    _report(records, failed, as_json, out_path, tol, modes, hw, matrix)
    ctx.exit(1 if failed else 0)


def _session_header(plan_path, groups: list, specs: list, modes: list, hw: dict, tol: float, out_path: str,
                    resume: bool) -> list:
    """The lines that say what runs, on what model, where, by which rule, and where the records go."""
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
                               any(s["world_size"] > 1 for s in g["specs"])))
    header += [f"  {n}" for n in notes]
    header += ["  " + runner.describe_mode(m, w, hw) for m, w in modes]
    header.append(f"  {rule_text(tol)}")
    known = [s["id"] for s in specs if s.get("id") in KNOWN_GAPS]
    if known:
        header.append(f"  known gaps (KNOWN, not failures): " + "; ".join(
            f"{i} ({', '.join(KNOWN_GAPS[i])})" for i in known))
    header.append(f"  results -> {out_path}" + (" (resume)" if resume else ""))
    return header


def _report(records: list, failed: list, as_json: bool, out_path: str, tol: float, modes: list, hw: dict,
            matrix: bool) -> None:
    """The session's results: the JSON report, or the table, why probes failed, one probe's detail, the
    summary and the count of PASS / SKIP / FAIL."""
    if as_json:
        report = {"out": out_path, "tolerance": tol, "rule": rule_text(tol),
                  "where": [runner.describe_mode(m, w, hw) for m, w in modes],
                  "probes": records, "summary": summarize(records) if len(records) > 1 else None,
                  "passed": sum(r.get("verdict") == "PASS" for r in records), "failed": len(failed),
                  "known": sum(r.get("verdict") == "KNOWN" for r in records),
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
        known = sum(r.get("verdict") == "KNOWN" for r in records)
        if failed:
            click.echo("\n" + FAIL_MEANS.format(tol=tol, ctol=2 * tol))
        click.echo(f"{len(records) - len(failed) - skipped - known}/{len(records)} PASS"
                   + (f"; {known} KNOWN (gaps listed under 'why', not failures)" if known else "")
                   + (f"; {skipped} SKIP (rank 0 on another node)" if skipped else "")
                   + (f"; {len(failed)} FAIL" if failed else "") + f"; records in {out_path}")


GROUP_OPTIONS = (
    "strategies", "model", "params", "hf_config", "front_end", "module_factory", "input_shape", "layers",
    "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len", "micro_batch", "grad_accum", "grad_sync",
    "precision", "optimizer", "optimizer_impl", "checkpointing", "attention", "cpu_offload", "alloc_conf",
    "init", "tp", "sequence_parallel", "cp", "pp", "pp_schedule", "pp_microbatches", "matrix", "simulate_world_size",
    "nproc", "nnodes", "steps", "probe_cmd")
"""The command's parameters that describe probes, what `_build` reads (the rest are the session's: --out,
--resume, --jobs, --timeout, --tolerance, --json, --plan, --dry-run); a --plan group sets any of them but
the session's --nnodes and the tests' --probe-cmd (SESSION_OPTIONS)."""


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


PLAN_ACCEPTED = ("a non-empty YAML list of mappings (one per probe group), e.g. "
                 "- {hf-config: config.json, strategy: all}")

SESSION_OPTIONS = ("out", "resume", "jobs", "timeout", "tolerance", "json", "plan", "dry-run", "nnodes",
                   "rdzv-endpoint", "probe-cmd")
"""Options a --plan group may not set: they belong to the whole session (one results file, one scheduler)."""


def _plan_groups(ctx, plan_path: str, given: dict, get_hw) -> list[dict]:
    """Every group of a --plan file built into probe specs (`_build`), before any probe runs. A group is
    a mapping of the command's long option names (without the dashes) to values: a list joins with
    commas (strategy), true sets a flag; the options given on the command line apply where a group is
    silent. Errors are one line naming the file, the group (from 1) and the option."""


    where = f"--plan={short_repr(plan_path, 240)}"
    try:  # the catalog's guards: size cap, no anchors or aliases (a 337-byte bomb), bounded nesting
        doc = read_yaml(plan_path, what="a plan file: a YAML list of probe groups", accepted=PLAN_ACCEPTED)
    except Refused as e:
        raise UserError(f"{where}: {e}") from None
    if not isinstance(doc, list) or not doc or not all(isinstance(g, dict) for g in doc):
        raise UserError(f"{where}: expected {PLAN_ACCEPTED}")
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
        p["timeout_s"] = given.get("timeout_s")
        try:
            out.append(_build(p, get_hw))
        except click.UsageError as e:
            raise UserError(f"{where}: group {i}: {_one_line(e).format_message()}")
    return out
