"""torchrun whose workers are forks of a launcher that has already imported what they run (CPU probes).

    python -m distplan.validate.launch [torchrun options] -m MODULE [ARGS...]

torchrun (`torch.distributed.run`) starts each worker of a `-m MODULE` command as a new Python
interpreter, which imports torch, FSDP and DTensor once more: about 5 s of CPU per worker on a 2-core
machine, most of a small gloo probe's 9-13 s. This launcher imports MODULE and what its run imports
(`MODULE.preload(argv)`, where MODULE has one) once, then runs torchrun itself, in this process
(`torch.distributed.run.main`), with `--run-path` (torchrun's own option: the training script runs as a
function in the worker, `run_script_path`) and `--start-method=forkserver` (torchrun's option: the
workers are forks of `multiprocessing`'s fork server, which here is itself a fork of this process,
taken before torchrun starts its threads: `start_forkserver`). Everything else is torchrun's: the elastic
agent, the c10d rendezvous, each worker's RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT,
failure detection (a worker that exits non-zero stops the others and torchrun exits 1 with its
ChildFailedError).

The script torchrun runs in each worker is this file (`_worker` below, chosen by `argv[1] == "--worker"`):
it calls `MODULE.main(ARGS)` and exits with its return code, as `python -m MODULE` would.

Used for `distplan validate`'s CPU (gloo) probes, `validate/runner.py`. GPU probes keep the plain
`torchrun -m`: nothing here initialises CUDA, so a fork would be safe, but that path is validated on the
GPU as it is.

Known limitations: the workers inherit the launcher's interpreter state (imported modules, the
`warnings` filters); a MODULE without `main(argv) -> int` cannot be run this way.
"""

from __future__ import annotations

import importlib
import os
import sys

from distplan.validate.guard import fresh_signals, set_pdeathsig
from distplan.validate.preload import preload_module
from distplan.validate.probe_run import STACKS_AT_ENV

WORKER_FLAG = "--worker"


