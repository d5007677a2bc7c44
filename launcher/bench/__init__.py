"""`switchyard bench`: the in-process limit, the end-to-end load generator, the peers and the report."""

from __future__ import annotations


def add_arguments(parser) -> None:
    from launcher.bench.suite import add_arguments as add

    add(parser)


def run(args) -> int:
    from launcher.bench.suite import run as go  # torch and the peers load only when a benchmark runs

    return go(args)
