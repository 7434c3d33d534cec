"""validate/warm.py: one-process CPU probes forked from a process that has imported torch and the probe."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from distplan.validate import warm
from distplan.validate.runner import warm_startable

MOD = '''
import os, signal, sys
def main(argv):
    if argv[0] == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    print("out", os.getpid(), signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    sys.exit(int(argv[0]))
'''


def test_fork_module_runs_main_and_reports_its_status(tmp_path, monkeypatch):
    (tmp_path / "warm_mod.py").write_text(MOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    child = warm.fork_module([sys.executable, "-m", "warm_mod", "5"])
    assert isinstance(child, warm.Forked) and child.wait() == 5 and child.poll() == 5
    # killed by a signal: -N, as subprocess.Popen reports it (the handler is the default one again)
    old = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        assert warm.fork_module([sys.executable, "-m", "warm_mod", "term"]).wait() == -signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, old)
    # anything but `python -m MODULE` is a new process
    other = warm.fork_module(["/bin/sh", "-c", "exit 3"])
    assert isinstance(other, subprocess.Popen) and other.wait() == 3


def test_cpu_probes_are_warm_started_on_one_node():
    assert warm_startable({"mode": "fake", "device_type": "cpu"})
    assert warm_startable({"mode": "fake"})
    assert not warm_startable({"mode": "fake", "device_type": "cuda"})
    assert not warm_startable({"mode": "fake", "pp": 2})
    # gloo: the launcher (validate/launch.py) is the fork, its torchrun workers forks of it; one node only
    assert warm_startable({"mode": "cpu", "world_size": 2})
    assert warm_startable({"mode": "cpu", "world_size": 2, "pp": 2})
    assert not warm_startable({"mode": "cpu", "world_size": 4}, nnodes=2)
    assert not warm_startable({"mode": "gpu", "world_size": 2})


DISTPLAN = [sys.executable, "-m", "distplan.planner"]


def _validate(tmp_path, name: str, env: dict, *args, world=("--simulate-world-size", "8"),
              strategies="zero2,zero3,fsdp") -> list[dict]:
    out = tmp_path / f"{name}.jsonl"
    proc = subprocess.run([*DISTPLAN, "validate", "--strategy", strategies, "--layers", "2", *world,
                           "--out", str(out), *args], capture_output=True,
                          text=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES="", **env), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["id"])


@pytest.mark.slow
def test_warm_started_probes_measure_what_new_interpreters_measure(tmp_path):
    pytest.importorskip("torch")
    hot = _validate(tmp_path, "warm", {})
    cold = _validate(tmp_path, "cold", {"DISTPLAN_WARM_START": "0"})
    assert [r["id"] for r in hot] == [r["id"] for r in cold] and len(hot) == 3
    for h, c in zip(hot, cold):
        assert h["measurement"].get("warm_start") is True and "warm_start" not in c["measurement"]
        assert h["status"] == c["status"] == "ok"
        hm, cm = h["measurement"]["memory"], c["measurement"]["memory"]
        assert hm["peak_allocated"] == cm["peak_allocated"] and hm["peak_phase"] == cm["peak_phase"]
        assert h["measurement"]["collectives"] == c["measurement"]["collectives"]


@pytest.mark.slow
def test_warm_started_gloo_probes_measure_what_new_interpreters_measure(tmp_path):
    """2-rank gloo probes whose launcher is a fork of the warm process (and its torchrun workers forks of
    that): every rank's peak, phase and collectives as with `python -m distplan.validate.launch`."""
    pytest.importorskip("torch")
    hot = _validate(tmp_path, "warm", {}, world=(), strategies="ddp,zero3")
    cold = _validate(tmp_path, "cold", {"DISTPLAN_WARM_START": "0"}, world=(), strategies="ddp,zero3")
    assert [r["id"] for r in hot] == [r["id"] for r in cold] and len(hot) == 2
    for h, c in zip(hot, cold):
        assert h["inputs"]["mode"] == "cpu" and h["inputs"]["world_size"] == 2
        assert h["measurement"].get("warm_start") is True and "warm_start" not in c["measurement"]
        assert h["status"] == c["status"] == "ok" and h["verdict"] == c["verdict"] == "PASS"
        hm, cm = h["measurement"]["memory"], c["measurement"]["memory"]
        assert hm["peak_allocated"] == cm["peak_allocated"] and hm["peak_phase"] == cm["peak_phase"]
        assert h["measurement"]["measured_ranks"] == c["measurement"]["measured_ranks"]
        assert h["measurement"]["collectives"] == c["measurement"]["collectives"]


