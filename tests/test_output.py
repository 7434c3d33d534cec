"""What a new user reads: output that fits the terminal, a recommendation in plain words, honest
hardware assumptions, charts written safely. Through the CLI as typed (CliRunner)."""

import json
import re
import os

import pytest
from click.testing import CliRunner

from distplan.catalog.loader import load_catalog
from distplan.planner.api import plan
from distplan.planner.cli import main


def run(*args, columns=None):
    env = {"COLUMNS": str(columns)} if columns else {"COLUMNS": ""}
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


@pytest.mark.parametrize("cmd", [
    ["estimate", "--params", "7B", "--gpus", "8", "--gpu-mem", "80"],
    ["recommend", "--params", "70B", "--gpus", "64", "--inter", "eth-100g-tcp", "--nics-per-node", "1"],
    ["estimate", "--params", "13B", "--gpus", "16", "--tokens", "2T"],
])
def test_output_fits_80_columns(cmd):
    wide = run(*cmd)
    narrow = run(*cmd, columns=80)
    assert wide.exit_code == narrow.exit_code == 0, narrow.output
    assert widest(wide.output) > 100  # the tables as one line per row when no width is asked for
    assert widest(narrow.output) <= 80
    # nothing is lost by splitting: every strategy row and every figure of the wide table is there
    names = ("ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op", "hsdp", "fsdp-no-shard", "single")
    rows = {n for n in names if re.search(rf"^\s*{re.escape(n)}\s", wide.output, re.M)}
    assert rows  # the strategy rows of the wide tables
    for token in (*rows, "headroom", "MFU", "recommendation:"):
        assert re.search(rf"(^|\s){re.escape(token)}(\s|$)", narrow.output, re.M), token


def test_tsv_is_never_split():
    r = run("estimate", "--params", "7B", "--gpus", "8", "--format", "tsv", columns=60)
    rows = [line for line in r.output.splitlines() if line.split("\t")[0].strip() == "zero3"]
    assert [len(x.split("\t")) for x in rows] == [14, 11]  # memory row, comm row: whole


def test_recommendation_sentence_reads():
    r = run("estimate", "--params", "7B", "--gpus", "8", "--gpu-mem", "80")
    line = next(x for x in r.output.splitlines() if x.startswith("recommendation:"))
    assert "among those within 5% it is the simplest" not in line
    assert re.match(r"recommendation: [a-z0-9-]+, (the fastest that fits|the simplest of those within 5% of the "
                    r"fastest \([a-z0-9-]+, [0-9.]+ ms\)): step [0-9.]+ ms \(", line), line
    assert line.rstrip().endswith("largest micro-batch that fits: 3")


def test_simpler_pick_names_the_fastest():
    p = plan(params="7B", gpus=8, gpu_mem=40)
    rec = p.recommendation
    # the fastest of those that fit without the allocator releasing its cache (what recommend picks from)
    fastest = min((r for r in p.results if r.fits_cleanly), key=lambda r: r.step_time_s)
    if rec.strategy == fastest.name:
        assert rec.reasons[0].startswith("the fastest that fits")
    else:
        assert f"within 5% of the fastest ({fastest.name}" in rec.reasons[0]


def test_no_hsdp_pick_on_one_node():
    """On one node HSDP is FSDP with a replica group of one: never the 'simpler' pick."""
    for gpu_mem in (40, 80):
        assert plan(params="7B", gpus=8, gpu_mem=gpu_mem).recommendation.strategy != "hsdp"


def test_hsdp_on_one_node_times_as_fsdp():
    """One node: HYBRID_SHARD's shard group is FULL_SHARD's group (one communicator, the same SMs held while
    it overlaps compute), so the same exposed communication; the step differs only by the host launches of
    the replica group's all-reduces over one rank (FSDP1 `_reduce_grad` still calls them)."""
    from distplan.planner.compute import COLLECTIVE_LAUNCH_S
    p = plan(params="7B", gpus=8, gpu_mem=80)
    fsdp, hsdp = p["fsdp"].time, p["hsdp"].time
    assert hsdp.exposed_comm_s == pytest.approx(fsdp.exposed_comm_s, rel=1e-12)
    replica_calls = sum(c.calls for c in p["hsdp"].collectives if c.group == "inter_node")
    assert replica_calls > 0
    assert hsdp.step_time_s - fsdp.step_time_s == pytest.approx(COLLECTIVE_LAUNCH_S * replica_calls, rel=1e-9)


