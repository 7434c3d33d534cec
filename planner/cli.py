"""The `distplan` command line: estimate, recommend, sweep, catalog, validate.

Pure Python at import (click; tabulate only for the table formats report.table does not draw itself,
`validate` and `calibrate` come from distplan.validate through entry points, loaded only when asked
for); torch is imported only by `validate`, `calibrate` and `--module`, inside the command. Every user
error is one line naming the flag, the value and what is accepted, exit code 2.
"""

from __future__ import annotations

import functools
import math
import re
import sys

import click

from distplan.catalog.loader import load_catalog

from .allocator import parse_alloc_conf
from .chart import check_chart_path, write_chart
from .config import (ATTENTION, ATTENTION_KERNELS, CHECKPOINTING, CHECKPOINT_MODES, DEFAULT_STORAGE_GBPS, FRAMEWORKS,
                     GRAD_SYNC, OFFLOAD, PP_SCHEDULES)
from .front_end import DEVICES, FRONT_ENDS, use_trace  # noqa: F401  (validate imports it from here)
from .hf_config import resolve_hf_config
from .from_flags import build_plan
from .precision import OPTIMIZERS, OPTIMIZER_IMPLS, PRECISIONS
from .recommend import render_recommendation
from .report import render_estimate
from .strategies import NAMES
from .ranking import HEADROOM_FRACTION
from .sweep import render_sweep, run_sweep
from .units import LIMITS, fmt_bytes, parse_count, parse_headroom
from .workload.limits import DEFAULT_TIMEOUT_S

TABLE_FORMATS = ("simple", "github", "grid", "plain", "pipe", "rst", "psql", "fancy_grid", "tsv")


