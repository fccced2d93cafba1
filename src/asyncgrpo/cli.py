"""The `asyncgrpo` command: `serve` starts the embedded generation server, `demo` trains the bundled
tiny model. Imports are lazy so that `asyncgrpo --help` is instant."""

from __future__ import annotations

import argparse
import sys

# the flags of `asyncgrpo serve` and the shared argparse types; also imported from here by the README and
# the examples (`from asyncgrpo.cli import serve_arguments, at_least, server_url`)
from asyncgrpo.cli_args import add_serve_parser, at_least, more_than, serve_arguments, server_url

__all__ = ["at_least", "main", "more_than", "serve_arguments", "server_url"]


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    add_serve_parser(subparsers).set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from asyncgrpo.server.serve import main as serve_main

    return serve_main(args)


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="Train the bundled tiny model on arithmetic with RL and show held-out accuracy before/after.",
        description="Start the embedded server, train asyncgrpo/tiny-chat with AsyncGRPOTrainer, "
                    "report accuracy.",
    )
    from asyncgrpo.demo import add_arguments

    add_arguments(p)
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from asyncgrpo.demo import run

    return run(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncgrpo", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_serve(subparsers)
    _add_demo(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
