"""torchrun whose workers are forks of a launcher that has already imported what they run (CPU probes).

    python -m distplan.validate.launch [torchrun options] -m MODULE [ARGS...]

torchrun (`torch.distributed.run`) starts each worker of a `-m MODULE` command as a new Python
interpreter, which imports torch, FSDP and DTensor once more: about 5 s of CPU per worker on a 2-core
machine, most of a small gloo probe's 9-13 s. This launcher imports MODULE and what its run imports
(`MODULE.preload(argv)`, where MODULE has one) once, then runs torchrun itself, in this process
(`torch.distributed.run.main`), with `--run-path` (torchrun's own option: the training script runs as a
function in the worker, `run_script_path`) and `--start-method=fork` (torchrun's option: the workers
are `multiprocessing` forks of this process). Everything else is torchrun's: the elastic agent, the c10d
rendezvous, each worker's RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, failure detection
(a worker that exits non-zero stops the others and torchrun exits 1 with its ChildFailedError).

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

WORKER_FLAG = "--worker"


def split_argv(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """(torchrun options, MODULE, ARGS) of `[options] -m MODULE [ARGS]`."""
    if "-m" not in argv:
        raise ValueError("usage: python -m distplan.validate.launch [torchrun options] -m MODULE [ARGS...]")
    i = argv.index("-m")
    if i + 1 >= len(argv):
        raise ValueError("-m needs a module name")
    return argv[:i], argv[i + 1], argv[i + 2:]


def torchrun_argv(options: list[str], module: str, args: list[str]) -> list[str]:
    """torchrun's own command line: run this file in forked workers, which run MODULE."""
    return [*options, "--start-method=fork", "--run-path", os.path.abspath(__file__), WORKER_FLAG, module, *args]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        options, module, args = split_argv(argv)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    mod = importlib.import_module(module)
    preload = getattr(mod, "preload", None)
    if preload is not None:
        preload(args)
    from torch.distributed import run

    run.main(torchrun_argv(options, module, args))
    return 0


def _worker(module: str, args: list[str]) -> int:
    # the agent's signal handlers (torchelastic's PContext.start) replaced by a new interpreter's, so that
    # the worker dies of a SIGTERM as torchrun's exec'd workers do (run as a script: absolute import)
    from distplan.validate.guard import fresh_signals

    fresh_signals()
    return int(importlib.import_module(module).main(args) or 0)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == WORKER_FLAG:  # in a worker, via torchrun's run_script_path
        sys.exit(_worker(sys.argv[2], sys.argv[3:]))
    sys.exit(main())
