"""``dcp-atomic``: look at, verify, compare, export, import and demo checkpoints without writing Python.

Subcommands: ``ls ROOT [RUN]``, ``show ROOT RUN [STEP]``, ``verify ROOT RUN
[STEP|--all]``, ``diff ROOT RUN A B``, ``stats ROOT RUN [--plot FILE.png]``, ``gc ROOT RUN
[--keep-last N] [--keep-every K] [--keep-period S] [--best M:K:min|max] [--dry-run]``, ``rm ROOT RUN [STEP]
[--yes]``, ``export [--format safetensors] ROOT RUN STEP OUT``, ``import
STOCK_DCP_DIR ROOT RUN STEP``, ``demo``.  ``--json`` prints machine-readable
output, errors included; it, ``--timeout`` and ``--storage-options`` go before
or after the subcommand.  The CLI is one process, so it may scan (list) the run
directory; training ranks never do.

Operators pipe it (``| head``), script it (``--json``) and point it at roots
whose SDK or credentials are missing: every failure is one line on stderr (one
JSON object on stdout with ``--json``) and a non-zero status, never a
traceback (``DCP_ATOMIC_TRACEBACK=1`` shows one for a bug report).

This module is the command's face: the parser, and :func:`main`, which turns every failure into that one line.
What each subcommand does is in :mod:`.commands`, what ``ls``/``show`` list in :mod:`.rows`, how a command's root
is opened in :mod:`.roots`, and how it prints in :mod:`.output`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from typing import Any, Callable

from ..._base import arguments
from ..._base.extras import MISSING_EXTRA_EXIT
from ...format.layout import validate_run_id, validate_step
from ...errors import ArgumentError, CheckpointError
from ...protocol.retention_policy import Best
from ...stores.backends import missing_backend_message
from .commands import cmd_demo, cmd_diff, cmd_export, cmd_gc, cmd_import, cmd_ls, cmd_rm, cmd_show, cmd_stats, cmd_verify
from .memory import cmd_ls as cmd_memory_ls, cmd_show as cmd_memory_show, cmd_verify as cmd_memory_verify
from .output import JSON_SCHEMA, CliError, CopyProgress

__all__ = ["main", "build_parser", "CliError", "CopyProgress", "JSON_SCHEMA", "STORAGE_OPTIONS_ENV"]


#: what to do about failures that arrive as a third-party SDK's own exception type
_HINTS = {
    "NoCredentialsError": "no credentials were found: pass them in --storage-options (e.g. {\"key\": ..., "
                          "\"secret\": ...}), set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or "
                          "pass {\"anon\": true} for a public bucket",
    "PartialCredentialsError": "the credentials are incomplete: pass both key and secret",
    "DefaultCredentialsError": "no Google credentials were found: run `gcloud auth application-default login`, set "
                               "GOOGLE_APPLICATION_CREDENTIALS, or pass {\"token\": ...} in --storage-options",
    "EndpointConnectionError": "the endpoint cannot be reached: check endpoint_url in --storage-options",
}


class _Parser(argparse.ArgumentParser):
    """Usage errors become :class:`CliError`, so that ``--json`` gets them as JSON too."""

    def error(self, message: str):
        raise CliError(f"{self.prog}: {message}", code=2, kind="UsageError")


def _checked(convert: Callable[[str], Any], check: Callable[[Any, str], Any]) -> Callable[[str], Any]:
    """An option's type: the text converted (``int``, ``float``), then checked by the library's own rule for that
    value, so ``show ROOT RUN -1`` or ``--timeout -5`` is a usage error (exit 2) saying what is accepted."""

    def parse(text: str) -> Any:
        try:
            return check(convert(text), "the value")
        except ArgumentError as e:
            raise argparse.ArgumentTypeError(e.message) from None
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if convert is int else 'a number'}, "
                                             f"got {text!r}") from None

    return parse


_positive_int = _checked(int, lambda value, name: arguments.count(name, value, optional=False))
_step = _checked(int, validate_step)
_seconds = _checked(float, lambda value, name: arguments.seconds(name, value))


def _non_negative(value: float, name: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise arguments.refused(name, value, "a finite number >= 0")
    return value


_tolerance = _checked(float, _non_negative)


def _best(text: str) -> Best:
    """``--best METRIC[:K[:min|max]]`` (K 1 and min when left out), checked by :class:`Best` itself."""
    metric, *rest = text.split(":")
    try:
        if len(rest) > 2:
            raise ValueError
        return Best(metric, k=int(rest[0]) if rest else 1, mode=rest[1] if len(rest) > 1 else "min")
    except ArgumentError as e:
        raise argparse.ArgumentTypeError(f"{e.message} (expected METRIC:K:min|max, e.g. val_loss:3:min)") from None
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected METRIC:K:min|max with an integer K, e.g. val_loss:3:min, got "
                                         f"{text!r}") from None


def _rename_rule(text: str) -> tuple[str, str]:
    old, sep, new = text.partition("=")
    if not sep or not old:
        raise argparse.ArgumentTypeError(f"expected OLD=NEW with a non-empty OLD, got {text!r}")
    return old, new


def _size(text: str) -> str:
    from ..export import parse_size

    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


ROOT_HELP = "the checkpoint root: a directory, or s3://, gs:// or another fsspec URL"
RUN_HELP = "the run id: the folder under ROOT that holds its steps"
STORAGE_OPTIONS_ENV = "DCP_ATOMIC_STORAGE_OPTIONS"  # JSON, or @FILE, like --storage-options


def _storage_options_text(value: str) -> str:
    """``--storage-options`` as JSON text: ``@FILE`` reads it from a file (credentials stay out of argv)."""
    if not value.startswith("@"):
        return value
    try:
        with open(os.path.expanduser(value[1:]), encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read storage options from {value[1:]}: {e.strerror}") from None


def build_parser() -> argparse.ArgumentParser:
    from ..demo import DEFAULT_ROOT

    parser = _Parser(prog="dcp-atomic", description=__doc__.splitlines()[0].replace("``", ""))
    _add_global_options(parser, after_subcommand=False)
    after = argparse.ArgumentParser(add_help=False)
    _add_global_options(after, after_subcommand=True)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("ls", parents=[after], help="runs, or the steps of a run")
    p.add_argument("root", help=ROOT_HELP)
    p.add_argument("run", nargs="?", help="a run id under ROOT (default: list the runs)")
    p.add_argument("--local-root", help="this node's local_root (two tiers): also list the steps it holds; other "
                   "nodes' local roots are not visible from here")
    _add_memory_option(p, cmd_memory_ls, "list this node's memory slots of RUN (records only)")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("show", parents=[after], help="manifest summary of a step (default: latest)")
    p.add_argument("root", help=ROOT_HELP)
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("step", nargs="?", type=_step, help="the step to show (default: the newest committed)")
    p.add_argument("--local-root", help="this node's local_root (two tiers): show the step as this root holds it, "
                   "and whether the root (durable) holds it too")
    _add_memory_option(p, cmd_memory_show, "show the slots of STEP on this node (default: the newest step this "
                       "node can restore alone) and their items")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("verify", parents=[after], help="re-read every byte and check every checksum")
    p.add_argument("root", help=ROOT_HELP)
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("step", nargs="?", type=_step, help="the step to verify (default: the newest committed)")
    p.add_argument("--all", action="store_true", help="every committed step")
    p.add_argument("--threads", type=_positive_int, default=4)
    p.add_argument("--local", action="store_true", help="ROOT is a node's local_root (two tiers): partial copies "
                   "a tier restore kept there are reported as such (anywhere else a partial-copy note fails the step)")
    _add_memory_option(p, cmd_memory_verify, "re-read every slot of RUN on this node (STEP: that step's) against "
                       "its record's digests; exit 1 on any damage")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("diff", parents=[after], help="keys added, removed, changed and unchanged between two steps")
    p.add_argument("root", help=ROOT_HELP)
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("a", type=_step, metavar="A", help="the step compared from")
    p.add_argument("b", type=_step, metavar="B", help="the step compared to")
    p.add_argument("--tolerance", type=_tolerance, default=0.0,
                   help="a tensor whose values differ by at most this much (max-abs) counts as unchanged")
    p.add_argument("--limit", type=_positive_int, default=20, help="changed keys listed in the table (--json: all)")
    p.add_argument("--verify", action="store_true", help="first re-read both steps whole and check every digest, as "
                   "verify does (without it, keys whose recorded digests agree are not read)")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("stats", parents=[after], help="each step's recorded save statistics, as a table or a chart")
    p.add_argument("root", help=ROOT_HELP)
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--plot", metavar="FILE.png", help="also draw them over steps into a PNG file, whose folder must "
                   "exist (needs matplotlib: the plot extra)")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("gc", parents=[after], help="delete old committed steps and abandoned attempts",
                       description="A committed step is kept if any of --keep-last, --keep-every, --keep-period, "
                       "--best keeps it (at least one is needed without --local-root); the newest commit and the "
                       "one LATEST names always are.  --dry-run shows what keeps each step and what would go.")
    p.add_argument("root", help=ROOT_HELP)
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--keep-last", type=_positive_int, metavar="N", help="keep the N most recent committed steps")
    p.add_argument("--keep-every", type=_positive_int, metavar="K", help="keep every committed step that is a "
                   "multiple of K")
    p.add_argument("--keep-period", type=_seconds, metavar="SECONDS", help="keep the first commit of each period of "
                   "wall time (rank 0's clock at the commit)")
    p.add_argument("--best", type=_best, metavar="METRIC:K:min|max", help="keep the K best committed steps by a "
                   "number saved in their metadata (save(..., metadata={METRIC: value}))")
    p.add_argument("--lease-hours", type=float, default=6.0, help="age after which an uncommitted attempt is abandoned")
    p.add_argument("--local-root", help="this node's local_root (two tiers): collect only the abandoned attempts "
                   "and leftovers killed jobs left there; its committed steps and the durable root are not touched")
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("rm", parents=[after], help="delete one step (committed or not) or a whole run; needs --yes")
    p.add_argument("root", help=ROOT_HELP)
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("step", nargs="?", type=_step, help="the step to delete (default: the whole run)")
    p.add_argument("--yes", action="store_true", help="really delete (without it: show what would go, exit 2)")
    p.add_argument("--lease-hours", type=float, default=6.0,
                   help="a step's uncommitted attempt younger than this is a save in flight and is left (0: none)")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("export", parents=[after],
                       help="write one step as one torch.save file, or as safetensors shards")
    p.add_argument("root", help=ROOT_HELP)
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("step", type=_step, help="the committed step to export")
    p.add_argument("out", help="the .pt file (torch), or the directory of shards (safetensors)")
    p.add_argument("--format", choices=("torch", "safetensors"), default="torch")
    p.add_argument("--shard-size", type=_size, help="bytes per safetensors shard, e.g. 5GB (default), 500MiB")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="cast floating tensors (safetensors)")
    p.add_argument("--keys", action="append", metavar="GLOB",
                   help="export only keys matching GLOB, e.g. 'model.*' (repeatable; safetensors)")
    p.add_argument("--strip-prefix", dest="renames", action="append", type=lambda prefix: (prefix, ""),
                   metavar="PREFIX", help="drop PREFIX from the names that start with it, e.g. 'model.' for a state "
                   "dict saved as {'model': model.state_dict()} (repeatable, in order with --rename; safetensors)")
    p.add_argument("--rename", dest="renames", action="append", type=_rename_rule, metavar="OLD=NEW",
                   help="replace a leading OLD with NEW in the exported names (repeatable; safetensors)")
    p.add_argument("--tie", dest="ties", action="append", type=_rename_rule, metavar="ALIAS=TARGET",
                   help="ALIAS is tied to TARGET (exported names, e.g. lm_head.weight=model.embed_tokens.weight): "
                   "checked bit-identical, written once under TARGET (repeatable; safetensors)")
    p.add_argument("--force", action="store_true", help="replace an existing export at OUT")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", parents=[after], help="adopt a stock DCP checkpoint directory as a committed step")
    p.add_argument("source", help="directory written by torch's FileSystemWriter (holds .metadata)")
    p.add_argument("root", help=ROOT_HELP)
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("step", type=_step, help="the step number the imported checkpoint becomes")
    p.add_argument("--link", action="store_true",
                   help="hard-link the data files instead of copying (same filesystem; the shared files become read-only)")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("demo", parents=[after], help="train, crash a save, resume (the README's first command)")
    p.add_argument("--root", default=DEFAULT_ROOT)
    p.add_argument("--world-size", type=int, default=4)
    p.set_defaults(func=cmd_demo)
    return parser


def _add_memory_option(parser: argparse.ArgumentParser, command: Callable[[Any], int], what: str) -> None:
    parser.add_argument("--memory", dest="memory_command", action="store_const", const=command, default=None,
                        help=f"ROOT is a node's memory tier path (MemoryTier(path=...)): {what}")


def _add_global_options(parser: argparse.ArgumentParser, *, after_subcommand: bool) -> None:
    """Options accepted before the subcommand and after it; one not given after it keeps its value from before."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if after_subcommand else value

    parser.add_argument("--json", action="store_true", default=default(False),
                        help="machine-readable output, errors included")
    parser.add_argument("--storage-options", type=_storage_options_text,
                        default=default(os.environ.get(STORAGE_OPTIONS_ENV) or None),
                        help=f"fsspec options as JSON, e.g. an S3 endpoint, or @FILE holding that JSON (keeps secrets "
                             f"out of shell history); default: ${STORAGE_OPTIONS_ENV}")
    parser.add_argument("--timeout", type=_seconds, default=default(10.0), help="seconds to wait for visibility")


