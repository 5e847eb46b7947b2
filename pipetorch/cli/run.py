"""`pipetorch run [--num-instances N] [--num-replicas R] SCRIPT [ARGS...]`: run an unmodified
PopTorch script on pipetorch, PopRun-style when asked for instances or replicas."""
from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback
from collections.abc import Sequence

from pipetorch.cli.alias import install_poptorch_alias, poptorch_alias_path
from pipetorch.popdist import launch

__all__ = ["register", "run_script"]

_HELP = "run a PopTorch script unchanged: `import poptorch` gives pipetorch"
_DESCRIPTION = """\
Run SCRIPT as __main__ with sys.argv = [SCRIPT, *ARGS], after making `import poptorch`,
`import poptorch.optim` and `from poptorch import ...` resolve to pipetorch. Child Python
processes the script starts (spawned workers, subprocesses) get the same alias through
PYTHONPATH. `import popdist` gives pipetorch.popdist. Exits with the script's exit code.

PopRun's flags: --num-instances N starts N instances (processes) of SCRIPT here through
torchrun; --num-replicas R shares R replicas out over the instances (one per instance by
default), which popdist.poptorch.Options() and popdist.getNumLocalReplicas() read. Under
torchrun, `torchrun ... -m pipetorch run --num-replicas R SCRIPT` runs the same script on
several hosts."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `run` subcommand to the `pipetorch` parser."""
    parser = subparsers.add_parser(
        "run", help=_HELP, description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_poprun_flags(parser)
    parser.add_argument("script", metavar="SCRIPT", help="path of the PopTorch script")
    parser.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER,
                        help="arguments passed to the script unchanged")
    parser.set_defaults(command=_command, parser=parser)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _add_poprun_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-instances", type=_positive, metavar="N",
                        help="start N instances of SCRIPT on this host through torchrun")
    parser.add_argument("--num-replicas", type=_positive, metavar="R",
                        help="replicas of all instances together (default: one per instance)")
    parser.add_argument("--ipus-per-replica", type=_positive, metavar="K",
                        help="devices per replica, as popdist.getNumIpusPerReplica() reads")
    for flag in launch.POPRUN_ONLY:
        parser.add_argument(flag, dest="poprun_only_" + flag.strip("-").replace("-", "_"),
                            metavar="VALUE", help=argparse.SUPPRESS)


def _refuse_poprun_only(args: argparse.Namespace) -> None:
    for flag, advice in launch.POPRUN_ONLY.items():
        if getattr(args, "poprun_only_" + flag.strip("-").replace("-", "_")) is not None:
            args.parser.error(f"PopRun's {flag} has no `pipetorch run` equivalent: {advice} "
                              '(docs/machines.md, "PopRun and PopDist")')


def _command(args: argparse.Namespace) -> int:
    _refuse_poprun_only(args)
    if not os.path.isfile(args.script):
        args.parser.error(f"script not found: {args.script!r} (no such file, relative to "
                          f"{os.getcwd()}); give the path of a Python file")
    poprun = dict(num_replicas=args.num_replicas, ipus_per_replica=args.ipus_per_replica)
    try:
        if args.num_instances is not None and not launch.launched():
            return launch.start_instances(args.num_instances, args.script, args.args, **poprun)
        if args.num_instances is not None or any(v is not None for v in poprun.values()):
            launch.export(num_instances=args.num_instances, **poprun)
    except ValueError as error:
        args.parser.error(str(error))
    return run_script(args.script, args.args)


def run_script(script: str, args: Sequence[str] = ()) -> int:
    """Run `script` as `python script args...` would, with `poptorch` aliased to pipetorch.

    Returns 0 when the script ends normally and 1 (after printing the script's traceback)
    when it raises; `SystemExit` propagates, so `sys.exit(n)` in the script exits with n.
    """
    install_poptorch_alias()
    _export_alias_to_children()
    sys.argv = [script, *args]
    # `python script.py` puts the script's folder first on sys.path, so its sibling modules
    # import; sys.path[0] here is the console script's folder (or the cwd under -m).
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    # Spawned multiprocessing children copy the parent's sys.path over their own (dropping
    # what PYTHONPATH gave them) before re-running the script, so the shim goes here too.
    if poptorch_alias_path() not in sys.path:
        sys.path.insert(1, poptorch_alias_path())
    try:
        runpy.run_path(script, run_name="__main__")
    except Exception as exc:  # report any failure of the script the way python does
        _print_script_traceback(exc)
        return 1
    return 0


def _export_alias_to_children() -> None:
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    shim = poptorch_alias_path()
    if shim not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([shim, *filter(None, paths)])


def _print_script_traceback(exc: BaseException) -> None:
    # Drop the frames of this module and runpy so the trace starts in the user's script.
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in (__name__, "runpy"):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)