class UserError(click.UsageError):
    """A one-line error with exit code 2 and no usage banner."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"Error: {self.format_message()}", err=True, file=file)


class _Int(click.ParamType):
    """An integer option: a value that is not an integer (`--gpus 1e9`, `--seq-len 2k`) is refused as an
    out-of-range one is, naming the flag, the value and the accepted range (`units.LIMITS`)."""

    name = "integer"

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return int(value)
        except (TypeError, ValueError):
            pass
        key = param.name if param is not None else ""
        flag = next((o for o in getattr(param, "opts", ()) if o.startswith("--")), f"--{key}")
        lo_hi = LIMITS.get(key)
        accepted = (f"an integer from {lo_hi[0]:,} to {lo_hi[1]:,} ({lo_hi[2]})" if lo_hi else "an integer")
        text = str(value)
        shown = f"'{text[:60]}...'" if len(text) > 63 else repr(text)  # as click's quoted values are cut
        raise UserError(f"{flag}={shown}: accepted: {accepted}")


INT = _Int()


def _fail_on_value_error(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as exc:
            raise UserError(str(exc).splitlines()[0]) from None
    return wrapper


def _hub_config(ctx, param, value):
    """--hf-config: a Hub id that names no local file becomes its cached config.json (hf_config.py)."""
    if value is None:
        return None
    try:
        return resolve_hf_config(value)
    except ValueError as exc:
        raise UserError(str(exc).splitlines()[0]) from None


def _env_alloc_conf(ctx, param, value):
    """PYTORCH_CUDA_ALLOC_CONF read from the environment is checked here, so that an error names the
    variable, not --alloc-conf, which was not given."""
    if value and ctx.get_parameter_source(param.name) == click.core.ParameterSource.ENVIRONMENT:
        try:
            parse_alloc_conf(value, "PYTORCH_CUDA_ALLOC_CONF")
        except ValueError as exc:
            raise UserError(f"{str(exc).splitlines()[0]}; it is read from the environment (--alloc-conf "
                            f"overrides it)") from None
    return value


def model_options(fn):
    """--model/--params/--hf-config/--module and the architecture overrides."""
    opts = [
        click.option("--model", "model", metavar="NAME", help="A catalog model (distplan catalog list models)."),
        click.option("--params", metavar="COUNT", help="Parameter count: 7B, 125M, 1.3e9, 350_000_000 (a "
                     "bare count under a million is refused: 7 means 7B). Assumes a Llama-style decoder scaled from the nearest catalog model."),
        click.option("--hf-config", metavar="PATH|ID", callback=_hub_config,
                     help="A Hugging Face config.json (or a folder holding one, or a Hub id such as "
                          "Qwen/Qwen2.5-0.5B[@revision]: its config.json from the Hugging Face cache, downloaded "
                          "if missing): any causal LM with the trace front end; the analytic one reads llama, "
                          "mistral, qwen2, qwen3, phi3, gpt2, gemma2."),
        click.option("--front-end", "front_end", type=click.Choice(FRONT_ENDS), default="auto", show_default=True,
                     help="How --hf-config is planned: 'trace' runs the transformers model on fake tensors "
                          "(needs torch and transformers: pip install 'distplan[hf]'), 'analytic' uses the "
                          "decoder formulas (pure Python, fast); 'auto' traces when both are installed."),
        click.option("--layers", type=INT, help="Override: decoder blocks."),
        click.option("--hidden", type=INT, help="Override: model width."),
        click.option("--heads", type=INT, help="Override: attention heads."),
        click.option("--kv-heads", type=INT, help="Override: key/value heads (GQA)."),
        click.option("--ffn-hidden", type=INT, help="Override: MLP inner width."),
        click.option("--vocab", type=INT, help="Override: vocabulary size."),
        click.option("--tie-embeddings/--no-tie-embeddings", default=None, help="Override: tie LM head to embeddings."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def training_options(fn):
    opts = [
        click.option("--seq-len", type=INT, default=2048, show_default=True, help="Tokens per sequence."),
        click.option("--micro-batch", type=INT, default=1, show_default=True, help="Sequences per GPU per micro-step."),
        click.option("--grad-accum", type=INT, default=1, show_default=True, help="Micro-steps per optimizer step."),
        click.option("--grad-sync", type=click.Choice(GRAD_SYNC), default="last", show_default=True,
                     help="With --grad-accum > 1: reduce gradients on the last micro-step only (no_sync / "
                          "set_requires_gradient_sync(False) before it) or on every micro-step."),
        click.option("--precision", type=click.Choice(PRECISIONS), default="bf16-mixed", show_default=True),
        click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adamw", show_default=True),
        click.option("--optimizer-impl", type=click.Choice(OPTIMIZER_IMPLS), default=None,
                     help="Default: PyTorch's for the target (--device): foreach on cuda, for-loop on cpu."),
        click.option("--activation-checkpointing", type=click.Choice(CHECKPOINTING), default="none", show_default=True),
        click.option("--attention", type=click.Choice(ATTENTION), default="sdpa", show_default=True,
                     help="eager: the (B, heads, S, S) scores materialized (transformers' "
                          "attn_implementation='eager'; Gemma-2 runs it whatever is asked)."),
        click.option("--attention-kernel", type=click.Choice(ATTENTION_KERNELS), default="flash", show_default=True,
                     help="The fused kernel --attention sdpa runs (its time only): flash (FlashAttention-2, "
                          "SDPA's flash backend) or flash-triton (FlashAttention in Triton: llm-foundry's "
                          "attn_impl='triton'). Analytic front end."),
        click.option("--cpu-offload", type=click.Choice(OFFLOAD), default="none", show_default=True,
                     help="Where the strategy supports it (FSDP: params)."),
        click.option("--framework", type=click.Choice(FRAMEWORKS), default="pytorch", show_default=True,
                     help="deepspeed models DeepSpeed's ZeRO-1/2/3 buffers (not validated)."),
        click.option("--compile", "compile_", is_flag=True, default=False,
                     help="The blocks run under torch.compile: fused pointwise kernels in the step time "
                          "(memory is modelled for eager)."),
        click.option("--tp", type=INT, default=1, show_default=True,
                     help="Tensor-parallel degree inside a node (torchtitan's Llama plan); the strategies "
                          "run over gpus / tp data-parallel ranks."),
        click.option("--sequence-parallel", "sequence_parallel", is_flag=True, default=False,
                     help="With --tp: sequence parallelism (norms sharded over the sequence; all-gather + "
                          "reduce-scatter instead of all-reduce)."),
        click.option("--alloc-conf", "alloc_conf", envvar="PYTORCH_CUDA_ALLOC_CONF", default="", metavar="CONF",
                     callback=_env_alloc_conf,
                     help="The run's PYTORCH_CUDA_ALLOC_CONF (default: this shell's), e.g. "
                          "expandable_segments:True: the reserved peak follows it."),
        click.option("--torch-version", "torch_version", default="", metavar="X.Y",
                     help="The PyTorch release the run uses (default: the installed one; 2.15 without "
                          "torch): FSDP2's gradient reduction frees differently from 2.15 on."),
        click.option("--pp", type=INT, default=1, show_default=True,
                     help="Pipeline stages (torch.distributed.pipelining, layers split evenly); the "
                          "strategies run over gpus / (tp x pp) data-parallel ranks."),
        click.option("--pp-schedule", "pp_schedule", type=click.Choice(PP_SCHEDULES), default="1f1b",
                     show_default=True, help="With --pp: the pipeline schedule."),
        click.option("--pp-microbatches", "pp_microbatches", type=INT, default=None,
                     help="With --pp: micro-batches of --micro-batch sequences per step (default 2 x --pp)."),
        click.option("--cp", type=INT, default=1, show_default=True,
                     help="Context-parallel degree: each sequence split over cp ranks, ring attention "
                          "(torchtitan's context_parallel); the strategies run over the dp x cp ranks."),
        click.option("--checkpoint", "checkpoint", type=click.Choice(CHECKPOINT_MODES), default=None,
                     help="Also plan saving a checkpoint (model + optimizer, PyTorch's DCP state-dict API): "
                          "full (gathered on every rank, rank 0 writes), full-offload (gathered to rank 0's "
                          "CPU), sharded (torch.distributed.checkpoint.save); its GPU peak counts in 'fits'."),
        click.option("--storage-gbps", "storage_gbps", type=float, default=None,
                     help=f"With --checkpoint: write bandwidth per writing rank, GB/s (default "
                          f"{DEFAULT_STORAGE_GBPS:g}, an assumed NVMe / file-system client rate)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def cluster_options(fn):
    opts = [
        click.option("--gpus", type=INT, help="Total GPUs (ranks). Default: the local GPUs, else 8."),
        click.option("--gpus-per-node", type=INT, help="Default: the node's, else min(8, gpus)."),
        click.option("--gpu", metavar="NAME", help="A catalog GPU (distplan catalog list gpus)."),
        click.option("--gpu-mem", metavar="SIZE", help="GPU memory, 1 GiB to 4 TiB. A card's size (80, 80GB, "
                     "80G) plans the memory the catalog GPU of that size reports (80: h100-sxm, 79.65 GiB), "
                     "or that many GiB where no catalog GPU has it; an exact budget takes a unit: 74.5GiB, "
                     "81559MiB (with 'i' powers of 2), 8e10B, 80000MB (without, powers of 10)."),
        click.option("--node", metavar="NAME", help="A catalog node type (dgx-h100, aws-p5, ...)."),
        click.option("--intra", metavar="LINK", help="Intra-node link (nvlink4, pcie5, ...)."),
        click.option("--inter", metavar="LINK", help="Inter-node link (ib-ndr, eth-100g-tcp, ...)."),
        click.option("--nics-per-node", type=INT, help="Inter-node NICs per node."),
        click.option("--inter-gbps", type=float, help="Inter-node bandwidth per node, Gbit/s (overrides the NICs)."),
        click.option("--catalog", "catalog_dirs", multiple=True, metavar="DIR",
                     help="Your own YAML catalog layered over ours (also $DISTPLAN_CATALOG)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def headroom_option(fn):
    """--headroom: the margin the recommendation keeps (ranking._headroom_ok), checked before any planning."""
    def check(ctx, param, value):
        try:
            return parse_headroom(value) if value is not None else None
        except ValueError as exc:
            raise UserError(str(exc)) from None
    return click.option("--headroom", metavar="FRACTION|PERCENT", callback=check,
                        help=f"GPU memory the recommendation leaves free: 0.1 or 10% (default "
                             f"{100 * HEADROOM_FRACTION:g}%). Where nothing that fits leaves it, the pick is "
                             f"what fits, with a warning line.")(fn)


def output_options(fn):
    fn = click.option("--format", "table_format", type=click.Choice(TABLE_FORMATS), default="simple",
                      show_default=True, help="Table style (tabulate).")(fn)
    fn = click.option("--json", "as_json", is_flag=True, help="Print the JSON contract instead of tables.")(fn)
    return fn


def _finite(obj):
    """The JSON contract has no Infinity/NaN (not JSON): a non-finite number is null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dump_json(obj) -> str:
    import json  # lazy: only --json prints it

    return json.dumps(_finite(obj), indent=2, allow_nan=False)


