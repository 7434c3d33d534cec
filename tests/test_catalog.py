"""Catalog: every built-in file loads, units convert once and correctly, bad files are rejected with
the file and key in a one-line message, user directories layer over the built-in catalog."""

from __future__ import annotations

from pathlib import Path

import pytest

from distplan.catalog.loader import (
    BUILTIN_DIR, KINDS, GPU, CatalogError, Interconnect, ModelEntry, Node, clear_cache, load_catalog,
)

GIB = 2**30


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("DISTPLAN_CATALOG", raising=False)


# -- the built-in catalog -------------------------------------------------------------------------

def test_every_builtin_file_loads():
    cat = load_catalog()
    for kind in KINDS:
        stems = sorted(p.stem for p in (BUILTIN_DIR / kind).glob("*.yaml"))
        assert stems and cat.names(kind) == stems
        for entry in cat.entries(kind):
            assert entry.source and all(s.strip() for s in entry.source), entry.name
            d = entry.to_dict()
            assert d["name"] == entry.name and isinstance(d["aliases"], list)


def test_required_entries_present():
    cat = load_catalog()
    want = {
        "gpus": "v100-16gb v100-32gb a100-40gb a100-80gb a100-80gb-pcie a100-40gb-pcie h100-sxm "
                "h100-pcie h200 b200 l4 l40s t4 a10 mi250x mi300x",
        "interconnects": "nvlink2 nvlink3 nvlink4 nvlink5 pcie3 pcie4 pcie5 ib-hdr ib-ndr ib-xdr "
                         "eth-25g-roce eth-100g-roce eth-200g-roce eth-400g-roce eth-25g-tcp "
                         "eth-100g-tcp eth-200g-tcp eth-400g-tcp xgmi",
        "nodes": "dgx-a100 dgx-h100 hgx-h200 dgx-b200 aws-p4d aws-p5 gcp-a3 l40s-8x-pcie "
                 "generic-ethernet",
        "models": "gpt2 gpt2-medium gpt2-large gpt2-xl llama-2-7b llama-2-13b llama-2-70b llama-3-8b "
                  "llama-3-70b llama-3-405b mistral-7b qwen2.5-7b phi-3-mini",
    }
    for kind, names in want.items():
        assert set(names.split()) <= set(cat.names(kind)), kind


def test_catalog_is_parsed_once():
    """The parsed catalog is cached per directory list (its cold load time is in
    benchmarks/bench_planner.py, not timed here)."""
    clear_cache()
    first = load_catalog()
    assert load_catalog() is first
    clear_cache()
    assert load_catalog() is not first


def test_h100_bf16_is_dense():
    g = load_catalog().gpu("h100-sxm")
    assert g.flops["bf16"] == pytest.approx(989e12)  # 1979 is the sparse figure
    assert g.flops["tf32"] == pytest.approx(494.5e12)
    assert g.achievable_flops("bf16") == pytest.approx(989e12 * 0.803)


def test_dtypes_a_gpu_lacks_are_absent():
    cat = load_catalog()
    for name in ("v100-16gb", "v100-32gb", "t4"):
        assert "bf16" not in cat.gpu(name).flops and "tf32" not in cat.gpu(name).flops
    with pytest.raises(CatalogError, match="gpu 't4' has no 'bf16' throughput; known: fp16, fp32"):
        cat.gpu("t4").peak_flops("bf16")


