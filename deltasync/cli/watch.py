"""``deltasync watch URL --model DIR``: keep a safetensors checkpoint directory at the latest version.

An empty directory is initialised from the newest anchor (waiting for one to be published unless
``--once``); then a :class:`~deltasync.replica.subscriber.Subscriber` applies every new version in place
and the checkpoint records the version it holds, so a restarted watch resumes from there. Runs until
Ctrl-C or SIGTERM (an update in progress finishes first); ``--once`` applies what is available and
exits.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ObjectNotFound, VersionError
from ..util.signals import run_until_signal
from .common import add_pin_arguments, load_manifest, open_existing, pin, safe_url

if TYPE_CHECKING:
    from ..replica.subscriber import Subscriber, UpdateInfo

WAIT_INTERVAL_S = 5.0  # how often `watch` looks for a first anchor on an empty prefix


def add_parser(sub: Any) -> None:
    """Register ``watch`` on the ``deltasync`` subcommands."""
    watch = sub.add_parser("watch", help="keep a local safetensors checkpoint directory at the latest version")
    watch.add_argument("url", help="the run prefix")
    watch.add_argument(
        "--model", required=True, metavar="DIR", help="checkpoint directory (initialised from an anchor if empty)"
    )
    watch.add_argument("--once", action="store_true", help="apply what is available, then exit")
    watch.add_argument(
        "--interval", type=float, default=None, metavar="S",
        help="seconds between polls (default: 1 s after a change, backing off to 15 s)",
    )
    watch.add_argument("--replica-id", default=None, help="name in acks/ (default: watch-HOST-DIRNAME)")
    watch.add_argument(
        "--copy-config", default=None, metavar="BASE",
        help="when initialising, copy the model's other files (config.json, tokenizer...) from the base "
        "checkpoint BASE, so transformers or vLLM can load the directory",
    )
    watch.add_argument("--no-ack", action="store_true", help="do not write acks/<replica>.json")
    add_pin_arguments(watch)
    watch.add_argument(
        "--cache-dir", default=None,
        help="share downloaded objects with other replicas on this machine through this directory",
    )
    watch.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Initialise the checkpoint if needed, then keep it at the latest version."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    directory = Path(args.model)
    replica = args.replica_id or f"watch-{socket.gethostname()}-{directory.resolve().name}"
    stop = threading.Event()
    try:
        from ..appliers.checkpoint.applier import has_checkpoint

        if not has_checkpoint(directory) and not _initialise(args, directory, replica, stop):
            return 0
        return _watch(args, directory, replica, stop)
    except KeyboardInterrupt:
        print("interrupted; the checkpoint records the last version applied", file=sys.stderr)
        return 0


def _watch(args: argparse.Namespace, directory: Path, replica: str, stop: threading.Event) -> int:
    from ..appliers.checkpoint.applier import CheckpointDirApplier
    from ..replica.subscriber import Subscriber

    applier = CheckpointDirApplier(directory)
    resume = applier.resume_options()
    sub = Subscriber(
        args.url, applier, replica_id=replica, ack=not args.no_ack, **resume, **_poll_options(args),
        **_cache_options(args),
    )
    sub.add_hook(applier.recorder(sub))
    sub.add_hook(_print_update)
    pin(sub, args)
    where = (
        f"v{resume['start_version']} of run {resume['run_id'][:8]}"
        if resume
        else "no resumable version: the next update uses an anchor"
    )
    print(f"watching {safe_url(sub.store.url)} into {directory} ({where})", flush=True)
    try:
        if args.once:
            if sub.update() is None:
                if sub.latest is None:
                    raise VersionError(f"no versions published at {safe_url(sub.store.url)} yet")
                print(f"up to date at v{sub.version}", flush=True)
            return 0
        _follow(sub, stop)
        print(f"stopped at v{sub.version}", flush=True)
        return 0
    finally:
        sub.close()
        applier.close()


def _poll_options(args: argparse.Namespace) -> dict[str, float]:
    return {} if args.interval is None else {"poll_interval": args.interval, "max_poll_interval": args.interval}


def _print_update(info: UpdateInfo) -> None:
    start = f"from v{info.previous}" if info.previous is not None else "from nothing"
    print(
        f"v{info.version} (step {info.step}) {start} via {'+'.join(info.route)}: "
        f"{info.bytes:,} bytes, apply {1e3 * info.t_apply:.1f} ms, lag {info.lag_s:.2f} s",
        flush=True,
    )


def _follow(sub: Subscriber, stop: threading.Event) -> None:
    """Follow until Ctrl-C or SIGTERM; an update in progress finishes first, a crash is re-raised."""
    run_until_signal(sub.run, stop)  # bad input is counted and logged inside sub.run


def _anchor_published(url: str) -> bool:
    try:
        with open_existing(url) as store:
            manifest, _ = load_manifest(store)
    except ObjectNotFound:
        return False
    return bool(manifest.anchors())


def _wait_for_anchor(args: argparse.Namespace, stop: threading.Event) -> bool:
    """Whether an anchor is published; waits for one unless ``--once`` (``False``: stopped)."""
    while not _anchor_published(args.url):
        if args.once:
            raise VersionError(
                f"nothing published at {safe_url(args.url)} yet: no anchor to initialise {args.model} from"
            )
        print(f"waiting for a first anchor at {safe_url(args.url)}", flush=True)
        if stop.wait(args.interval or WAIT_INTERVAL_S):
            return False
    return True


def _cache_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"cache_dir": args.cache_dir} if args.cache_dir else {}


def _initialise(args: argparse.Namespace, directory: Path, replica: str, stop: threading.Event) -> bool:
    """Create the checkpoint from the newest anchor; ``False`` if stopped while waiting for one."""
    from ..appliers.checkpoint.applier import SINGLE_FILE, initialise_checkpoint

    if not _wait_for_anchor(args, stop):
        return False
    info = initialise_checkpoint(
        directory, args.url, replica_id=replica, ack=not args.no_ack, on_update=_print_update, **_cache_options(args)
    )
    print(f"initialised {directory / SINGLE_FILE} at v{info.version}", flush=True)
    if args.copy_config:
        copied = _copy_model_files(Path(args.copy_config), directory)
        print(f"copied {', '.join(copied) or 'nothing'} from {args.copy_config}", flush=True)
    if not (directory / "config.json").exists():
        print(
            f"note: {directory} holds the weights only (no config.json, no tokenizer): to load it with transformers "
            "or vLLM, copy the base model's other files there (watch --copy-config BASE does it when initialising)",
            flush=True,
        )
    return True


def _copy_model_files(base: Path, directory: Path) -> list[str]:
    """Copy every file of ``base`` but its weights (config, generation config, tokenizer...) into ``directory``."""
    import shutil

    if not base.is_dir():
        raise FileNotFoundError(f"--copy-config {base}: not a directory")
    copied = []
    for path in sorted(base.iterdir()):
        if path.is_file() and path.suffix != ".safetensors" and not path.name.startswith(".") and not (
            path.name.endswith(".safetensors.index.json")
        ):
            shutil.copy2(path, directory / path.name)
            copied.append(path.name)
    return copied