def main(argv: list[str] | None = None) -> int:
    """Run one command; every failure becomes one line (or one JSON object) and an exit status."""
    argv = sys.argv[1:] if argv is None else argv
    handler = _one_line_logging()
    try:
        code = _run(argv)
        sys.stdout.flush()  # inside the try: `| head` closing the pipe surfaces here at the latest
        return code
    except BrokenPipeError:  # the reader went away (`show | head -1`): end quietly, as Unix tools do
        _silence_stdout()
        return 141
    except KeyboardInterrupt:
        print("dcp-atomic: interrupted", file=sys.stderr)
        return 130
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)


class _OneLineFormatter(logging.Formatter):
    """Warnings as one line each: SDKs log their retries with ``logger.exception`` (gcsfs), a traceback here."""

    def format(self, record: logging.LogRecord) -> str:
        return f"dcp-atomic: {record.levelname.lower()}: {record.getMessage()}".replace("\n", " ")


def _one_line_logging() -> logging.Handler | None:
    """Give an unconfigured process (the console script) a one-line stderr handler; leave a configured one alone."""
    if logging.getLogger().handlers or os.environ.get("DCP_ATOMIC_TRACEBACK"):
        return None
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_OneLineFormatter())
    logging.getLogger().addHandler(handler)
    return handler


