"""Faults that lose nothing and leave nothing behind (issue 14): a real CPU probe (torchrun, gloo, 2 ranks)
killed by SIGTERM, SIGKILL, two Ctrl-C or its timeout leaves no process and no `distplan-probe-*` /
`torchelastic_*` folder in the private TMPDIR given to distplan; the zero3 CPU probe measures one peak
in 10 of 10 runs; a rendezvous that cannot happen fails in seconds with one line.
Everything that launches torchrun is marked slow."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distplan.validate import matrix as mx
from distplan.validate import runner
from distplan.validate.guard import _cmdline

_SCRIPT = os.path.join(os.path.dirname(sys.executable), "distplan")
DISTPLAN = [_SCRIPT] if os.path.exists(_SCRIPT) else [sys.executable, "-m", "distplan.planner.cli"]


def _user_code_module() -> str:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_user_code import _USER
    return _USER


def _state(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def processes_naming(marker: str) -> list[tuple[int, str]]:
    """Live processes (not zombies) whose command line contains `marker`."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            cmd = _cmdline(pid)
            if marker in cmd and _state(pid) not in ("Z", "gone"):
                out.append((int(pid), cmd))
    return out


def leftovers(tmp: Path) -> list[str]:
    return sorted(str(p) for pat in ("distplan-probe-*", "torchelastic_*") for p in tmp.rglob(pat))


def wait_for(cond, timeout: float, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(step)
    return cond()


@pytest.fixture
def private_tmp(tmp_path):
    d = tmp_path / "tmp"
    d.mkdir()
    return d


def _interruptible() -> None:
    """In the child before exec: SIGINT back to its default, as in a terminal where a user presses Ctrl-C.
    A shell without job control starts background commands with SIGINT ignored (`nohup pytest ... &`), the
    ignored disposition survives exec, and Python then installs no KeyboardInterrupt handler, so the
    Ctrl-C cases would test nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_validate(tmp: Path, out: Path, *args) -> subprocess.Popen:
    env = dict(os.environ, TMPDIR=str(tmp))
    return subprocess.Popen([*DISTPLAN, "validate", "--strategy", "ddp", "--out", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=str(out.parent),
                            preexec_fn=_interruptible)


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def workers_running(tmp: Path):
    """The torchrun workers of the probe: the children of its launcher (torchrun, or validate/launch.py's
    torchrun whose workers are forks of it and share its command line, which names the probe's folder in
    `tmp`)."""
    procs = processes_naming(str(tmp))
    launchers = {pid for pid, cmd in procs if "torch.distributed.run" in cmd or "distplan.validate.launch" in cmd}
    return [p for p in procs if "distplan.validate.probe" in p[1] and "distplan.validate.guard" not in p[1]
            and _ppid(p[0]) in launchers]


def assert_clean(tmp: Path, timeout: float = 20.0) -> None:
    left = wait_for(lambda: not processes_naming(str(tmp)) and not leftovers(tmp), timeout)
    assert not processes_naming(str(tmp)), processes_naming(str(tmp))
    assert not leftovers(tmp), leftovers(tmp)
    assert left is not None


pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to find processes")


# -- signals ---------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL", "SIGINT-twice"])
def test_killed_distplan_leaves_no_probe_and_no_folder(private_tmp, tmp_path, how):
    pytest.importorskip("torch")
    out = tmp_path / "r.jsonl"
    p = start_validate(private_tmp, out, "--timeout", "120")
    try:
        assert wait_for(lambda: len(workers_running(private_tmp)) >= 2, 90), "the probe's workers never started"
        assert leftovers(private_tmp)  # the probe's folder exists while it runs
        if how == "SIGINT-twice":
            p.send_signal(signal.SIGINT)
            time.sleep(0.05)
            p.send_signal(signal.SIGINT)
        else:
            p.send_signal(getattr(signal, how))
        rc = p.wait(timeout=60)
        text = p.stdout.read().decode(errors="replace")
        if how == "SIGTERM":
            assert rc == 128 + signal.SIGTERM and "terminated: 0 probes saved" in text, text
        elif how == "SIGKILL":
            assert rc == -signal.SIGKILL
        else:
            assert rc == 130, text
        assert_clean(private_tmp)
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.slow
def test_stopped_worker_killed_at_timeout(private_tmp, tmp_path):
    """A worker stopped (SIGSTOP) in a session of its own: the timeout still ends it, and the folders go."""
    pytest.importorskip("torch")
    out = tmp_path / "r.jsonl"
    p = start_validate(private_tmp, out, "--timeout", "25")
    try:
        ws = wait_for(lambda: workers_running(private_tmp), 60)
        assert ws, "no worker started"
        os.kill(ws[0][0], signal.SIGSTOP)
        rc = p.wait(timeout=120)
        text = p.stdout.read().decode(errors="replace")
        assert rc == 1, text
        rec = json.loads(out.read_text().splitlines()[-1])
        assert rec["status"] == "timeout", rec["measurement"].get("error")
        assert_clean(private_tmp, timeout=5)
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.slow
def test_finished_probe_leaves_no_torchelastic_folder(private_tmp, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "r.jsonl"
    p = start_validate(private_tmp, out, "--steps", "1")
    text = p.communicate(timeout=240)[0].decode(errors="replace")
    assert p.returncode == 0, text
    assert_clean(private_tmp, timeout=5)
    assert not list(private_tmp.iterdir()), list(private_tmp.iterdir())


# -- determinism -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_zero3_cpu_probe_measures_one_peak_in_10_runs(tmp_path):
    """zero3, llama-tiny, gloo, 2 ranks, identical inputs: before the gloo settle (validate/measure.py)
    this measured 8,518,500 B or 8,716,132 B from run to run, PASS or FAIL."""
    pytest.importorskip("torch")
    spec = mx.make_spec("zero3", dict(mx.SHAPES_CPU["llama-tiny"], name="llama-tiny"), 2, "cpu")
    recs = runner.run_validation([dict(spec) for _ in range(10)], str(tmp_path / "r.jsonl"), timeout_s=240)
    assert [r["status"] for r in recs] == ["ok"] * 10, [r["measurement"].get("error") for r in recs]
    peaks = {r["measurement"]["memory"]["peak_allocated"] for r in recs}
    ranks = {tuple(r["measurement"]["memory"]["per_rank_peak_allocated"]) for r in recs}
    comps = {json.dumps(r["measurement"]["memory"]["components"], sort_keys=True) for r in recs}
    assert len(peaks) == 1 and len(ranks) == 1 and len(comps) == 1, (peaks, ranks)
    assert len({r["verdict"] for r in recs}) == 1
    assert not any(r["measurement"]["memory"].get("gloo_settle_timeouts") for r in recs)


# -- rendezvous --------------------------------------------------------------------------------------

def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_worker_fails_fast_in_one_line_when_the_store_is_unreachable(monkeypatch):
    """What a torchrun worker does before init_process_group: an endpoint nobody listens on is one line
    after the limit, not the probe's whole timeout and a C++ stack."""
    from distplan.validate.probe import check_rendezvous

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_closed_port()))
    t0 = time.monotonic()
    with pytest.raises(ConnectionError) as e:
        check_rendezvous(limit_s=1.0)
    assert time.monotonic() - t0 < 5
    assert str(e.value).count("\n") == 0 and "rendezvous: cannot connect to 127.0.0.1:" in str(e.value)