def _naming(marker: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            out.append(int(pid))
    return out


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to find processes")
@pytest.mark.parametrize("world, forks", [(["--simulate-world-size", "8"], 3), ([], 5)], ids=["fake-pg", "gloo"])
def test_killed_distplan_leaves_no_warm_process_probe_or_folder(tmp_path, world, forks):
    """SIGKILL to distplan while a warm-started probe runs: the warm process dies with it (its
    PR_SET_PDEATHSIG), each guard then kills its probe (a gloo probe: the launcher and its torchrun
    workers, all forks) and removes the probe's folder."""
    pytest.importorskip("torch")
    private = tmp_path / "tmp"
    private.mkdir()
    out = tmp_path / "r.jsonl"
    p = subprocess.Popen([*DISTPLAN, "validate", "--strategy", "zero2,zero3", "--layers", "4", "--hidden", "512",
                          "--heads", "8", "--kv-heads", "8", "--ffn-hidden", "2048", "--seq-len", "512",
                          "--micro-batch", "4", *world, "--out", str(out)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env=dict(os.environ, TMPDIR=str(private), CUDA_VISIBLE_DEVICES=""))
    marker = f"distplan.validate.warm {p.pid}"
    try:
        # every fork shows the warm process's command line: warm process, guard, probe (gloo: the launcher
        # and its 2 workers)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(_naming(marker)) < forks:
            time.sleep(0.1)
        assert len(_naming(marker)) >= forks, "no warm-started probe ran"
        assert list(private.glob("distplan-probe-*"))
        p.kill()
        p.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (_naming(marker) or list(private.glob("distplan-probe-*"))):
            time.sleep(0.1)
        assert not _naming(marker)
        assert not list(private.glob("distplan-probe-*"))
    finally:
        if p.poll() is None:
            p.kill()
        for pid in _naming(marker):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_warm_proc_waits_as_popen_does(tmp_path):
    """`WarmProc.wait(timeout)`, which the runner's reap calls after killing a probe's stragglers: Popen's
    TimeoutExpired while the guard runs, its return code once it has ended. (Without the parameter, a
    gloo probe whose fork server outlived its launcher by a moment ended `distplan validate` in a
    TypeError: 2026-11-28, the live HF Llama in CI.)"""
    pytest.importorskip("torch")
    from distplan.validate.warm import WarmStarter

    (tmp_path / "sleepy_mod.py").write_text("import time\n\ndef main(argv):\n    time.sleep(float(argv[0]))\n"
                                           "    return 3\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    starter = WarmStarter(env)
    try:
        probe_dir = tmp_path / "probe"
        probe_dir.mkdir()
        proc = starter.start([str(probe_dir), "--", sys.executable, "-m", "sleepy_mod", "3"], env,
                             str(tmp_path / "out.log"), str(tmp_path / "err.log"))
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        assert proc.wait(timeout=120) == 3, (tmp_path / "err.log").read_text()[-2000:]
        assert proc.poll() == 3
    finally:
        starter.close()


def test_the_warm_process_leaves_nothing_in_the_users_temp_folder(tmp_path):
    """Its preload imports torch._dynamo, which makes inductor's cache folder under $TMPDIR: in a folder of
    the warm process's own, removed by close() (a multi-probe validate left $TMPDIR/torchinductor_root)."""
    from distplan.validate.probe_run import probe_base_env
    starter = warm.WarmStarter(dict(probe_base_env(), TMPDIR=str(tmp_path)))
    own = starter._tmp
    starter.close()  # its preload runs before it reads the closed pipe
    assert starter.proc.returncode == 0
    assert list(tmp_path.iterdir()) == [] and not os.path.exists(own)
