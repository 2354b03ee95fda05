"""``deltasync follow --store URL --server URL``: keep a vLLM server at a run's latest version.

Two kinds of server (docs/VLLM.md):

- launched with the ``deltasync`` weight-transfer backend (``--weight-transfer-config '{"backend":
  "deltasync"}'``, ``VLLM_SERVER_DEV_MODE=1``): this process tells it which store to follow and drives
  vLLM's round trip for each new version (:class:`~deltasync.appliers.vllm.server_follower.ServerFollower`);
  the server's ranks fetch and apply the versions themselves;
- launched with deltasync's worker extension instead (``--model DIR`` names the checkpoint it loaded): this
  process downloads and checks each version and hands it to the workers through ``/collective_rpc``
  (:class:`~deltasync.appliers.vllm.VLLMFollower`); also the way to serve a LoRA run's adapter (``--lora``).

Either waits for the server to come up, then follows the store until Ctrl-C or SIGTERM (an update in
progress finishes first). ``--once`` applies the latest version and exits.
"""

from __future__ import annotations

import argparse
import logging
import threading
from typing import Any

from ..errors import ConfigError
from ..publish.lora import LORA_NAME
from .common import add_pin_arguments, pin

logger = logging.getLogger("deltasync.vllm")


def add_parser(sub: Any) -> None:
    """Register ``follow`` on the ``deltasync`` subcommands."""
    follow = sub.add_parser("follow", help="keep a vLLM server at the latest version of a run")
    follow.add_argument("--store", required=True, help="run prefix the trainer publishes to (path, s3://, hf://)")
    follow.add_argument("--server", required=True, help="vLLM server base URL, e.g. http://127.0.0.1:8000")
    follow.add_argument("--model", default=None, help="a server with the worker extension: the checkpoint directory it "
                        "loaded (without it, the server runs the deltasync weight-transfer backend)")
    follow.add_argument("--mode", choices=["inflight", "pause"], default="inflight")
    follow.add_argument("--pause-mode", choices=["wait", "abort"], default="wait")
    follow.add_argument("--replica-id", default=None)
    follow.add_argument("--poll-interval", type=float, default=1.0, help="seconds between polls after a change")
    follow.add_argument("--max-poll-interval", type=float, default=15.0,
                        help="idle backoff cap: the longest a new version waits unseen")
    follow.add_argument("--cache-dir", default=None, help="share downloaded objects with the node's other "
                        "replicas through this directory (docs/FLEET.md)")
    follow.add_argument("--once", action="store_true", help="apply the latest version and exit")
    follow.add_argument("--lora", default=None, help="a LoRA run published with lora='auto'/'adapter': the "
                        "adapter's directory or adapter_config.json")
    follow.add_argument("--lora-name", default=LORA_NAME, help="the name clients ask for (model=...)")
    follow.add_argument("--wait-for-server", type=float, default=600.0, metavar="SECONDS",
                        help="how long to wait for the server to come up (default 600; 0: fail at once)")
    add_pin_arguments(follow)
    follow.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Wait for the server, then follow the store until stopped (or once)."""
    from ..appliers.vllm.rpc import ServerEngine

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.model is None and args.lora is not None:
        raise ConfigError("--lora serves an adapter through the worker extension: give --model, the checkpoint "
                          "directory the server loaded", argument="lora")
    if args.model is not None:
        return _follow_with_the_extension(args)
    ServerEngine(args.server).wait_until_up(args.wait_for_server, log=logger.info)
    return _follow_with_the_backend(args)


def _follow_with_the_backend(args: argparse.Namespace) -> int:
    from ..appliers.vllm.server_follower import ServerFollower
    from ..util.signals import run_until_signal

    init_info = {k: v for k, v in (("cache_dir", args.cache_dir), ("replica_id", args.replica_id)) if v is not None}
    follower = ServerFollower(
        args.server, args.store, mode=args.mode, pause_mode=args.pause_mode, init_info=init_info,
        poll_interval=args.poll_interval, max_poll_interval=args.max_poll_interval,
    )
    pin(follower, args)
    try:
        if args.once:
            follower.update()
        else:
            follower.initialise()
            run_until_signal(follower.run, threading.Event())
    finally:
        follower.close()
    return 0


def _follow_with_the_extension(args: argparse.Namespace) -> int:
    from ..appliers.checkpoint.files import checkpoint_specs
    from ..appliers.vllm.follower import VLLMFollower
    from ..appliers.vllm.rpc import ServerEngine
    from ..util.signals import run_until_signal

    try:
        checkpoint_specs(args.model)  # before waiting for the server: a wrong --model is known now
    except FileNotFoundError:
        raise ConfigError(f"--model {args.model}: not a checkpoint directory (no *.safetensors): give the "
                          "directory the server loaded", argument="model") from None
    ServerEngine(args.server).wait_until_up(args.wait_for_server, log=logger.info)
    follower = VLLMFollower(
        args.server, model=args.model, mode=args.mode, pause_mode=args.pause_mode, lora=args.lora,
        lora_name=args.lora_name,
    )
    sub = follower.subscriber(
        args.store,
        replica_id=args.replica_id,
        poll_interval=args.poll_interval,
        max_poll_interval=args.max_poll_interval,
        **({"cache_dir": args.cache_dir} if args.cache_dir else {}),
    )
    pin(sub, args)
    with sub:
        try:
            if args.once:
                sub.update()
            else:
                run_until_signal(sub.run, threading.Event())
        finally:
            follower.close()
    return 0