def _show_value(v, key: str = "", parent: str = "") -> str:
    """A catalog figure as written, as text: floats without binary noise (3e-05, not 2.9999999999999997e-05),
    sizes and rates also in their unit (the key names it: `_bytes`, `_bytes_per_s`, the `flops` table)."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, list):
        return ", ".join(_show_value(x) for x in v) if v else "-"
    if not isinstance(v, (int, float)) or not v:
        return str(v) if not isinstance(v, float) else f"{v:.6g}"
    text = f"{v:,}" if isinstance(v, int) else f"{v:.6g}"
    if key.endswith("_bytes_per_s"):
        return f"{text} ({v / 1e9:,.4g} GB/s)"
    if key.endswith("_bytes") and v >= 2**10:
        return f"{text} ({fmt_bytes(v)})"
    if parent == "flops":
        return f"{text} ({v / 1e12:,.4g} TFLOP/s)"
    return text


def _show_lines(key: str, value, indent: str = "  ", parent: str = "") -> list[str]:
    """`catalog show`'s lines for one field: a table (dict) as indented lines, a list of long texts (the
    sources) one per line, everything else `key: value`."""
    if isinstance(value, dict):
        return [f"{indent}{key}:"] + [line for k, v in value.items()
                                      for line in _show_lines(k, v, indent + "  ", key)]
    if isinstance(value, list) and any(isinstance(x, str) and len(x) > 60 for x in value):
        return [f"{indent}{key}:"] + [f"{indent}  - {x}" for x in value]
    return [f"{indent}{key}: {_show_value(value, key, parent)}"]


def _check_timeout(value):
    if value is not None and not 0 < value < math.inf:
        raise UserError(f"--timeout={value:g}: accepted: a positive number of seconds")
    return value


def _check_positive(name: str, value) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name}={value}: must be a positive integer")


_QUOTED = re.compile(r"(?<![^\s=(:])'([^']{60})[^']{4,}'(?=[\s.,;:)]|$)")
"""A quoted value: its opening quote after the start, a space, '=', '(' or ':', its closing quote before
the end, a space or punctuation; an apostrophe inside a word ("model's") opens or closes nothing."""


def _cut_quoted(line: str) -> str:
    """click quotes the offending value whole: long ones cut to 60 characters, as our own errors do
    (units.short_repr); the rest of the line is kept whole."""
    return _QUOTED.sub(lambda m: f"'{m.group(1)}...'", line)


class OneLineErrors(click.Group):
    """click's own usage errors (a value that is not an integer, an unknown option, a missing
    argument) as one `Error: ...` line with exit code 2, like ours: no usage banner."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as exc:
            line = (exc.format_message().splitlines() or [""])[0]
            line = _cut_quoted(line)
            click.echo(f"Error: {line}", err=True)
            sys.exit(2)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)

    PLUGIN_GROUP = "distplan.commands"
    """Commands another package of the distribution adds (`validate`, `calibrate`: distplan.validate, which
    needs torch to run), found through its entry points (pyproject.toml, [project.entry-points]) and imported
    only when looked up (run, or listed by --help): the planner never imports `validate`, and a cold
    `distplan estimate` reads no package metadata. click's "Lazily Loading Subcommands" pattern (click
    documentation, Complex Applications) over `importlib.metadata.entry_points`."""

    @functools.cached_property
    def _plugins(self) -> dict:
        from importlib.metadata import entry_points
        return {ep.name: ep for ep in entry_points(group=self.PLUGIN_GROUP)}

    def list_commands(self, ctx) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._plugins})

    def get_command(self, ctx, name: str):
        if name not in self.commands and name in self._plugins:
            try:
                self.add_command(self._plugins[name].load(), name)
            except ImportError:  # pragma: no cover  (then the command is not there, as before)
                return None
        return super().get_command(ctx, name)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="distplan")
