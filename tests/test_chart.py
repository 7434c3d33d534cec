"""The memory chart: SVG structure, escaping, notebook HTML, matplotlib's helpful ImportError."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest

from distplan.planner import chart
from distplan.planner.api import plan
from distplan.planner.model import ModelSpec

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def p7():
    return plan(params="7B", gpus=8, gpu_mem="80GiB")


def _bars(root):
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == "bar"]


def test_svg_parses_one_bar_per_strategy(p7):
    svg = p7.svg()
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    bars = _bars(root)
    assert [b.get("data-strategy") for b in bars] == [r.name for r in p7.results]
    # each bar: a fits mark matching the planner, and the GiB total at its end
    for b, r in zip(bars, p7.results):
        assert b.get("data-fits") == str(r.fits).lower()
        texts = "".join(b.itertext())
        assert ("\u2713" if r.fits else "\u2717") in texts
        totals = [t for t in b.iter(f"{SVG}text") if t.get("class") == "total"]
        assert len(totals) == 1
        expected = (r.memory.total_required) / 2**30
        assert float(totals[0].text) == pytest.approx(expected, rel=0.01)
        # the overhead segment is hatched
        over = [x for x in b.iter(f"{SVG}rect") if "seg-overhead" in (x.get("class") or "")]
        assert over and over[0].get("fill") == "url(#hatch)"


def test_svg_memory_line_and_comm_panel(p7):
    root = ET.fromstring(p7.svg())
    lines = [x for x in root.iter(f"{SVG}line") if x.get("class") == "gpu-mem"]
    assert len(lines) == 1
    labels = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "gpu-mem-label"]
    assert labels == [f"GPU memory {p7.cluster.gpu_memory_bytes / 2**30:.2f} GiB"]  # 79.65: an 80GB H100
    comm = [x for x in root.iter(f"{SVG}rect") if x.get("class") == "comm"]
    assert len(comm) == len(p7.results)  # communication panel, one bar per strategy
    legend = "".join(root.itertext())
    for label in ("params", "grads", "optimizer", "activations", "comm buffers", "temporaries"):
        assert label in legend


def test_svg_segment_widths_are_proportional(p7):
    root = ET.fromstring(p7.svg())
    bar = _bars(root)[0]
    r = p7.results[0]
    widths = {x.get("class").split("seg-")[1]: float(x.get("width"))
              for x in bar.iter(f"{SVG}rect") if "seg-" in (x.get("class") or "")}
    ratio = widths["params"] / r.memory.components["params"]
    assert widths["optimizer"] / r.memory.components["optimizer"] == pytest.approx(ratio, rel=1e-3)


def test_svg_escapes_text(p7):
    evil = replace(p7.train, model=replace(p7.train.model, name='<b>"7B" & co</b>'))
    q = replace(p7, train=evil)
    svg = chart.plan_svg(q)
    root = ET.fromstring(svg)  # still valid XML
    assert '<b>"7B" & co</b>' in "".join(root.itertext())
    assert "<b>" not in svg
    html = chart.plan_html(q)
    assert "&lt;b&gt;" in html and "<b>&quot;7B" not in html


def test_html_has_table_svg_and_recommendation(p7):
    html = p7._repr_html_()
    assert "<table" in html and "</table>" in html
    assert html.count("<tr>") == len(p7.results) + 1
    assert "<svg" in html and "</svg>" in html
    for r in p7.results:
        assert f"<td>{r.name}</td>" in html
    assert "recommendation" in html
    assert p7.recommendation.summary.split(":")[0] in html


def test_small_model_off_scale_line():
    spec = ModelSpec(name="tiny", layers=2, hidden=64, heads=4, kv_heads=4, ffn_hidden=128, vocab=256)
    q = plan(spec, gpus=2, gpu_mem="80GiB", seq_len=32)
    root = ET.fromstring(q.svg())
    assert len(_bars(root)) == len(q.results)
    labels = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "gpu-mem-label"]
    assert labels[0].startswith(f"GPU memory {q.cluster.gpu_memory_bytes / 2**30:.2f} GiB (off scale")


def test_plot_without_matplotlib_raises_helpful_error(p7, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"plan.plot\(\) needs matplotlib: pip install 'distplan\[plot\]' "
                                          r"\(or use plan.svg\(\), which needs nothing\)"):
        p7.plot()


def test_plot_with_matplotlib(p7, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "chart.png"
    fig = p7.plot(str(out))
    assert out.stat().st_size > 0
    assert fig.axes


def test_chart_imports_nothing_heavy():
    import subprocess
    code = ("import sys, distplan.planner.chart; "
            "print(any(m in sys.modules for m in ('torch', 'matplotlib')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_plot_over_a_symlink_or_a_file_keeps_the_link_and_the_mode(tmp_path):
    """--plot onto an existing file keeps its mode (the temporary file mkstemp makes is 0o600), onto a
    symlink replaces the file it names and leaves the link; a new file gets 0o666 less the umask."""
    import os
    import stat
    p = plan("llama-3-8b", gpus=8, gpu="h100-sxm", comm=False)
    real, link = tmp_path / "real.svg", tmp_path / "link.svg"
    real.write_text("old")
    os.chmod(real, 0o644)
    link.symlink_to(real.name)
    chart.write_chart(p, str(link))
    assert link.is_symlink() and real.read_text().startswith("<svg")
    assert stat.S_IMODE(real.stat().st_mode) == 0o644
    mask = os.umask(0o022)
    try:
        chart.write_chart(p, str(tmp_path / "new.svg"))
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "new.svg").stat().st_mode) == 0o644
    assert sorted(f.name for f in tmp_path.iterdir()) == ["link.svg", "new.svg", "real.svg"]  # no temporaries left
