"""``deltasync rollback URL --to R``: publish a version whose weights equal version R's, bit for bit.

The versions after R are marked retracted in the manifest (never removed: numbers only grow), and every
replica, live or late, lands on R's weights through an ordinary delta (:mod:`deltasync.control.rollback`).
The trainer that owns the prefix refuses a second writer while its lease is live: roll back through its
publisher (``deltasync.control.rollback(publisher, to=R)``), or stop it and pass ``--takeover``; it then
resumes from R's weights (README, "Restarting a trainer").
"""

from __future__ import annotations

import argparse
from typing import Any

from .common import safe_url

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Register ``rollback`` on the ``deltasync`` subcommands."""
    rollback = sub.add_parser("rollback", help="publish a version equal to an earlier one, retracting those between")
    rollback.add_argument("url", help="the run prefix")
    rollback.add_argument("--to", type=int, required=True, metavar="R", help="the version whose weights to restore")
    rollback.add_argument("--step", type=int, default=None, help="the trainer step to record with the new version")
    rollback.add_argument("--takeover", action="store_true",
                          help="write even while the trainer's lease is live (only once that trainer is stopped)")
    rollback.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..control.rollback import rollback

    done = rollback(args.url, args.to, step=args.step, takeover=args.takeover)
    size = f", {done.info.bytes:,} bytes" if done.info is not None else ""
    changed = f"{done.info.nnz:,} elements changed back" if done.info is not None else "published"
    first, last = done.retracted
    print(f"v{done.version} restores v{done.restores} ({changed}{size}); v{first} to v{last} retracted at "
          f"{safe_url(args.url)}", flush=True)
    return 0