def test_unit_conversions_of_builtin_entries():
    cat = load_catalog()
    assert cat.interconnect("ib-ndr").line_rate_bytes_per_s == pytest.approx(50e9)  # 400 Gbit/s
    assert cat.interconnect("eth-25g-tcp").line_rate_bytes_per_s == pytest.approx(3.125e9)
    assert cat.interconnect("nvlink4").line_rate_bytes_per_s == pytest.approx(450e9)
    assert cat.interconnect("nvlink4").busbw_bytes_per_s == pytest.approx(450e9 * 0.82)
    assert cat.interconnect("nvlink4").latency_s == pytest.approx(3.4e-6)
    assert cat.interconnect("nvlink4").half_efficiency_bytes == pytest.approx(9.6 * 2**20)
    assert cat.gpu("a100-80gb").memory_bytes == 81920 * 2**20  # nvidia-smi total: 80 GiB of HBM2e
    assert cat.gpu("a100-80gb").hbm_bytes_per_s == pytest.approx(2039e9)


def test_size_dependent_efficiency():
    link = load_catalog().interconnect("ib-ndr")
    s_half = link.half_efficiency_bytes
    assert link.efficiency_at(s_half) == pytest.approx(0.5)
    assert link.efficiency_at(0) == 0.0
    assert link.efficiency_at(1e12) > 0.99


def test_references_between_entries_resolve():
    cat = load_catalog()
    for node in cat.entries("nodes"):
        assert cat.gpu(node.gpu) and cat.interconnect(node.intra_link).tier == "intra_node"
        assert cat.interconnect(node.inter_link).tier == "inter_node"
    for gpu in cat.entries("gpus"):
        assert cat.interconnect(gpu.scale_up_link).tier == "intra_node"


def test_model_entries_match_published_parameter_counts():
    model = pytest.importorskip("distplan.planner.model")
    for entry in load_catalog().entries("models"):
        spec = model.ModelSpec(**entry.spec_kwargs())
        assert spec.param_count() == entry.params_published, entry.name


def test_lookup_aliases_case_insensitive():
    cat = load_catalog()
    assert cat.gpu("H100").name == "h100-sxm"
    assert cat.gpu(" h100-SXM ").name == "h100-sxm"
    assert cat.node("HGX-H100").name == "dgx-h100"
    assert cat.model("meta-llama/Llama-2-7b-hf").name == "llama-2-7b"
    assert cat.interconnect("NDR").name == "ib-ndr"
    assert isinstance(cat.entry("h100"), GPU)
    assert isinstance(cat.entry("nvlink4"), Interconnect)
    assert isinstance(cat.entry("dgx-h100"), Node)
    assert isinstance(cat.entry("gpt2"), ModelEntry)


def test_unknown_name_lists_valid_names():
    cat = load_catalog()
    with pytest.raises(CatalogError) as e:
        cat.gpu("h900")
    msg = str(e.value)
    assert msg.startswith("unknown gpu 'h900'; known: a10, a100-40gb, ")
    assert "h100-sxm" in msg and "\n" not in msg
    with pytest.raises(CatalogError, match="unknown node 'x'; known: aws-p4d"):
        cat.node("x")
    with pytest.raises(CatalogError, match="unknown catalog entry 'nothing'"):
        cat.entry("nothing")
    with pytest.raises(CatalogError, match="unknown catalog kind 'cpus'"):
        cat.names("cpus")


# -- the GiB / GB convention ----------------------------------------------------------------------

GOOD_GPU = """\
vendor: nvidia
{memory}
hbm_bandwidth_gb_per_s: 1000
bf16_tflops: 100
matmul_efficiency_fraction: 0.8
scale_up_link: pcie4
source: test
"""


def _write(root: Path, kind: str, stem: str, text: str) -> Path:
    d = root / kind
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{stem}.yaml"
    p.write_text(text)
    return p


def test_gib_and_gb_convention(tmp_path):
    _write(tmp_path, "gpus", "dec", GOOD_GPU.format(memory="memory_gb: 80"))
    _write(tmp_path, "gpus", "bin", GOOD_GPU.format(memory="memory_gib: 80"))
    _write(tmp_path, "gpus", "mib", GOOD_GPU.format(memory="memory_mib: 512"))
    cat = load_catalog([tmp_path])
    assert cat.gpu("dec").memory_bytes == 80_000_000_000
    assert cat.gpu("bin").memory_bytes == 80 * GIB == 85_899_345_920
    assert cat.gpu("mib").memory_bytes == 512 * 2**20


