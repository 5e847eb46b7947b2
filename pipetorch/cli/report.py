"""`pipetorch report DIR` and `pipetorch report compare A B`: read profiling report directories."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

__all__ = ["register", "show_report", "compare_reports"]

_HELP = "show a profiling report directory, or compare two (`report compare A B`)"
_DESCRIPTION = """\
pipetorch report DIR
    Print the summary of the report a profiled run wrote in DIR (opts.enableProfiling(DIR),
    or POPLAR_ENGINE_OPTIONS='{"autoReport.all":"true","autoReport.directory":"DIR"}'): the
    devices, stages, batch settings, throughput, utilisation and bubble per device and the
    memory per device, then the path of DIR/report.html (open it in a browser; it needs no
    network). DIR/trace.json opens in Perfetto or chrome://tracing.

pipetorch report compare A B [--output PATH]
    Print A and B side by side with their differences (settings, throughput, idle time and
    memory per device) and write compare.html (into the current directory, or PATH: a file or
    a directory)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `report` subcommand to the `pipetorch` parser."""
    parser = subparsers.add_parser(
        "report", help=_HELP, description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", metavar="DIR", nargs="+",
                        help="a report directory, or `compare A B`")
    parser.add_argument("--output", metavar="PATH", default=None,
                        help="where `compare` writes compare.html (file or directory; "
                             "default: ./compare.html)")
    parser.set_defaults(command=_command, parser=parser)


def _command(args: argparse.Namespace) -> int:
    paths = list(args.paths)
    # A report directory that happens to be called "compare" still shows as one report.
    if paths[0] == "compare" and not (len(paths) == 1 and os.path.isdir(paths[0])):
        if len(paths) != 3:
            args.parser.error(f"`report compare` takes two report directories, got "
                              f"{len(paths) - 1}: {paths[1:]}; use `pipetorch report compare A B`")
        return _run(lambda: compare_reports(paths[1], paths[2], output=args.output), args)
    if len(paths) != 1:
        args.parser.error(f"`report` takes one report directory, got {len(paths)}: {paths}; "
                          "to compare two use `pipetorch report compare A B`")
    if args.output is not None:
        args.parser.error("--output only applies to `report compare A B`")
    return _run(lambda: show_report(paths[0]), args)


def _run(job: Callable[[], str], args: argparse.Namespace) -> int:
    try:
        text = job()
    except ValueError as exc:
        print(f"pipetorch report: error: {exc}", file=sys.stderr)
        return 2
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `pipetorch report DIR | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def show_report(directory: str | os.PathLike) -> str:
    """The summary of report `directory` and where its report.html is, as printed."""
    from pipetorch.profiling.rebalance import advice
    from pipetorch.profiling.recorder import load
    from pipetorch.profiling.summary import render_text

    summary, memory, _ = load(directory)
    page = os.path.abspath(os.path.join(directory, "report.html"))
    where = page if os.path.isfile(page) else f"{page} (missing: write the report again)"
    text = render_text(summary, memory)
    moves = advice(summary)
    if moves:
        text = f"{text}\n\n{moves}"
    return f"{text}\n\nreport: {where}"


def compare_reports(a: str | os.PathLike, b: str | os.PathLike, *,
                    output: str | os.PathLike | None = None) -> str:
    """The side-by-side table of reports `a` and `b`, ending with where compare.html went."""
    from pipetorch.profiling.compare import compare

    text, page = compare(a, b, output=output)
    return f"{text}\n\ncompare: {page.resolve()}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run `pipetorch report` alone (for tests and `python -m pipetorch.cli.report`)."""
    parser = argparse.ArgumentParser(prog="pipetorch")
    register(parser.add_subparsers())
    args = parser.parse_args(["report", *(sys.argv[1:] if argv is None else argv)])
    return args.command(args)


if __name__ == "__main__":
    sys.exit(main())