def split_argv(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """(torchrun options, MODULE, ARGS) of `[options] -m MODULE [ARGS]`."""
    if "-m" not in argv:
        raise ValueError("usage: python -m distplan.validate.launch [torchrun options] -m MODULE [ARGS...]")
    i = argv.index("-m")
    if i + 1 >= len(argv):
        raise ValueError("-m needs a module name")
    return argv[:i], argv[i + 1], argv[i + 2:]


def torchrun_argv(options: list[str], module: str, args: list[str], start_method: str = "fork") -> list[str]:
    """torchrun's own command line: run this file in forked workers, which run MODULE."""
    return [*options, f"--start-method={start_method}", "--run-path", os.path.abspath(__file__), WORKER_FLAG,
            module, *args]


def start_forkserver() -> bool:
    """Start `multiprocessing`'s fork server as a fork of this process, now, while it runs one thread.

    torchrun forks its workers (`--start-method=fork`) after its rendezvous, when the launcher runs
    other threads too: the c10d store's server thread, the rendezvous keep-alive timer. A fork copies
    whatever locks those threads hold at that instant, and a worker that then needs one waits forever (the
    hazard `os.fork`'s documentation warns of, and Python 3.12 warns about at run time). With the fork
    server (`--start-method=forkserver`) each worker is instead a fork of the server, a process with one
    thread that holds no lock. `multiprocessing.forkserver` starts that server as a new interpreter
    (`util.spawnv_passfds`), which would import torch and the probe once more; here its start runs as a
    fork of this launcher, taken before torchrun starts anything: the server's code
    (`forkserver.main`, with the listening socket and the "alive" pipe of `ForkServer.ensure_running`)
    runs in the fork, with every file descriptor but those two and the standard streams closed (the
    write end of the "alive" pipe among them: the server exits when every client has closed it). The
    server dies with this launcher (PR_SET_PDEATHSIG), and the workers with the server (probe.py's
    `_die_with_launcher`). False, and nothing started, where this Python's `multiprocessing` differs (the
    workers are then forked by torchrun as before)."""
    import multiprocessing.forkserver as forkserver
    import multiprocessing.resource_tracker as resource_tracker
    import multiprocessing.util as util

    spawn = getattr(util, "spawnv_passfds", None)
    if spawn is None or not hasattr(forkserver, "ensure_running") or getattr(forkserver, "_forkserver", None) is None:
        return False
    resource_tracker.ensure_running()  # a new (small) interpreter, as multiprocessing starts it
    util.spawnv_passfds = _fork_passfds
    try:
        forkserver.ensure_running()
    except Exception:  # noqa: BLE001 - this Python's forkserver is not what _fork_passfds expects
        return False
    finally:
        util.spawnv_passfds = spawn
    return True


def _fork_passfds(path: str, args: list[str], passfds) -> int:
    """`multiprocessing.util.spawnv_passfds` for the fork server only (`start_forkserver`): a fork that
    runs the `-c` code of `args` (the server's `main(...)` call) instead of exec'ing a new interpreter."""
    if "-c" not in args:
        raise ValueError("not a `python -c` command")
    code = args[args.index("-c") + 1]
    keep = sorted({0, 1, 2, *map(int, passfds)})
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        import signal

        fresh_signals()
        if set_pdeathsig(signal.SIGKILL) and os.getppid() != parent:
            os._exit(1)  # the launcher died before prctl took effect
        lo = 0
        for fd in keep + [1 << 20]:
            if fd > lo:
                os.closerange(lo, fd)
            lo = fd + 1
        exec(code, {"__name__": "__forkserver__"})
        status = 0
    except SystemExit as e:  # forkserver.main's way out: every client closed the "alive" pipe
        status = e.code if isinstance(e.code, int) else 0
    except BaseException:  # noqa: BLE001 - a fork must never return into its parent's code
        import traceback

        traceback.print_exc()
    finally:
        os._exit(status)


def preload(argv: list[str]) -> None:
    """Import what `[torchrun options] -m MODULE ARGS` will run (`MODULE.preload(ARGS)`, where MODULE has
    one): validate/warm.py calls it before forking a launcher, so that a launcher forked from the warm
    process starts with it too."""
    try:
        _, module, args = split_argv(list(argv))
    except ValueError:
        return  # main() reports it
    preload_module(module, args)
    importlib.import_module("torch.distributed.run")  # torchrun itself, and its elastic agent
    importlib.import_module("torch.distributed.elastic.rendezvous.dynamic_rendezvous")



def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        options, module, args = split_argv(argv)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    preload_module(module, args)
    from torch.distributed import run
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = method_name
    # DISTPLAN_FORK_SERVER=0: torchrun forks the workers itself, as before 2026-11-28 (for comparisons)
    method = "forkserver" if os.environ.get("DISTPLAN_FORK_SERVER") != "0" and start_forkserver() else "fork"
    run.main(torchrun_argv(options, module, args, method))
    return 0


def method_name(depth: int = 2) -> str:
    """`torch.distributed.elastic.rendezvous.dynamic_rendezvous.get_method_name`, the name each rendezvous
    event is recorded under, without its two `inspect.stack()` calls: those look up every frame's source
    file through `inspect.getmodule`, which walks `sys.modules`, and with torch, FSDP and torch._dynamo
    imported here (the preload) the rendezvous's event records took about 1 s of each probe (py-spy of a
    2-rank gloo probe). Frame 0 is this function, as `inspect.stack()[0]` is get_method_name."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # a shorter stack, as get_method_name's `len(inspect.stack()) > depth` check
        return "no_method_name"


def _worker(module: str, args: list[str]) -> int:
    # the agent's signal handlers (torchelastic's PContext.start) replaced by a new interpreter's, so that
    # the worker dies of a SIGTERM as torchrun's exec'd workers do (run as a script: absolute import)

    fresh_signals()
    at = os.environ.get(STACKS_AT_ENV)  # a hung worker prints where it waits, once, shortly before the
    if at:  # runner's timeout kills it
        import faulthandler
        import time

        # one rank after another, 0.25 s apart: the ranks share the probe's stderr, and dumps written at the
        # same instant interleave there (faulthandler writes a line in several pieces), which loses a rank's
        # block in `runner.hung_stacks`
        at = float(at) + 0.25 * int(os.environ.get("LOCAL_RANK", "0"))
        faulthandler.dump_traceback_later(max(at - time.time(), 0.1))
    return int(importlib.import_module(module).main(args) or 0)


def exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: with torch, FSDP and torch._dynamo imported (the preload),
    finalizing their modules took about 1.5 s after the workers had exited (strace of a 2-rank gloo probe:
    the workers' exit_group to the launcher's). Nothing is left to do by then: torchrun has stopped its
    workers and closed the rendezvous; logging's handlers and the standard streams are flushed here (a
    forked worker leaves the same way: multiprocessing's `Popen._launch` ends in `os._exit`)."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == WORKER_FLAG:  # in a worker, via torchrun's run_script_path
        sys.exit(_worker(sys.argv[2], sys.argv[3:]))
    exit_now(main())  # a failure (torchrun's ChildFailedError) raises out of main() and exits as usual