def test_bandwidth_units(tmp_path):
    base = "kind: infiniband\ntier: inter_node\nbusbw_efficiency_fraction: 0.9\nlatency_us: 5\n" \
           "half_efficiency_size_mib: 4\nsource: test\n"
    _write(tmp_path, "interconnects", "bits", base + "line_rate_gbit_per_s: 400\n")
    _write(tmp_path, "interconnects", "bytes", base + "line_rate_gb_per_s: 50\n")
    cat = load_catalog([tmp_path])
    assert cat.interconnect("bits").line_rate_bytes_per_s == pytest.approx(50e9)
    assert cat.interconnect("bytes").line_rate_bytes_per_s == pytest.approx(50e9)
    assert cat.interconnect("bits").latency_s == pytest.approx(5e-6)
    assert cat.interconnect("bits").half_efficiency_bytes == 4 * 2**20


# -- rejections: each names the file and the key ----------------------------------------------------

BAD_GPU_CASES = [
    ("unknown_key", GOOD_GPU.format(memory="memory_gb: 80") + "colour: green\n", "colour", "unknown key"),
    ("no_unit", GOOD_GPU.format(memory="memory: 80"), "memory", "unit"),
    ("wrong_unit", GOOD_GPU.format(memory="memory_us: 80"), "memory_us", "wrong unit"),
    ("unit_on_unknown", GOOD_GPU.format(memory="memory_gb: 80") + "speed_tflops: 3\n", "speed_tflops",
     "unknown key"),
    ("bare_number", GOOD_GPU.format(memory="memory_gb: 80") + "speed: 3\n", "speed", "unit suffix"),
    ("eff_high", GOOD_GPU.format(memory="memory_gb: 80").replace("0.8", "1.5"),
     "matmul_efficiency_fraction", "outside (0, 1]"),
    ("eff_zero", GOOD_GPU.format(memory="memory_gb: 80").replace("0.8", "0"),
     "matmul_efficiency_fraction", "outside (0, 1]"),
    ("neg_bw", GOOD_GPU.format(memory="memory_gb: 80").replace("1000", "-1000"),
     "hbm_bandwidth_gb_per_s", "must be > 0"),
    ("zero_mem", GOOD_GPU.format(memory="memory_gb: 0"), "memory_gb", "must be > 0"),
    ("no_source", GOOD_GPU.format(memory="memory_gb: 80").replace("source: test\n", ""), "source",
     "missing"),
    ("empty_source", GOOD_GPU.format(memory="memory_gb: 80").replace("source: test", "source: []"),
     "source", "non-empty"),
    ("no_memory", GOOD_GPU.format(memory=""), "memory", "missing"),
    ("two_memories", GOOD_GPU.format(memory="memory_gb: 80\nmemory_gib: 80"), "memory_gib",
     "duplicates"),
    ("string_number", GOOD_GPU.format(memory="memory_gb: '80'"), "memory_gb", "not a number"),
    ("bad_vendor", GOOD_GPU.format(memory="memory_gb: 80").replace("nvidia", "acme"), "vendor",
     "accepted: nvidia"),
    ("unknown_link", GOOD_GPU.format(memory="memory_gb: 80").replace("pcie4", "warp9"),
     "scale_up_link", "unknown interconnect 'warp9'; known:"),
    ("wrong_tier_link", GOOD_GPU.format(memory="memory_gb: 80").replace("pcie4", "ib-ndr"),
     "scale_up_link", "tier inter_node"),
    ("frac_count", GOOD_GPU.format(memory="memory_gb: 80") + "nvlink_links_count: 2.5\n",
     "nvlink_links_count", "positive integer"),
    ("name_mismatch", "name: other\n" + GOOD_GPU.format(memory="memory_gb: 80"), "name",
     "differs from the file name"),
]