def test_torchrun_rendezvous_failure_is_one_line():
    stderr = ("[E socket.cpp:818] [c10d] The client socket has failed to connect to any network address of "
              "(127.0.0.1, 40909).\nframe #0: c10::Error::Error(...)\n" * 3
              + "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the "
                "C10d store has failed. See inner exception for details.\n")
    assert runner._rendezvous_failure(stderr) == ("rendezvous failed: cannot connect to 127.0.0.1, 40909 "
                                                  "(see stderr_tail)")
    assert runner._rendezvous_failure("RuntimeError: something else") is None
    assert runner.check_loopback() is None  # this machine has a loopback


def test_crash_reason_names_the_root_of_a_chained_error():
    """torch.distributed.pipelining re-raises a stage's failure as "Failed to run stage backward" from the
    real error: the probe's one-line reason carries both; a plain error stays one line of its own."""
    chained = ("[rank1]: Traceback (most recent call last):\n"
               "[rank1]:   File \"x.py\", line 1, in f\n"
               "[rank1]: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer\n"
               "[rank1]: \n"
               "[rank1]: The above exception was the direct cause of the following exception:\n"
               "[rank1]: Traceback (most recent call last):\n"
               "[rank1]: RuntimeError: \n"
               "[rank1]:         Failed to run stage backward:\n"
               "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    reason = runner._last_error_line(chained)
    assert reason.startswith("RuntimeError: Failed to run stage backward:") and reason.endswith(
        "caused by RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert runner._last_error_line("Traceback\nValueError: bad shape\n") == "ValueError: bad shape"


def _unshare() -> bool:
    return bool(shutil.which("unshare")) and subprocess.run(["unshare", "-rn", "true"],
                                                            capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _unshare(), reason="needs unshare -rn (a network namespace) to take the network away")
def test_no_network_probe_runs_and_no_loopback_fails_in_seconds(private_tmp, tmp_path):
    """In a network namespace with only the loopback up (no network at all), the CPU probe runs; with the
    loopback down too, validate fails at once with one line instead of waiting for --timeout."""
    pytest.importorskip("torch")
    env = dict(os.environ, TMPDIR=str(private_tmp))
    cmd = " ".join([*DISTPLAN, "validate", "--strategy", "ddp", "--steps", "1", "--timeout", "200"])
    up = subprocess.run(["unshare", "-rn", "sh", "-c", f"ip link set lo up && {cmd} --out {tmp_path}/a.jsonl"],
                        capture_output=True, text=True, env=env, timeout=240)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
    t0 = time.monotonic()
    down = subprocess.run(["unshare", "-rn", "sh", "-c", f"{cmd} --out {tmp_path}/b.jsonl"],
                          capture_output=True, text=True, env=env, timeout=240)
    took = time.monotonic() - t0
    assert down.returncode == 1 and took < 30, (took, down.stderr)
    errors = [ln for ln in (down.stdout + down.stderr).splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "127.0.0.1" in errors[0] and "loopback" in errors[0], down.stderr
    assert "frame #" not in down.stdout + down.stderr


# -- the results file: nothing of the user's lost, a full disk one line (issue 62, items 1 and 6) ------

_HERE = Path(__file__).resolve().parent
_FAKE_PROBE = f"{sys.executable} {_HERE / 'fake_probe.py'}"
_CPU_HW = {"torch_version": "0.0-fake", "gpus": 0, "gpu_names": [], "gpu_memory_bytes": [], "bf16": True,
           "cpu_count": 2, "ram_bytes": 8 * 2**30}


@pytest.fixture
def fake_validate(monkeypatch, tmp_path):
    """`distplan validate --probe-cmd tests/fake_probe.py ...` through the command group (its one-line
    errors and exit codes), on a machine detected as a 2-core CPU; the prediction is not judged here."""
    from click.testing import CliRunner
    from distplan.planner.cli import main
    monkeypatch.setattr(runner, "detect_hardware", lambda *a, **k: dict(_CPU_HW))
    spec = importlib.util.spec_from_file_location("fake_probe", _HERE / "fake_probe.py")
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)

    def exact(spec):  # the prediction that matches what fake_probe measures
        r = fake.result_for(spec)
        return {"memory": dict(r["memory"]["components"], peak_allocated=r["memory"]["peak_allocated"],
                               peak_phase="optimizer"), "collectives": r["collectives"], "step_time_s": None}
    monkeypatch.setattr(runner, "default_predict", exact)
    monkeypatch.chdir(tmp_path)

    def invoke(*args):
        r = CliRunner().invoke(main, ["validate", "--probe-cmd", _FAKE_PROBE, *args])
        assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit), r.output
        return r
    return invoke


def _one_line(output: str) -> str:
    lines = [ln for ln in output.splitlines() if ln.strip()]
    assert len(lines) == 1, output
    return lines[0]


@pytest.mark.parametrize("content", [
    b'{"id": "abc", "payload": [1, 2, 3',  # a lone line cut short: the user's, not a record cut mid-write
    b'{"id": "abc", "status": "done"}\n{"id": "def", "status": "open"}\n',  # id and status: still foreign
    b'{"id": "abc", "status": "done"}\n{"id": "de',
    b'{"id": ',
    b'{"',
])
def test_a_foreign_file_is_refused_byte_identical(fake_validate, tmp_path, content):
    f = tmp_path / "broken.json"
    f.write_bytes(content)
    r = fake_validate("--strategy", "ddp", "--steps", "1", "--out", str(f))
    assert r.exit_code == 2, r.output
    line = _one_line(r.output)
    assert line.startswith("Error: --out=") and "not a distplan validate results file" in line
    assert f.read_bytes() == content


def test_results_written_carry_the_schema_key_and_resume(fake_validate, tmp_path):
    from distplan.validate.results import SCHEMA, read_records
    out = tmp_path / "r.jsonl"
    assert fake_validate("--strategy", "ddp", "--out", str(out)).exit_code == 0
    lines = out.read_bytes().splitlines()
    assert len(lines) == 1 and lines[0].startswith(b'{"schema": "' + SCHEMA.encode() + b'", "id": ')
    with open(out, "ab") as f:
        f.write(lines[0][:60])  # killed mid-write: cut on the next run
    r = fake_validate("--strategy", "ddp,zero3", "--out", str(out), "--resume")
    assert r.exit_code == 0, r.output
    assert [x["inputs"]["strategy"] for x in read_records(str(out))] == ["ddp", "zero3"]


def test_committed_results_files_are_ours(tmp_path):
    """Every benchmarks/results file `distplan validate` wrote (before the schema key) is still one it
    appends to and resumes; a copy of one cut mid-record is repaired."""
    from distplan.validate.results import ResultsFile, _not_ours
    root = _HERE.parent / "benchmarks" / "results"
    written = [p for p in sorted(root.glob("*.jsonl")) if b'"verdict"' in p.read_bytes()]
    assert len(written) >= 30
    for p in written:
        assert _not_ours(str(p)) is None, p
    copy = tmp_path / "copy.jsonl"
    data = written[0].read_bytes()
    copy.write_bytes(data + data.splitlines()[0][:50])
    assert ResultsFile(str(copy)).repaired_bytes == 50 and copy.read_bytes() == data


def test_disk_full_is_one_line_and_the_records_before_it_stay(fake_validate, tmp_path, monkeypatch):
    import errno
    from distplan.validate import results
    out = tmp_path / "r.jsonl"
    assert fake_validate("--strategy", "ddp", "--out", str(out)).exit_code == 0
    before = out.read_bytes()
    real_write = os.write

    def full(fd, data):  # the first bytes reach the disk, then it is full
        if len(data) > 100:
            real_write(fd, bytes(data[:100]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)
    monkeypatch.setattr(results.os, "write", full)
    r = fake_validate("--strategy", "zero3", "--out", str(out))
    assert r.exit_code == 1, r.output
    line = [ln for ln in r.output.splitlines() if ln.startswith("Error")]
    assert len(line) == 1 and "No space left on device" in line[0] and "--resume" in line[0], r.output
    assert "Traceback" not in r.output
    assert out.read_bytes() == before  # the part of the line that reached the disk is cut
    monkeypatch.setattr(results.os, "write", real_write)
    assert fake_validate("--strategy", "ddp,zero3", "--out", str(out), "--resume").exit_code == 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_dev_full_as_results_file_is_one_line():
    from distplan.validate.results import ResultsFile, ResultsWriteError
    rf = ResultsFile.__new__(ResultsFile)  # past check_results_path, which refuses a device
    rf.path, rf.appended = "/dev/full", 0
    with pytest.raises(ResultsWriteError, match="No space left on device") as e:
        rf.append({"id": "a", "status": "ok"})
    assert "\n" not in str(e.value)


# -- probes bigger than the machine are refused before they start (issue 62, item 3) ------------------

_WIDE = """
import torch.nn as nn

def wide():
    return nn.Sequential(nn.Linear(40_000, 40_000), nn.Linear(40_000, 8))
"""


@pytest.mark.parametrize("args, words", [
    (["--strategy", "ddp", "--micro-batch", "20000"], ["--micro-batch=20000 --seq-len=64", "per rank", "RAM"]),
    (["--strategy", "ddp", "--seq-len", "1000000000"], ["--seq-len=1000000000", "accepted: an integer from 1 to"]),
    (["--strategy", "ddp", "--seq-len", "1e9"], ["--seq-len='1e9'", "accepted: an integer from 1 to"]),
    (["--strategy", "ddp", "--nproc", "1000"], ["--nproc=1000", "2 CPU cores", "accepted: 1..8"]),
    (["--strategy", "ddp", "--module", "wide_for_62:wide", "--input-shape", "4,40000"],
     ["--module=wide_for_62:wide", "per rank", "RAM"]),
])
def test_a_probe_bigger_than_the_machine_is_refused_before_it_starts(fake_validate, tmp_path, monkeypatch, args,
                                                                      words):
    (tmp_path / "wide_for_62.py").write_text(_WIDE)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "r.jsonl"
    for dry in ([], ["--dry-run"]):
        r = fake_validate(*args, *dry, "--out", str(out))
        assert r.exit_code == 2, r.output
        line = _one_line(r.output)
        assert line.startswith("Error: ") and "distplan validate:" not in r.output
        for w in words:
            assert w in line, (w, line)
        assert not out.exists()


# -- user code before any probe: bounded by --timeout, its exit one line (issue 62, item 5, in part) -----

_USER = """
import os, time
import torch.nn as nn

def hangs():
    time.sleep(3600)

def exits3():
    os._exit(3)

def fine():
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
"""


@pytest.mark.parametrize("factory, words", [("hangs", ["did not return in 3 s (--timeout)"]),
                                            ("exits3", ["ended the process (exit code 3)"])])
def test_user_code_that_hangs_or_exits_is_one_line(fake_validate, tmp_path, monkeypatch, factory, words):
    (tmp_path / "user_for_62.py").write_text(_USER)
    monkeypatch.syspath_prepend(str(tmp_path))
    import torch  # noqa: F401  (imported before the clock starts, as validate does before its child)
    t0 = time.monotonic()
    r = fake_validate("--strategy", "ddp", "--module", f"user_for_62:{factory}", "--input-shape", "4,8",
                      "--timeout", "3", "--dry-run", "--out", str(tmp_path / "r.jsonl"))
    assert time.monotonic() - t0 < 30
    assert r.exit_code == 2, r.output
    line = _one_line(r.output)
    assert line.startswith(f"Error: --module='user_for_62:{factory}': ")
    for w in words:
        assert w in line, line
    r = fake_validate("--strategy", "ddp", "--module", "user_for_62:fine", "--input-shape", "4,8", "--timeout", "60",
                      "--dry-run", "--out", str(tmp_path / "r.jsonl"))
    assert r.exit_code == 0, r.output


def test_a_process_the_probe_leaves_in_a_new_session_is_reaped(fake_validate, tmp_path, monkeypatch, private_tmp):
    """The probe starts a process in a session of its own whose parent exits (its command line names
    nothing of the probe): the guard, its subreaper, kills it when the probe ends (issue 62, item 5)."""
    pidfile = tmp_path / "orphan.pid"
    monkeypatch.setenv("DISTPLAN_FAKE_PROBE", json.dumps({"behavior": "orphan", "pidfile": str(pidfile)}))
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    try:
        r = fake_validate("--strategy", "ddp", "--timeout", "60", "--out", str(tmp_path / "r.jsonl"))
        assert r.exit_code == 0, r.output
        orphan = int(pidfile.read_text())
        assert wait_for(lambda: _state(str(orphan)) in ("Z", "gone"), 10), _cmdline(str(orphan))
        assert not leftovers(private_tmp)
    finally:
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


# the user module of tests/test_user_code.py: its `forks` factory starts an orphan in a session of its own and a
# new session's process, notes both in $U62_PIDS and leaves a file in TMPDIR
_FORKS = _user_code_module()


def test_validate_user_code_that_forks_leaves_no_process_or_folder(fake_validate, tmp_path, monkeypatch,
                                                                   private_tmp):
    """validate's check of --module and its predictions run the factory in bounded children: what it
    starts (an orphan in a new session, a new session's process) and leaves in TMPDIR is gone after the
    run (issue 62, item 5)."""
    import tempfile
    (tmp_path / "forks_for_62.py").write_text(_FORKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    pids = tmp_path / "pids"
    monkeypatch.setenv("U62_PIDS", str(pids))
    try:
        r = fake_validate("--strategy", "ddp", "--module", "forks_for_62:forks", "--input-shape", "4,8",
                          "--timeout", "60", "--dry-run", "--out", str(tmp_path / "r.jsonl"))
        assert r.exit_code == 0, r.output
        noted = [int(x) for x in pids.read_text().split()]
        assert len(noted) >= 4, noted  # the check and the prediction each ran the factory
        assert [(p, _ppid(p), _state(str(p))) for p in noted if _state(str(p)) not in ("Z", "gone")] == [], noted
        assert [str(p) for p in private_tmp.rglob("*") if p.name.startswith("distplan-user-")
                or p.name == "left-by-user-code.txt"] == []
    finally:
        sys.modules.pop("forks_for_62", None)
        for p in (pids.read_text().split() if pids.exists() else []):
            try:
                os.kill(int(p), signal.SIGKILL)
            except ProcessLookupError:
                pass
