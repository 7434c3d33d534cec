"""--hf-config with a Hugging Face Hub id (`org/name`, `org/name@revision`): its config.json from the local
Hugging Face cache (`huggingface_hub.hf_hub_download`), planned exactly as the same file given by path; a
Hub id that cannot be resolved is one line, exit code 2. No network: the CLI runs in a subprocess over a
cache built here (HF_HUB_CACHE), with HF_HUB_OFFLINE=1; the Hub's own failures (gated, private, missing
revision) are raised by a stand-in for `hf_hub_download` in-process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distplan.planner import hf_config as hf

pytest.importorskip("huggingface_hub")

DATA = Path(__file__).parent / "data" / "hf"
SHA_MAIN = "0123456789abcdef0123456789abcdef01234567"
SHA_V2 = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A Hugging Face cache as `hf_hub_download` leaves it: refs/<branch> holds the commit, the file lies in
    snapshots/<commit>/. Branch `main` is Qwen2.5-0.5B's config; branch `v2` the same with 12 layers."""
    root = tmp_path_factory.mktemp("hf") / "hub"
    repo = root / "models--Qwen--Qwen2.5-0.5B"
    cfg = json.loads((DATA / "qwen2.5-0.5b.json").read_text())
    for branch, sha, layers in (("main", SHA_MAIN, cfg["num_hidden_layers"]), ("v2", SHA_V2, 12)):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(sha)
        snap = repo / "snapshots" / sha
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=layers)))
    return root


