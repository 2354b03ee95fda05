"""The ``deltasync`` command line.

    deltasync inspect FILE [--json] [--tensors N]      metadata, per-tensor codec, counts, sparsity
    deltasync status URL [--json] [--versions N]       run, writer, versions, anchors, sizes, replica lag
    deltasync gc URL [--dry-run] [--grace SECONDS]     delete retired objects and orphans of crashed publishes
    deltasync watch URL --model DIR [--once]           keep a safetensors checkpoint directory at the latest version
    deltasync follow --store URL --server URL [--model DIR]   keep a vLLM server at the latest version
    deltasync rollback URL --to R [--takeover]         publish a version equal to R, retracting those after R
    deltasync demo                                      the main job: train, publish, follow, end to end

``FILE`` is a local path, or a store URL plus a key (``s3://bucket/run1/deltas/000007.safetensors``
is read through the S3 backend). ``URL`` is a run prefix as the publisher was given it; credentials
come from the environment, and store URLs are printed without user info or query strings.
Exit code 0 on success, 2 on anything deltasync refuses (a bad file, no manifest, a rejected update).

Each command lives in its own module (:mod:`.inspect`, :mod:`.status`, :mod:`.gc`, :mod:`.watch`, :mod:`.follow`,
:mod:`.rollback`)
with an ``add_parser`` that registers it and a ``run`` that executes it; ``deltasync demo`` is
:mod:`deltasync.demo`, hooked in here.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ..errors import DeltaSyncError
from ..util.collector import allow_pauses
from . import follow, gc, inspect, rollback, status, watch
from .common import safe_url
from .inspect import describe
from .status import collect_status

__all__ = ["build_parser", "collect_status", "describe", "main", "safe_url"]

_COMMANDS = (inspect, status, gc, watch, follow, rollback)


def _cmd_demo(args: argparse.Namespace) -> int:
    from ..demo import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    parser = argparse.ArgumentParser(prog="deltasync", description="Exact sparse weight sync through object storage.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in _COMMANDS:
        command.add_parser(sub)

    from ..demo import add_arguments as _demo_arguments

    demo = sub.add_parser("demo", help="train SmolLM2-135M on CPU, publish every step, two replicas follow bit-exactly")
    _demo_arguments(demo).set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``deltasync`` command."""
    args = build_parser().parse_args(argv)
    allow_pauses()  # a process the command owns: deltasync may hold the collector off amid its work
    try:
        return int(args.func(args))
    except DeltaSyncError as exc:
        print(f"deltasync {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"deltasync {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (``deltasync status ... | head``): stop quietly, as POSIX tools do. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by a closed pipe