def test_zero3_bullet_only_when_zero3_is_the_pick():
    r = run("recommend", "--params", "7B", "--gpus", "8", "--gpu-mem", "80")
    pick = re.search(r"recommendation: ([a-z0-9-]+)", r.output).group(1)
    assert pick not in ("zero3", "fsdp", "hsdp"), r.output
    assert "zero3 moves" not in r.output and "fsdp moves" not in r.output
    assert "hsdp keeps" not in r.output


def test_changed_configuration_rows_are_printed():
    # the strategy choice on a pure data-parallel mesh (--tp/--pp given: no layout search)
    r = run("recommend", "--tp", "1", "--pp", "1", "--params", "70B", "--gpus", "64", "--inter", "eth-100g-tcp",
            "--nics-per-node", "1")
    out = r.output
    assert "smallest change: --activation-checkpointing selective" in out
    head, tail = out.split("with --activation-checkpointing selective (recomputes norms and activations): memory")
    # the row under the change differs from the row as given (activations recomputed)
    pick = next(x for x in out.splitlines() if x.startswith("recommendation:")).split()[1]
    given = next(x for x in head.splitlines() if x.startswith(pick + " "))
    changed = next(x for x in tail.splitlines() if x.startswith(pick + " "))
    assert given.split()[4] != changed.split()[4]  # acts column
    assert "NO" in given and "yes" in changed


def test_communication_bound_pick_says_so_and_offers_changes():
    # the strategy choice on a pure data-parallel mesh (--tp/--pp given: no layout search)
    r = run("recommend", "--tp", "1", "--pp", "1", "--params", "70B", "--gpus", "64", "--inter", "eth-100g-tcp",
            "--nics-per-node", "1")
    line = next(x for x in r.output.splitlines() if "communication-bound" in x)
    assert "MFU 1%" in line
    assert "--nics-per-node 8:" in line and "--inter eth-100g-roce (RDMA):" in line
    ok = run("recommend", "--tp", "1", "--pp", "1", "--params", "7B", "--gpus", "8")
    assert "communication-bound" not in ok.output


def test_default_nics_follow_the_link():
    p = plan(params="70B", gpus=64, inter="eth-100g-tcp")
    assert p.cluster.nics_per_node == 1
    assert any("1 x eth-100g-tcp per node" in n and "generic-ethernet" in n for n in p.notes)
    assert plan(params="70B", gpus=64, inter="ib-ndr").cluster.nics_per_node == 8
    assert plan(params="70B", gpus=64, inter="eth-400g-roce").cluster.nics_per_node == 8
    assert plan(params="70B", gpus=64, inter="eth-25g-tcp").cluster.nics_per_node == 1
    assert plan(params="70B", gpus=64, node="aws-p4d").cluster.nics_per_node == 4
    assert plan(params="70B", gpus=64, inter="eth-100g-tcp", nics_per_node=2).cluster.nics_per_node == 2


@pytest.mark.parametrize("mem, gpu", [(40, "a100-40gb"), (80, "h100-sxm"), (141, "h200"), (48, "l40s"),
                                      (24, "l4"), (16, "v100-16gb"), (32, "v100-32gb")])
def test_gpu_mem_names_the_catalog_gpu(mem, gpu):
    p = plan(params="7B", gpus=8, gpu_mem=mem)
    assert p.cluster.gpu_name == gpu
    assert p.cluster.gpu_memory_bytes == load_catalog().gpu(gpu).memory_bytes
    assert any(f"the {mem}GB card {gpu} reports" in n for n in p.notes)


def test_gpu_mem_without_a_catalog_match_says_so():
    p = plan(params="7B", gpus=8, gpu_mem=100)
    assert p.cluster.gpu_name == "h100-sxm"
    assert p.cluster.gpu_memory_bytes == 100 * 2**30  # a card size no catalog GPU has: that many GiB
    assert any("no catalog GPU has that size" in n for n in p.notes)
    assert plan(params="7B", gpus=8, gpu="a100-80gb", gpu_mem=40).cluster.gpu_name == "a100-80gb"