def _run(argv: list[str]) -> int:
    as_json = "--json" in argv  # known before parsing, so that usage errors are JSON too
    root = None
    try:
        args = build_parser().parse_args(argv)
        root = getattr(args, "root", None)
        if getattr(args, "run", None) is not None:
            validate_run_id(args.run)
        if getattr(args, "memory_command", None) is not None:
            if not args.run:
                raise CliError(f"dcp-atomic {args.command}: --memory needs RUN (the run id whose slots to read)",
                               code=2, kind="UsageError")
            return args.memory_command(args)
        return args.func(args)
    except CliError as e:
        return _report(as_json, e.kind, e.message, e.code)
    except ArgumentError as e:  # an argument the library refused as given: a usage error too
        return _report(as_json, "UsageError", e.message, 2)
    except CheckpointError as e:
        return _report(as_json, type(e).__name__, e.message, 1)
    except BrokenPipeError:
        raise
    except (OSError, ValueError) as e:  # storage and configuration failures: a message, not a traceback
        text = str(e)
        return _report(as_json, type(e).__name__, text if not root or root in text else f"{root}: {text}", 1)
    except ImportError as e:
        return _report(as_json, "MissingDependency", missing_backend_message(root or "", e), MISSING_EXTRA_EXIT)
    except Exception as e:  # noqa: BLE001 - an SDK's own type (credentials, endpoints) or a bug: still one line
        if os.environ.get("DCP_ATOMIC_TRACEBACK"):
            raise
        hint = _HINTS.get(type(e).__name__)
        where = f"{root}: " if root else ""
        message = f"{where}{e}" + (f"; {hint}" if hint else
                                   " (unexpected: set DCP_ATOMIC_TRACEBACK=1 and rerun for a traceback to report)")
        return _report(as_json, type(e).__name__, message, 1)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's own flush at exit cannot raise BrokenPipeError again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real file (captured by a test harness)
        pass


def _report(as_json: bool, kind: str, message: str, code: int) -> int:
    if as_json:
        print(json.dumps({"schema": JSON_SCHEMA, "error": {"type": kind, "message": message}}))
    else:
        print(f"dcp-atomic: {kind}: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