@pytest.mark.parametrize("stem,text,key,what", BAD_GPU_CASES, ids=[c[0] for c in BAD_GPU_CASES])
def test_rejects_bad_gpu_file(tmp_path, stem, text, key, what):
    path = _write(tmp_path, "gpus", stem.replace("_", "-"), text)
    with pytest.raises(CatalogError) as e:
        load_catalog([tmp_path])
    msg = str(e.value)
    assert "\n" not in msg
    assert str(path) in msg, msg
    assert f"key '{key}'" in msg, msg
    assert what in msg, msg


def test_rejects_node_with_unknown_gpu(tmp_path):
    path = _write(tmp_path, "nodes", "my-node", "gpu: h900\ngpus_per_node_count: 8\n"
                  "intra_link: nvlink4\ninter_link: ib-ndr\nnics_per_node_count: 8\nsource: test\n")
    with pytest.raises(CatalogError) as e:
        load_catalog([tmp_path])
    msg = str(e.value)
    assert str(path) in msg and "key 'gpu'" in msg and "unknown gpu 'h900'; known: a10" in msg


def test_rejects_node_with_wrong_tier_and_count(tmp_path):
    node = "gpu: h100\ngpus_per_node_count: {n}\nintra_link: {intra}\ninter_link: ib-ndr\n" \
           "nics_per_node_count: 8\nsource: test\n"
    _write(tmp_path / "a", "nodes", "n1", node.format(n=8, intra="ib-hdr"))
    with pytest.raises(CatalogError, match=r"n1.yaml: key 'intra_link'.*accepted: an interconnect with tier intra_node"):
        load_catalog([tmp_path / "a"])
    _write(tmp_path / "b", "nodes", "n2", node.format(n=-8, intra="nvlink4"))
    with pytest.raises(CatalogError, match=r"n2.yaml: key 'gpus_per_node_count': -8 is not a positive"):
        load_catalog([tmp_path / "b"])


def test_rejects_bad_model_and_interconnect(tmp_path):
    _write(tmp_path / "a", "models", "m", "layers_count: 2\nhidden_count: 64\nheads_count: 3\n"
           "kv_heads_count: 3\nffn_hidden_count: 128\nvocab_count: 100\nmax_positions_count: 16\n"
           "mlp: swiglu\nnorm: rmsnorm\nposition: rope\nsource: test\n")
    with pytest.raises(CatalogError, match=r"m.yaml: key 'heads_count': 3 does not divide"):
        load_catalog([tmp_path / "a"])
    _write(tmp_path / "b", "models", "m", "layers_count: 2\nhidden_count: 64\nheads_count: 4\n"
           "kv_heads_count: 4\nffn_hidden_count: 128\nvocab_count: 100\nmax_positions_count: 16\n"
           "mlp: relu\nnorm: rmsnorm\nposition: rope\nsource: test\n")
    with pytest.raises(CatalogError, match=r"m.yaml: key 'mlp': 'relu' is not accepted; accepted: swiglu"):
        load_catalog([tmp_path / "b"])
    _write(tmp_path / "c", "interconnects", "x", "kind: carrier-pigeon\ntier: inter_node\n"
           "line_rate_gb_per_s: 1\nbusbw_efficiency_fraction: 1\nlatency_us: 1\n"
           "half_efficiency_size_mib: 1\nsource: test\n")
    with pytest.raises(CatalogError, match=r"x.yaml: key 'kind'.*accepted: nvlink, pcie"):
        load_catalog([tmp_path / "c"])