def main():
    """distplan: per-GPU memory, communication, step time and strategy for distributed PyTorch
    training, checked against real torchrun probes (`distplan validate`)."""


@main.command()
@model_options
@training_options
@cluster_options
@click.option("--strategy", "strategies", multiple=True, metavar="NAME",
              help=f"Limit to these strategies (repeatable or comma-separated): {', '.join(NAMES)}.")
@click.option("--tokens", type=str, help="Total training tokens (e.g. 2T): adds the time to train.")
@click.option("--plot", "plot_path", metavar="FILE", help="Write the memory chart: FILE.svg (no dependency), "
              "FILE.png or FILE.pdf (matplotlib: pip install 'distplan[plot]').")
@click.option("--module", metavar="PKG.MOD:FACTORY", help="Any nn.Module from a factory (needs torch).")
@click.option("--input-shape", metavar="N,C,H,W", help="Example input shape for --module.")
@click.option("--timeout", "timeout_s", type=float, default=DEFAULT_TIMEOUT_S, show_default=True,
              callback=lambda ctx, param, v: _check_timeout(v),
              help="Seconds --module's code (its import, the factory, the step traced on fake tensors) may run, "
                   "in a child process with a memory cap, before it is killed.")
@click.option("--device", "device", type=click.Choice(DEVICES), default=None,
              help="The target planned: cuda (default: what a catalog GPU runs: CUDA's kernels, autocast lists "
                   "and caching allocator) or cpu (the same step on the CPU, as the CPU probes run it; trace "
                   "front end only).")
