"""`flotilla`: the command line. Plain `flotilla` opens the desktop app.

Every user-facing failure is one line on stderr and a non-zero exit code; a
traceback means a bug in Flotilla, never a user mistake.

Output is UTF-8 on every OS (utf8_stdio): a pipe on Windows would otherwise be the
ANSI code page (cp1252), which cannot encode most of what a model says, nor the
U+FFFD that a byte-level tokenizer's partial character decodes to, and the first such
token would end the command with a UnicodeEncodeError.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import entry_points

from engine import __version__
from engine.cli.errors import UserError

EXIT_USER_ERROR = 1
EXIT_INTERRUPTED = 130


def utf8_stdio() -> None:
    """stdout and stderr write UTF-8, whatever the locale or the pipe (errors="replace": a lone
    surrogate becomes "?" instead of a traceback). stdin is left alone: a pipe into us speaks
    the encoding of whoever writes it. Idempotent; streams that cannot be reconfigured
    (replaced by a test, or os.devnull in a windowed bundle) are left as they are."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is None:
            continue
        try:
            reconfigure(encoding="utf-8", errors="replace")
        except (ValueError, OSError):  # e.g. a closed stream
            pass


def build_parser() -> argparse.ArgumentParser:
    from engine.cli import (agent_cmd, bench_cmd, chat_cmd, demo_cmd, models_cmd, pipeline_cmd, selftest_cmd,
                            serve_cmd, sparse_cmd)

    parser = argparse.ArgumentParser(
        prog="flotilla",
        description="Flotilla: the idle PCs of a home or an office as one private LLM machine. "
        "Run without a command to open the desktop app.",
    )
    parser.add_argument("--version", action="version", version=f"flotilla {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chat_cmd.add_parser(sub)
    models_cmd.add_parser(sub)
    serve_cmd.add_parser(sub)
    pipeline_cmd.add_parser(sub)
    demo_cmd.add_parser(sub)
    bench_cmd.add_parser(sub)
    agent_cmd.add_parser(sub)
    sparse_cmd.add_parser(sub)
    selftest_cmd.add_parser(sub)
    app = sub.add_parser("app", help="open the desktop app (the same as plain `flotilla`)")
    app.set_defaults(func=lambda _args: open_app([]))
    return parser


def open_app(argv: list[str]) -> int:
    """Start the desktop app, which registers itself as the `flotilla.gui` plugin."""
    found = entry_points(group="flotilla.gui")
    if not found:
        raise UserError("the desktop app is not installed; `flotilla chat` and `flotilla serve` work without it")
    run = next(iter(found)).load()
    return int(run(argv) or 0)


def _user_errors() -> tuple[type[BaseException], ...]:
    from engine.models.errors import ModelError
    from engine.protocol.errors import ProtocolError
    from engine.core.interface import EngineError

    return (UserError, ModelError, ProtocolError, EngineError)


def main(argv: list[str] | None = None) -> int:
    utf8_stdio()  # before anything prints, --help included
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        return _run_guarded(lambda: open_app([]))
    args = build_parser().parse_args(argv)
    if getattr(args, "func", None) is None:
        build_parser().print_help()
        return 2
    return _run_guarded(lambda: args.func(args))


def _run_guarded(fn) -> int:
    utf8_stdio()  # also for the `python -m engine.cli.<cmd>_cmd` entry points, which start here
    try:
        return int(fn() or 0)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _user_errors() as exc:
        print(f"flotilla: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except BrokenPipeError:
        # `flotilla chat ... | head`: the reader went away; not an error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
