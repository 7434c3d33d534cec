"""examples/planning.ipynb runs top to bottom: every code cell exec'd in order in one namespace, on CPU,
without a Jupyter kernel (IPython display calls are guarded inside the notebook). The whole notebook,
its `distplan validate` cell (a real torchrun probe) included, is slow; the fast tier runs every other
cell and checks the same plans."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "planning.ipynb"


def _code_cells():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def test_notebook_is_valid_and_outputs_are_clean():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert nb.nbformat == 4
    for c in nb.cells:
        if c.cell_type == "code":
            assert not c.get("outputs"), "commit the notebook without outputs"


def _run_cells(monkeypatch, skip_probe: bool) -> tuple[dict, str]:
    """exec every code cell in order in one namespace; with `skip_probe`, all but the cell that launches
    `distplan validate` (a real torchrun probe). Returns (namespace, everything the cells printed)."""
    monkeypatch.chdir(ROOT)
    ns: dict = {"__name__": "__main__"}
    outputs = []
    for i, src in enumerate(_code_cells()):
        if skip_probe and _launches_probe(src):
            continue
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            try:
                exec(compile(src, f"planning.ipynb[cell {i}]", "exec"), ns)
            except Exception as exc:  # pragma: no cover - shows which cell broke
                raise AssertionError(f"cell {i} failed: {type(exc).__name__}: {exc}\n{src}") from exc
        outputs.append(buf.getvalue())
    text = "\n".join(outputs)
    print(text[-3000:])
    return ns, text


def _launches_probe(src: str) -> bool:
    return '"validate"' in src and "subprocess.run" in src


def _check_plans(ns: dict, text: str) -> None:
    p7, p70 = ns["p7"], ns["p70"]
    assert p7.cluster.gpus == 8 and p70.cluster.gpus == 64
    # the comparison table lists every evaluated strategy of both plans
    for r in p7.results + p70.results:
        assert r.name in text
    assert p7.recommendation.summary in text
    assert p70.recommendation.summary in text


def test_notebook_runs_every_cell_but_the_probe(monkeypatch):
    """The fast tier's run: every cell but the one that launches a real probe (seconds of torchrun;
    `distplan validate` itself is tested in tests/test_validate_cmd.py)."""
    assert sum(_launches_probe(src) for src in _code_cells()) == 1
    ns, text = _run_cells(monkeypatch, skip_probe=True)
    _check_plans(ns, text)


@pytest.mark.slow
def test_notebook_runs_every_cell(monkeypatch):
    ns, text = _run_cells(monkeypatch, skip_probe=False)
    _check_plans(ns, text)
    # the validation cell ran the CLI (or said why it could not), without raising
    assert ("PASS" in text or "FAIL" in text or "validate exited" in text or "validate could not run" in text)