@headroom_option
@output_options
@_fail_on_value_error
def estimate(strategies, tokens, plot_path, as_json, table_format, **kw):
    """Per-GPU memory (and communication, step time) of every strategy; which fits; which to use."""
    kw["tokens"] = parse_count(tokens, "--tokens") if tokens is not None else None
    if plot_path is not None:
        check_chart_path(plot_path)
    p = build_plan(kw, strategies)
    if plot_path is not None:
        write_chart(p, plot_path)
    if as_json:
        click.echo(dump_json(p.to_dict()))
    else:
        click.echo(render_estimate(p, table_format))
        if plot_path:
            click.echo(f"chart written to {plot_path}")


@main.command()
@model_options
@training_options
@cluster_options
@click.option("--strategy", "strategies", multiple=True, metavar="NAME",
              help="Consider only these (repeatable or comma-separated).")
@click.option("--tokens", type=str, help="Total training tokens (e.g. 2T): adds the time to train.")
@headroom_option
@output_options
@_fail_on_value_error
def recommend(strategies, tokens, as_json, table_format, **kw):
    """The parallel layout (dp x tp x pp, unless --tp and --pp are given) and strategy that fit with
    headroom and are fastest, the largest micro-batch, and why."""
    from click.core import ParameterSource
    kw["tokens"] = parse_count(tokens, "--tokens") if tokens is not None else None
    ctx = click.get_current_context()
    kw["given"] = {k for k in ("tp", "pp", "sequence_parallel")
                   if ctx.get_parameter_source(k) not in (None, ParameterSource.DEFAULT)}
    # --module models no mesh: nothing to search there; --hf-config is searched on either front end
    # (api.recommend: the analytic one judges every layout, the trace checks the data-parallel one)
    search = not kw.get("module") and not {"tp", "pp"} <= kw["given"]
    p = build_plan(kw, strategies, search=search)
    if as_json:
        click.echo(dump_json(p.to_dict()))
    else:
        click.echo(render_recommendation(p, table_format))


@main.command()
@model_options
@training_options
@cluster_options
@click.option("--strategy", "strategies", multiple=True, metavar="NAME",
              help="Limit to these strategies (repeatable or comma-separated).")
@click.option("--sweep-gpus", "sweep_gpus", metavar="LIST", help="GPU counts, e.g. 8,16,32,64.")
@click.option("--sweep-micro-batch", metavar="LIST", help="Micro-batch sizes, e.g. 1,2,4,8.")
@click.option("--sweep-seq-len", metavar="LIST", help="Sequence lengths, e.g. 2048,4096,8192.")
@click.option("--tokens", type=str, help="Total training tokens (e.g. 2T): adds the time to train.")
@headroom_option
@output_options
@_fail_on_value_error
def sweep(strategies, sweep_gpus, sweep_micro_batch, sweep_seq_len, tokens, as_json, table_format, **kw):
    """A table over GPU counts, micro-batch sizes or sequence lengths, for one or all strategies."""
    kw["tokens"] = parse_count(tokens, "--tokens") if tokens is not None else None
    rows = run_sweep(kw, strategies, sweep_gpus, sweep_micro_batch, sweep_seq_len)
    if as_json:
        click.echo(dump_json(rows))
    else:
        click.echo(render_sweep(rows, table_format))


@main.group()
def catalog():
    """Browse the hardware and model catalog (GPUs, interconnects, nodes, models)."""


@catalog.command("list")
@click.argument("kind", required=False, type=click.Choice(["gpus", "interconnects", "nodes", "models"]))
@click.option("--catalog", "catalog_dirs", multiple=True, metavar="DIR", help="Extra catalog directory.")
@_fail_on_value_error
def catalog_list(kind, catalog_dirs):
    """List catalog entries (all kinds, or one)."""
    cat = load_catalog(tuple(catalog_dirs))
    for k in ([kind] if kind else ["gpus", "interconnects", "nodes", "models"]):
        click.echo(f"{k}: {', '.join(cat.names(k))}")


@catalog.command("show")
@click.argument("name")
@click.option("--catalog", "catalog_dirs", multiple=True, metavar="DIR", help="Extra catalog directory.")
@_fail_on_value_error
def catalog_show(name, catalog_dirs):
    """Show one entry with its figures in base units and its sources."""
    cat = load_catalog(tuple(catalog_dirs))
    entry = cat.entry(name)
    d = entry.to_dict()
    click.echo(f"{cat.kind_of(entry)}: {d.pop('name')}")
    for k, v in d.items():
        if k != "path":
            click.echo("\n".join(_show_lines(k, v)))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