def run_cli(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "distplan.planner", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def estimate_json(cache: Path, config: str) -> dict:
    cp = run_cli(cache, "estimate", "--hf-config", config, "--front-end", "analytic", "--gpus", "8", "--json")
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


def _memory(doc: dict) -> dict:
    return {s["name"]: s["memory"] for s in doc["strategies"]}


def test_hub_id_plans_as_its_cached_file(hub_cache):
    """`Qwen/Qwen2.5-0.5B` gives the same numbers as the config.json's path, for every strategy."""
    by_id = estimate_json(hub_cache, "Qwen/Qwen2.5-0.5B")
    by_path = estimate_json(hub_cache, str(DATA / "qwen2.5-0.5b.json"))
    assert by_id["inputs"]["model_params"] == by_path["inputs"]["model_params"] == 494_032_768
    assert len(by_id["strategies"]) == 8 and _memory(by_id) == _memory(by_path)


def test_revision_picks_that_snapshot(hub_cache):
    """`@v2` (a branch) and `@<commit>` read their own snapshot: 12 layers on v2, 24 on main."""
    main = estimate_json(hub_cache, f"Qwen/Qwen2.5-0.5B@{SHA_MAIN}")
    v2 = estimate_json(hub_cache, "Qwen/Qwen2.5-0.5B@v2")
    assert main["inputs"]["model"]["layers"] == 24 and v2["inputs"]["model"]["layers"] == 12
    assert v2["inputs"]["model_params"] < main["inputs"]["model_params"]


def test_validate_takes_a_hub_id(hub_cache):
    """`distplan validate --hf-config ID --dry-run`: the probe is the cached file's. (Rank 0 of 8 on the fake
    process group: one local rank, so the fit check -- half the free RAM -- does not depend on what the
    other test workers hold; as 2 gloo ranks this 151,936-word vocabulary needs about 3 GiB each, and a
    CI run where the free RAM had dropped under 12.3 GiB refused it.)"""
    cp = run_cli(hub_cache, "validate", "--hf-config", "Qwen/Qwen2.5-0.5B@v2", "--front-end", "analytic",
                 "--layers", "2", "--strategy", "zero3", "--simulate-world-size", "8", "--dry-run")
    assert cp.returncode == 0, cp.stderr
    assert f"models--Qwen--Qwen2.5-0.5B/snapshots/{SHA_V2}/config.json: a Llama-style decoder, 2 layers, " \
           f"hidden 896, 14 heads (2 KV)" in cp.stdout, cp.stdout


def test_uncached_id_offline_is_one_line(hub_cache):
    cp = run_cli(hub_cache, "estimate", "--hf-config", "Qwen/Qwen2.5-7B", "--gpus", "8")
    assert cp.returncode == 2
    lines = cp.stderr.strip().splitlines()
    assert lines[-1].startswith("Error: --hf-config: 'Qwen/Qwen2.5-7B' is neither a local path nor in the "
                                "Hugging Face cache"), cp.stderr
    assert "Traceback" not in cp.stderr


@pytest.mark.parametrize("value", ["missing.json", "a/b/config.json", "./Qwen/Qwen2.5-0.5B", "org/name/x",
                                   "dir/file.json", "org/model.yaml", "dir/CONFIG.JSON"])
def test_non_hub_paths_are_not_looked_up(value, monkeypatch):
    """A value that is no `org/name[@rev]` id stays a path: 'not found' as before, the Hub never asked."""
    def fail(*a, **k):
        raise AssertionError("the Hub was asked")
    monkeypatch.setattr("huggingface_hub.hf_hub_download", fail)
    assert hf.resolve_hf_config(value) == value


def test_local_path_wins_over_an_id(tmp_path, monkeypatch):
    """A folder named like an id (here ./org/name holding a config.json) is read as the folder."""
    (tmp_path / "org" / "name").mkdir(parents=True)
    shutil.copy(DATA / "gpt2.json", tmp_path / "org" / "name" / "config.json")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("huggingface_hub.hf_hub_download", lambda *a, **k: pytest.fail("the Hub was asked"))
    assert hf.resolve_hf_config("org/name") == "org/name"


def _error(name: str) -> Exception:
    """An instance of huggingface_hub's error class `name` (RemoteEntryNotFoundError: EntryNotFoundError
    in the releases before it), made without the HTTP response their constructors take."""
    from huggingface_hub import errors
    cls = getattr(errors, name, None) or getattr(errors, name.replace("Remote", ""))
    e = cls.__new__(cls)
    Exception.__init__(e, f"{name} raised")
    return e


@pytest.mark.parametrize("name,expect", [
    ("GatedRepoError", "'meta-llama/Llama-3.1-8B' is a gated repository: accept its terms on "
                       "huggingface.co/meta-llama/Llama-3.1-8B and set HF_TOKEN"),
    ("RepositoryNotFoundError", "'meta-llama/Llama-3.1-8B' is neither a local path nor a Hugging Face Hub "
                                "repository (a private one needs HF_TOKEN)"),
    ("RevisionNotFoundError", "repository meta-llama/Llama-3.1-8B has no revision"),
    ("RemoteEntryNotFoundError", "the repository has no config.json"),
])
def test_hub_failures_are_one_line(name, expect, monkeypatch):
    monkeypatch.setattr(hf, "_hub_unreachable", lambda: None)  # the Hub answers (the stand-in below)
    calls = []

    def download(repo, filename, revision=None, local_files_only=False):
        calls.append(local_files_only)
        if local_files_only:
            raise _error("LocalEntryNotFoundError")
        raise _error(name)
    monkeypatch.setattr("huggingface_hub.hf_hub_download", download)
    rev = "@nope" if name == "RevisionNotFoundError" else ""
    with pytest.raises(ValueError) as info:
        hf.resolve_hf_config(f"meta-llama/Llama-3.1-8B{rev}")
    msg = str(info.value)
    assert msg.startswith("--hf-config: ") and expect in msg and "\n" not in msg
    assert calls == [True, False]  # the cache first, then the Hub


def test_network_error_is_one_line(monkeypatch):
    monkeypatch.setattr(hf, "_hub_unreachable", lambda: None)
    def download(repo, filename, revision=None, local_files_only=False):
        if local_files_only:
            raise _error("LocalEntryNotFoundError")
        raise ConnectionError("connection refused\nsecond line")
    monkeypatch.setattr("huggingface_hub.hf_hub_download", download)
    with pytest.raises(ValueError, match=r"^--hf-config: cannot fetch the config.json of 'org/name' from the "
                                         r"Hugging Face Hub: ConnectionError: connection refused second line$"):
        hf.resolve_hf_config("org/name")


def test_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import raises ImportError
    with pytest.raises(ValueError, match=r"needs huggingface_hub \(pip install huggingface_hub"):
        hf.resolve_hf_config("Qwen/Qwen2.5-0.5B")


def test_api_plan_takes_a_hub_id(monkeypatch):
    """The notebook API: plan(hf_config=ID) is plan(hf_config=PATH) for the file the cache holds."""
    from distplan.planner.api import plan
    path = str(DATA / "llama-3.2-1b.json")
    seen = []

    def download(repo, filename, revision=None, local_files_only=False):
        seen.append((repo, filename, revision))
        return path
    monkeypatch.setattr("huggingface_hub.hf_hub_download", download)
    a = plan(hf_config="meta-llama/Llama-3.2-1B@main", gpus=8, gpu="h100-sxm", comm=False)
    b = plan(hf_config=path, gpus=8, gpu="h100-sxm", comm=False)
    assert seen == [("meta-llama/Llama-3.2-1B", "config.json", "main")]
    assert a.train.model.param_count() == b.train.model.param_count() == 1_235_814_400
    peaks = [{r.name: r.memory.peak_allocated for r in p.results} for p in (a, b)]
    assert len(peaks[0]) == 8 and peaks[0] == peaks[1]


def test_missing_relative_file_path_is_not_found(tmp_path):
    """`dir/file.json` is shaped like `org/name` but names a file: 'not found', never a Hub id (issue 62)."""
    cp = run_cli(tmp_path, "estimate", "--hf-config", "dir/file.json")
    assert cp.returncode == 2 and cp.stderr.strip() == "Error: --hf-config: file 'dir/file.json' not found"


def test_unreachable_hub_is_one_line_in_seconds(tmp_path):
    """No network (here: an endpoint that refuses), HF_HUB_OFFLINE not set: one line at once, where
    huggingface_hub retried for 26 s and printed 12 lines of retries (issue 62)."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE" and "proxy" not in k.lower()}
    env.update(HF_HUB_CACHE=str(tmp_path), HF_ENDPOINT="http://127.0.0.1:9")
    t0 = time.monotonic()
    cp = subprocess.run([sys.executable, "-m", "distplan.planner", "estimate", "--hf-config", "nonexistent-org/model"],
                        capture_output=True, text=True, env=env, timeout=120)
    assert time.monotonic() - t0 < 10
    lines = cp.stderr.strip().splitlines()
    assert cp.returncode == 2 and len(lines) == 1, cp.stderr
    assert lines[0].startswith("Error: --hf-config: 'nonexistent-org/model' is neither a local path nor in the "
                               "Hugging Face cache, and the Hub cannot be reached (127.0.0.1: ")


def test_a_hub_that_does_not_answer_is_given_up_quickly(monkeypatch):
    import socket

    def hang(*a, **k):  # no answer within the probe's 0.2 s; gone before the next test
        time.sleep(1)
        raise OSError("timed out")
    monkeypatch.setattr(socket, "create_connection", hang)
    monkeypatch.setattr(hf, "HUB_PROBE_S", 0.2)
    for v in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    t0 = time.monotonic()
    assert hf._hub_unreachable() == "huggingface.co: no answer in 0.2 s"
    assert time.monotonic() - t0 < 2
