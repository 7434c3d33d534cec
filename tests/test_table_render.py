"""report.table draws tabulate's "simple" format itself (a cold `distplan estimate` does not import
tabulate): held to the byte against tabulate, on random cells and on every table the CLI prints."""

import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tabulate import tabulate

from distplan.planner import report
from distplan.planner.api import plan


def tab(rows, headers, fmt="simple"):
    return tabulate(rows, headers, tablefmt=fmt, disable_numparse=True)


# printable ASCII, spaces at either end included (tabulate strips cells, not headers), ints, and what
# must fall back to tabulate: newlines, tabs, ANSI colours, wide characters, None, floats
plain = st.one_of(st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=12),
                  st.integers(-10**6, 10**6))
hostile = st.one_of(plain, st.sampled_from(["a\nb", "x\ty", "\x1b[31m7\x1b[0m", "东京", "", " ", "\x01", None,
                                            1.5, True, "True", "1e3", "-"]))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6).flatmap(lambda n: st.tuples(
    st.lists(st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=10), min_size=n, max_size=n),
    st.lists(st.lists(hostile, min_size=n, max_size=n), max_size=6))))
def test_table_is_tabulate(case):
    headers, rows = case
    assert report.table(rows, headers) == tab(rows, headers)


@pytest.mark.parametrize("fmt", ["github", "grid", "plain", "pipe", "rst", "psql", "fancy_grid", "tsv"])
def test_other_formats_are_tabulate(fmt):
    rows = [["ddp", "1.00", "yes"], ["fsdp-no-shard", "-", "NO"]]
    assert report.table(rows, ["strategy", "peak", "fits"], fmt) == tab(rows, ["strategy", "peak", "fits"], fmt)


def test_plan_tables_are_tabulate(monkeypatch):
    """The estimate's and the layout search's tables, whole and split to fit 60 columns."""
    drawn = []
    real = report.table

    def both(rows, headers, table_format="simple"):
        out = real(rows, headers, table_format)
        assert out == tab(rows, headers, table_format)
        drawn.append(out)
        return out

    monkeypatch.setattr(report, "table", both)
    p = plan(params="7B", gpus=8, gpu_mem=80, tokens=2e12)
    report.render_estimate(p)
    for width in (60, 100):
        monkeypatch.setenv("COLUMNS", str(width))
        report.render_estimate(p)
    assert len(drawn) > 6


def test_random_widths_split_alike(monkeypatch):
    rnd = random.Random(0)
    rows = [[f"s{i}"] + ["x" * rnd.randint(0, 9) for _ in range(7)] for i in range(5)]
    headers = ["strategy"] + [f"h{j}" * rnd.randint(1, 3) for j in range(7)]
    for width in range(40, 90, 7):
        got = report.fit_table("t", headers, rows, width=width)
        monkeypatch.setattr(report, "table", lambda r, h, f="simple": tab(r, h, f))
        assert got == report.fit_table("t", headers, rows, width=width)
        monkeypatch.undo()


def test_cold_estimate_imports_only_what_it_prints():
    """A cold `distplan estimate` imports neither tabulate (its tables are report.table's) nor validate.command
    (an entry-point command, cli.OneLineErrors): 20-30 ms of start-up on the 2-core VM. (json, 2 ms, comes with
    the Hugging Face config reader, hf_config.py, which the flag checks import at their top.)"""
    code = ("import sys\nfrom distplan.planner.cli import main\ntry:\n"
            "    main(['estimate', '--params', '7B', '--gpus', '8', '--gpu-mem', '80'])\n"
            "except SystemExit:\n    pass\n"
            "print(sorted(m for m in ('tabulate', 'distplan.validate.command') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-300:]


def test_validate_is_listed_and_runs_though_imported_lazily():
    from click.testing import CliRunner

    from distplan.planner.cli import main
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0 and "  validate " in r.output, r.output
    r = CliRunner().invoke(main, ["validate", "--help"])
    assert r.exit_code == 0 and "torchrun" in r.output, r.output