def test_intra_must_be_an_intra_node_link():
    r = CliRunner().invoke(main, ["estimate", "--params", "7B", "--intra", "ib-ndr"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [r.output.strip()]
    assert "--intra='ib-ndr' is an inter-node link" in r.output and "nvlink4" in r.output


@pytest.mark.parametrize("params, name", [("7B", "mistral-7b"), ("8B", "llama-3-8b"), ("70B", "llama-3-70b"),
                                          ("13B", "llama-2-13b"), ("405B", "llama-3-405b")])
def test_params_plans_the_nearest_real_model(params, name):
    p = plan(params=params, gpus=8)
    assert p.train.model.name == name
    assert any(f"nearest real model, {name}" in n for n in p.notes)


def test_params_between_models_is_scaled_and_said():
    p = plan(params="30B", gpus=8)
    assert p.train.model.name.startswith("~30B (scaled from")
    assert abs(p.train.model.param_count() / 30e9 - 1) < 0.03
    assert any("no catalog model within 10%" in n for n in p.notes)


def test_tokens_show_time_to_train_everywhere():
    for cmd in ("estimate", "recommend"):
        r = run(cmd, "--params", "7B", "--gpus", "8", "--tokens", "2T")
        assert r.exit_code == 0, r.output
        assert "time for 2T tokens" in r.output
        row = [x for x in r.output.splitlines() if x.startswith("ddp ")][1]  # the time table's row
        assert " d " in row + " "  # days, from 2e12 / tokens per second
    r = run("sweep", "--params", "7B", "--sweep-gpus", "8,16", "--tokens", "2T")
    assert r.exit_code == 0 and "time to train" in r.output, r.output
    rows = json.loads(run("sweep", "--params", "7B", "--sweep-gpus", "8,16", "--tokens", "2T", "--json").output)
    assert all(x["time_to_train_s"] == pytest.approx(2e12 / x["tokens_per_s"]) for x in rows if x["tokens_per_s"])
    d = json.loads(run("recommend", "--params", "7B", "--gpus", "8", "--tokens", "2T", "--json").output)
    s = d["strategies"][0]
    assert s["time_to_train_s"] == pytest.approx(2e12 / s["tokens_per_s"])


@pytest.mark.parametrize("args", [
    ["--params", "7B", "--gpus", "8", "--gpu-mem", "80"],
    ["--params", "70B", "--gpus", "64", "--grad-accum", "4", "--activation-checkpointing", "full"],
    ["--hf-config", "tests/data/hf/qwen2.5-0.5b.json", "--gpus", "8", "--front-end", "analytic"],
    pytest.param(["--hf-config", "tests/data/hf/qwen2.5-0.5b.json", "--gpus", "8", "--front-end", "trace"],
                 marks=pytest.mark.slow, id="trace"),
])
def test_step_time_is_the_sum_of_its_printed_parts(args):
    """The step a user reads is compute + exposed communication + optimizer + the copies and launches around
    the collectives: each part is in the JSON and a column of the table, so the row adds up."""
    if "trace" in args:
        pytest.importorskip("transformers")
    d = json.loads(run("estimate", *args, "--json").output)
    timed = [s for s in d["strategies"] if s["step_time_s"]]
    assert timed
    for s in timed:
        parts = s["compute_s"] + s["comm"]["exposed_s"] + s["optimizer_s"] + s["overhead_s"]
        assert s["step_time_s"] == pytest.approx(parts, rel=1e-9), s["name"]
        assert s["optimizer_s"] > 0
    table = run("estimate", *args, "--format", "tsv").output.splitlines()
    head = next([c.strip() for c in line.split("\t")] for line in table if "sent/GPU/step" in line)
    assert head[4:8] == ["compute", "optimizer", "other", "step"]


def test_json_has_no_infinity():
    r = run("estimate", "--params", "70B", "--gpus", "64", "--inter", "eth-100g-tcp", "--nics-per-node", "1", "--json")
    assert "Infinity" not in r.output and "NaN" not in r.output
    json.loads(r.output)


def test_catalog_show_prints_figures_without_float_noise():
    r = run("catalog", "show", "eth-100g-tcp")
    assert "latency_s: 3e-05" in r.output
    assert "9999999" not in r.output


@pytest.mark.parametrize("name", ["h100-sxm", "llama-3-8b", "dgx-h100", "eth-100g-tcp"])
def test_catalog_show_prints_text_not_python_reprs(name):
    """Issue 61 item 7: tables as indented lines, sizes with their unit, one source a line."""
    entry = load_catalog().entry(name)
    r = run("catalog", "show", name)
    assert r.exit_code == 0, r.output
    assert not re.search(r"[{}\[\]]'|'[,:]|True|False", r.output), r.output
    tables = [k for k, v in entry.to_dict().items() if isinstance(v, dict)]
    for k in tables:
        assert f"  {k}:\n" in r.output
    sources = entry.to_dict()["source"]
    assert all(f"    - {x}" in r.output for x in (sources if isinstance(sources, list) else [sources]))


def test_catalog_show_gives_sizes_their_unit():
    r = run("catalog", "show", "h100-sxm")
    gib = load_catalog().gpu("h100-sxm").memory_bytes / 2**30
    assert f"memory_bytes: {load_catalog().gpu('h100-sxm').memory_bytes:,} ({gib:.2f} GiB)" in r.output


def test_catalog_notes_are_whole_sentences():
    r = run("catalog", "show", "h100-sxm")
    notes = next(x for x in r.output.splitlines() if x.strip().startswith("notes:"))
    assert "bf16.e." not in notes and notes.count("(") == notes.count(")")


@pytest.mark.parametrize("path, words", [
    ("/nonexistent-folder/x.svg", "does not exist"),
    ("/proc/x.svg", "cannot write"),
    ("x.jpg", "accepted: .svg, .png, .pdf"),
    ("", "give a file name"),
])
def test_plot_bad_path_is_one_line_before_planning(path, words):
    r = CliRunner().invoke(main, ["estimate", "--params", "7B", "--plot", path])
    assert r.exit_code == 2, r.output
    assert len(r.output.strip().splitlines()) == 1 and words in r.output
    assert "Traceback" not in r.output


def test_plot_directory_is_refused(tmp_path):
    r = CliRunner().invoke(main, ["estimate", "--params", "7B", "--plot", str(tmp_path)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1


def test_plot_format_follows_extension(tmp_path):
    pytest.importorskip("matplotlib")
    for ext, magic in ((".svg", b"<svg"), (".png", b"\x89PNG"), (".pdf", b"%PDF")):
        path = tmp_path / f"chart{ext}"
        r = run("estimate", "--params", "7B", "--gpus", "8", "--plot", str(path))
        assert r.exit_code == 0, r.output
        assert magic in path.read_bytes()[:200]
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".distplan-chart-")]


def test_plot_failure_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "chart.svg"
    path.write_text("old chart")
    import distplan.planner.chart as chart

    def broken(_plan):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(chart, "plan_svg", broken)
    r = CliRunner().invoke(main, ["estimate", "--params", "7B", "--gpus", "8", "--plot", str(path)])
    assert r.exit_code == 2 and "No space left on device" in r.output
    assert path.read_text() == "old chart"
    assert os.listdir(tmp_path) == ["chart.svg"]


def test_readme_plot_example_runs(tmp_path):
    pytest.importorskip("matplotlib")
    p = plan(params="7B", gpus=8, gpu_mem=80)
    fig = p.plot(str(tmp_path / "m.png"))
    assert fig is not None and (tmp_path / "m.png").stat().st_size > 1000


def test_module_plan_counts_samples():
    pytest.importorskip("torch")
    r = run("estimate", "--module", "examples.mnist_cnn:make_model", "--input-shape", "64,1,28,28", "--gpus", "8")
    assert r.exit_code == 0, r.output
    assert "samples/s" in r.output and "tokens/s" not in r.output


@pytest.mark.parametrize("gpu, given, gib", [(None, "80GB", "79.65"), (None, "80G", "79.65"), (None, "80", "79.65"),
                                             (None, "80GiB", "80"), (None, "74.5GiB", "74.5"),
                                             (None, "81920MiB", "80"), ("a100-80gb", "80GB", "80"),
                                             ("a100-80gb", "74.5GiB", "74.5"), (None, "100", "100")])
def test_gpu_mem_interpretation_is_printed(gpu, given, gib):
    extra = ["--gpu", gpu] if gpu else []
    r = run("estimate", "--params", "7B", "--gpus", "8", "--gpu-mem", given, *extra)
    assert r.exit_code == 0, r.output
    assert f"--gpu-mem {given} = {gib} GiB" in r.output
    assert f"({gib}0 GiB)" in r.output or f"({gib} GiB)" in r.output or f"({gib}.00 GiB)" in r.output


def _planned_memory(*flags) -> int:
    """The GPU memory the command line plans with these flags, read off its JSON."""
    r = run("estimate", "--params", "7B", "--gpus", "8", "--strategy", "zero3", "--json", *flags)
    assert r.exit_code == 0, r.output
    return json.loads(r.output)["inputs"]["cluster"]["gpu_memory_bytes"]


def test_a_card_size_plans_the_card_memory():
    """Issue 61 item 3: --gpu-mem 80, --gpu-mem 80GB, --gpu h100-sxm and no flag plan the same memory, the
    catalog's h100-sxm figure; an exact budget is planned as written; API and CLI agree."""
    h100 = load_catalog().gpu("h100-sxm").memory_bytes
    same = {_planned_memory(), _planned_memory("--gpu-mem", "80"), _planned_memory("--gpu-mem", "80GB"),
            _planned_memory("--gpu", "h100-sxm"), _planned_memory("--gpu", "h100-sxm", "--gpu-mem", "80"),
            plan(params="7B", gpus=8, gpu_mem=80, strategies=["zero3"]).cluster.gpu_memory_bytes,
            plan(params="7B", gpus=8, gpu_mem="80GB", strategies=["zero3"]).cluster.gpu_memory_bytes}
    assert same == {h100}
    assert _planned_memory("--gpu-mem", "74.5GiB") == int(74.5 * 2**30)
    assert _planned_memory("--gpu-mem", "40") == load_catalog().gpu("a100-40gb").memory_bytes


@pytest.mark.parametrize("given, hint", [("7", "7B"), ("0.5", "0.5B"), ("999999", "1000000")])
def test_a_bare_small_count_is_refused(given, hint):
    r = run("estimate", "--params", given, "--gpus", "8")
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "--params" in lines[0] and hint in lines[0], r.output
    with pytest.raises(ValueError, match="--params"):
        plan(params=int(float(given)) or 0.5, gpus=8)


@pytest.mark.parametrize("args", [["estimate", "--micro-batch", "1e9"], ["estimate", "--nope"], ["catalog", "show"],
                                  ["estimate", "--plot", "/nonexistent/" + "x" * 5000 + ".svg"]])
def test_click_usage_errors_are_one_line(args):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and len(lines[0]) < 200, r.output
    assert "Usage:" not in r.output


def test_zero1_partition_with_more_ranks_than_parameters_is_the_largest_parameter():
    """The shortcut `layout` takes when ranks >= parameters equals ZeroRedundancyOptimizer's greedy
    partition (zero1_partition) at and just past that count, and costs nothing at 2**20 ranks."""
    import time
    from distplan.planner.api import resolve_model
    from distplan.planner.memory import _size_runs, layout, zero1_partition
    spec, _ = resolve_model(params="7B")
    runs = _size_runs(spec)
    count = sum(len(run) for _, run in runs)
    for ranks in (count, count + 1, 2 * count):
        greedy = max(zero1_partition(runs, ranks, shapes=False)[0])
        assert layout(spec, "zero1", ranks, False, True).opt_owned == greedy == max(n for n, _ in runs)
    start = time.process_time()
    layout(spec, "zero1", 2**20, False, True)
    assert time.process_time() - start < 0.5


def test_predictions_print_their_measured_error_band():
    """Issue 61 item 4: the band measured for the front end under each table and in the JSON, the figures
    the README's accuracy table states."""
    text = run("estimate", "--params", "7B", "--gpus", "8", "--strategy", "zero3").output
    d = json.loads(run("estimate", "--params", "7B", "--gpus", "8", "--strategy", "zero3", "--json").output)
    band = d["error_band"]
    assert set(band) == {"step_time", "peak_allocated", "peak_reserved"}
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8").read()
    t, m, r = band["step_time"], band["peak_allocated"], band["peak_reserved"]
    assert f"{100 * t['median']:.1f}% / {100 * t['max']:.1f}%" in readme
    assert f"{100 * m['median']:.2f}% / {100 * m['max']:.2f}%" in readme
    assert f"{100 * r['median']:.2f}% / {100 * r['max']:.2f}%" in readme
    flat = " ".join(text.split())
    assert f"measured error of step time, throughput and MFU: ±{100 * t['median']:.2g}% median" in flat
    assert f"measured error of the peak: ±{100 * m['median']:.2g}% median, {100 * m['max']:.2g}% max" in flat
    assert f"of the reserved peak: ±{100 * r['median']:.2g}% median, {100 * r['max']:.2g}% max" in flat
    assert flat.index("measured error of the peak") < flat.index("communication and time")
