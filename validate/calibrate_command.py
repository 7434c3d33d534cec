"""`distplan calibrate`: measure this GPU (or the CPU, to test the pipeline) and write a catalog overlay.

The measurements live in `calibrate.py`; this module owns the command's options and its output. The
`distplan` command finds it through the package's entry points (group `distplan.commands`).
"""

from __future__ import annotations

import math
import os
import sys

import click

from distplan.planner.cli import _fail_on_value_error, dump_json



def _calibrate_peak(ctx, param, value):
    if value is not None and not (math.isfinite(value) and 1e-3 <= value <= 1e6):
        raise click.BadParameter(f"{value:g}: accepted: a dense bf16 peak in TFLOP/s, 0.001 to 1,000,000")
    return value


def _calibrate_out(ctx, param, value):
    if not str(value).strip() or os.path.exists(value) and not os.path.isdir(value):
        raise click.BadParameter(f"{str(value)[:60]!r} is not a directory; accepted: a directory (created if missing)")
    return value


@click.command("calibrate")
@click.option("--out", "out_dir", default="distplan-calibration", show_default=True, metavar="DIR",
              callback=_calibrate_out, help="Overlay directory written (gpus/, interconnects/): use it with "
              "--catalog DIR or $DISTPLAN_CATALOG.")
@click.option("--quick", is_flag=True, help="Fewer shapes and sizes: well under a minute.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cpu measures the CPU, to test the pipeline (an overlay only with --peak-tflops).")
@click.option("--peak-tflops", type=float, metavar="X", callback=_calibrate_peak,
              help="Dense bf16 peak, TFLOP/s: needed for a GPU not in the catalog and for --device cpu; "
                   "for a catalog GPU it replaces the catalog's.")
@click.option("--json", "as_json", is_flag=True, help="Print the measurements and fits as JSON.")
@_fail_on_value_error
def calibrate_command(out_dir, quick, device, peak_tflops, as_json):
    """Measure this GPU (matmul, memory, attention, launches; NCCL with 2+ GPUs); write a catalog overlay."""
    # the measuring modules import torch (the reference step's decoder): `distplan --help` lists this command
    # without them
    from .calibrate import TextProgress, calibrate as measure, render, write_overlay

    result = measure(device, quick=quick, peak_tflops=peak_tflops, progress=TextProgress(sys.stderr))
    written = []
    if device == "cuda" or peak_tflops is not None:
        written = write_overlay(out_dir, result)
    result["overlay"] = {"dir": out_dir if written else None, "files": written}
    click.echo(dump_json(result) if as_json else render(result, written, out_dir))