def test_rejects_invalid_yaml_and_names(tmp_path):
    path = _write(tmp_path / "a", "gpus", "broken", "vendor: [unclosed\n")
    with pytest.raises(CatalogError) as e:
        load_catalog([tmp_path / "a"])
    assert str(path) in str(e.value) and "invalid YAML" in str(e.value) and "\n" not in str(e.value)
    _write(tmp_path / "b", "gpus", "Bad_Name", GOOD_GPU.format(memory="memory_gb: 1"))
    with pytest.raises(CatalogError, match="Bad_Name.yaml: file name 'Bad_Name' is not a catalog name"):
        load_catalog([tmp_path / "b"])
    _write(tmp_path / "c", "gpus", "dup", GOOD_GPU.format(memory="memory_gb: 1") + "aliases: [h100]\n")
    with pytest.raises(CatalogError, match=r"dup.yaml: key 'aliases': 'h100' is already"):
        load_catalog([tmp_path / "c"])
    with pytest.raises(CatalogError, match="catalog directory .* not found"):
        load_catalog([tmp_path / "missing"])


# -- layering ---------------------------------------------------------------------------------------

def test_user_dir_overrides_builtin(tmp_path):
    _write(tmp_path, "gpus", "h100-sxm", GOOD_GPU.format(memory="memory_gib: 94") + "aliases: [h100]\n")
    cat = load_catalog([tmp_path])
    assert cat.gpu("h100").memory_bytes == 94 * GIB
    assert cat.gpu("h100").path.startswith(str(tmp_path))
    assert len(cat.names("gpus")) == len(load_catalog().names("gpus"))
    assert load_catalog().gpu("h100").memory_bytes == 81559 * 2**20  # built-in catalog untouched


def test_user_dir_adds_entries_referencing_builtins(tmp_path):
    _write(tmp_path, "nodes", "my-cluster", "gpu: h100\ngpus_per_node_count: 4\nintra_link: nvlink4\n"
           "inter_link: eth-100g-roce\nnics_per_node_count: 2\nsource: our rack\n")
    node = load_catalog([str(tmp_path)]).node("my-cluster")
    assert (node.gpus_per_node, node.nics_per_node) == (4, 2)


def test_env_var_dirs(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, "gpus", "env-gpu", GOOD_GPU.format(memory="memory_gb: 10"))
    _write(b, "gpus", "env-gpu", GOOD_GPU.format(memory="memory_gb: 20"))
    _write(b, "gpus", "other-gpu", GOOD_GPU.format(memory="memory_gb: 30"))
    monkeypatch.setenv("DISTPLAN_CATALOG", f"{a}{__import__('os').pathsep}{b}")
    cat = load_catalog()
    assert cat.gpu("env-gpu").memory_bytes == 20 * 10**9  # later dir wins
    assert cat.gpu("other-gpu").memory_bytes == 30 * 10**9
    c = tmp_path / "c"
    _write(c, "gpus", "env-gpu", GOOD_GPU.format(memory="memory_gb: 40"))
    assert load_catalog([c]).gpu("env-gpu").memory_bytes == 40 * 10**9  # extra_dirs over env
    monkeypatch.delenv("DISTPLAN_CATALOG")
    with pytest.raises(CatalogError, match="unknown gpu 'env-gpu'"):
        load_catalog().gpu("env-gpu")


def test_cache_by_dirs(tmp_path):
    _write(tmp_path, "gpus", "cached", GOOD_GPU.format(memory="memory_gb: 1"))
    assert load_catalog([tmp_path]) is load_catalog([str(tmp_path)])
    assert load_catalog() is load_catalog()
    assert load_catalog([tmp_path]) is not load_catalog()


def test_planner_import_does_not_load_catalog():
    """Importing the package must not read YAML (the catalog is loaded lazily): the loader's module may be
    imported (the planner's modules import its names at their top), but no file is parsed and yaml is not
    imported."""
    import subprocess
    import sys

    code = ("import sys, distplan.catalog, distplan.planner; "
            "loader = sys.modules.get('distplan.catalog.loader'); "
            "assert loader is None or not loader._CACHE, 'catalog read'; "
            "assert 'yaml' not in sys.modules, 'yaml imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
