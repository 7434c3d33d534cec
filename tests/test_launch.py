"""validate/launch.py: torchrun with workers forked from a launcher that has imported what they run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from distplan.validate import launch
from distplan.validate.runner import launcher, local_rendezvous, probe_argv

WORKER = '''
import json, os, signal, sys
PRELOADED = None

def preload(argv):
    global PRELOADED
    import torch.distributed  # noqa: F401 - what a probe's workers use
    PRELOADED = os.getpid()

def _proc(pid, field):
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(field + ":")))

def main(argv):
    out, fail_rank = argv[0], int(argv[1])
    rank = int(os.environ["RANK"])
    if fail_rank == -2:  # hang
        import time
        time.sleep(3600)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(dict(rank=rank, world=int(os.environ["WORLD_SIZE"]), local_rank=int(os.environ["LOCAL_RANK"]),
                       master=os.environ["MASTER_ADDR"], preloaded_by=PRELOADED, pid=os.getpid(),
                       ppid=os.getppid(), parent_threads=_proc(os.getppid(), "Threads"),
                       grandparent=_proc(os.getppid(), "PPid"), argv=argv,
                       sigterm=signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                       sigint=signal.getsignal(signal.SIGINT) is signal.default_int_handler), f)
    return 3 if rank == fail_rank else 0
'''


def test_split_and_torchrun_argv():
    opts, mod, args = launch.split_argv(["--nnodes=1", "--nproc-per-node=2", "-m", "pkg.mod", "--spec", "x"])
    assert (opts, mod, args) == (["--nnodes=1", "--nproc-per-node=2"], "pkg.mod", ["--spec", "x"])
    argv = launch.torchrun_argv(opts, mod, args)
    assert argv[:4] == ["--nnodes=1", "--nproc-per-node=2", "--start-method=fork", "--run-path"]
    assert os.path.isabs(argv[4]) and argv[4].endswith("launch.py")
    assert argv[5:] == [launch.WORKER_FLAG, "pkg.mod", "--spec", "x"]
    with pytest.raises(ValueError):
        launch.split_argv(["--nnodes=1"])


def test_cpu_probes_use_the_launcher_and_gpus_torchrun():
    assert launcher("cpu") == launch.__name__ and launcher("gpu") == "torch.distributed.run"
    assert launcher("cpu", nnodes=2) == "torch.distributed.run"
    cpu = probe_argv({"mode": "cpu", "world_size": 2}, "s.json", "o.json")
    assert cpu[1:3] == ["-m", launch.__name__] and "--nproc-per-node=2" in cpu
    gpu = probe_argv({"mode": "gpu", "world_size": 2}, "s.json", "o.json")
    assert gpu[1:3] == ["-m", "torch.distributed.run"]


def _launch(tmp_path, fail_rank: int, **env_extra) -> tuple[subprocess.CompletedProcess, dict]:
    pytest.importorskip("torch")
    (tmp_path / "fork_worker_mod.py").write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", **env_extra)
    cmd = [sys.executable, "-m", launch.__name__, *local_rendezvous(), "--nproc-per-node=2", "-m",
           "fork_worker_mod", str(out), str(fail_rank)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    ranks = {}
    for p in out.glob("rank*.json"):
        r = json.loads(p.read_text())
        ranks[r["rank"]] = r
    return proc, ranks


def test_workers_are_forks_of_the_preloaded_launcher_with_torchruns_environment(tmp_path):
    proc, ranks = _launch(tmp_path, fail_rank=-1)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(ranks) == [0, 1]
    for rank, r in ranks.items():
        assert (r["world"], r["local_rank"], r["master"]) == (2, rank, "127.0.0.1")
        assert r["argv"] == [str(tmp_path / "out"), "-1"]
        # forked from a fork of the process that ran preload() (torchrun's agent, this launcher), not a new
        # interpreter: multiprocessing's fork server, forked by the launcher before torchrun started any
        # thread, so that the worker's fork copies one thread and no lock another thread held
        assert r["preloaded_by"] == r["grandparent"] != r["ppid"] != r["pid"]
        assert r["parent_threads"] == 1
        # a new interpreter's signal handlers, not the agent's (which turn SIGTERM into an exception)
        assert r["sigterm"] and r["sigint"]


def test_without_the_fork_server_torchrun_forks_the_workers(tmp_path):
    """DISTPLAN_FORK_SERVER=0: the launcher itself (torchrun's agent, its threads running) is the parent."""
    proc, ranks = _launch(tmp_path, fail_rank=-1, DISTPLAN_FORK_SERVER="0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(ranks) == [0, 1]
    for r in ranks.values():
        assert r["preloaded_by"] == r["ppid"] != r["pid"] and r["parent_threads"] > 1


def test_a_failing_worker_fails_the_launch_as_torchrun_does(tmp_path):
    proc, ranks = _launch(tmp_path, fail_rank=1)
    assert proc.returncode != 0
    assert "ChildFailedError" in proc.stderr and "exitcode" in proc.stderr and ": 3" in proc.stderr


def test_method_name_is_torchs_get_method_name_without_inspect_stack():
    """launch.py replaces the rendezvous's event-name helper (its two inspect.stack() calls walk sys.modules
    for every frame: ~1 s per probe with torch._dynamo imported); the names must stay the same."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import get_method_name

    def caller(depth):
        return get_method_name(depth), launch.method_name(depth)

    def outer():
        return caller(2)

    assert outer() == ("outer", "outer")
    assert caller(1) == ("caller", "caller")
    assert caller(10_000) == ("no_method_name", "no_method_name")


@pytest.mark.slow
def test_a_hung_probe_ends_with_every_workers_stack(tmp_path):
    """A worker that never returns: the runner's timeout ends the probe, and shortly before it each worker
    printed its Python stack (faulthandler, runner.STACKS_AT_ENV), so the record says where it waited."""
    pytest.importorskip("torch")
    from distplan.validate.runner import run_probe, stacks_after_s

    (tmp_path / "fork_worker_mod.py").write_text(WORKER)
    (tmp_path / "out").mkdir()
    cmd = [sys.executable, "-m", launch.__name__, *local_rendezvous(), "--nproc-per-node=2", "-m",
           "fork_worker_mod", str(tmp_path / "out"), "-2"]
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    assert stacks_after_s(300) == 280 and stacks_after_s(20) == 18
    # 30 s: the workers reach main() within the 27 s before their dump even on a busy 2-core machine
    result = run_probe({"id": "hang", "mode": "cpu", "world_size": 2}, cmd, timeout_s=30, env=env)
    assert result["status"] == "timeout", result
    stacks = result["hung_stacks"]
    assert stacks.count("\n--\n") == 1, stacks  # two workers' dumps
    for dump in stacks.split("\n--\n"):
        innermost = dump.splitlines()[1]  # the thread's line, then its most recent call
        assert 'fork_worker_mod.py", line' in innermost and innermost.endswith("in main"), dump
