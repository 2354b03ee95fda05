"""deltasync live: the Gradio page. Runs as a Hugging Face Space and locally (``./scripts/spaces``).

The logic (trainer, replica, bookkeeping) lives in ``engine.py`` and ``policy.py``; this file is
only the layout and the glue. A one-second timer refreshes the page from ``Session.view()``.

    python spaces_demo/app.py [--host 127.0.0.1] [--port 7860]

Host and port default to ``GRADIO_SERVER_NAME`` / ``GRADIO_SERVER_PORT`` (a Space sets them) and
then to Gradio's own defaults. ``DELTASYNC_SPACES_LAYERS`` preselects the model size;
``DELTASYNC_HF_BUCKET`` and ``HF_TOKEN`` preset the Hugging Face bucket (the token never shows).
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home from a demo

import gradio as gr  # noqa: E402
import pandas as pd  # noqa: E402

from deltasync.codec import codec_names  # noqa: E402
from deltasync.demo.board import human_bytes  # noqa: E402
from deltasync.errors import DeltaSyncError  # noqa: E402

if __package__:  # imported as spaces_demo.app
    from .engine import Session, Settings, View  # noqa: E402
    from .policy import FULL_LAYERS, MAX_NEW_TOKENS, SAMPLES  # noqa: E402
else:
    from engine import Session, Settings, View  # noqa: E402
    from policy import FULL_LAYERS, MAX_NEW_TOKENS, SAMPLES  # noqa: E402

SIZES = [
    (f"{FULL_LAYERS} layers: SmolLM2-135M-Instruct, 134.5 M parameters", FULL_LAYERS),
    ("its first 8 layers (56.6 M parameters)", 8),
    ("2 layers (35.4 M)", 2),
    ("1 layer (31.9 M, fastest)", 1),
]
# The versions table and each column's width in px: the whole table fits the page's 1220 px, wrapping
# long cells (an anchor beside a delta) instead of hiding the last columns behind a scroll bar.
COLUMN_WIDTHS = {
    "version": 84,
    "step": 60,
    "kind": 75,
    "bit-exact": 84,
    "changed": 160,
    "shipped": 110,
    "raw int32+bf16": 110,
    "dense / shipped": 84,
    "apply ms": 70,
    "lag s": 60,
    "diff ms": 64,
    "commit s": 76,
    "reward": 76,
    "loss": 68,
}
COLUMNS = list(COLUMN_WIDTHS)
MIN_AXIS_VERSIONS = 10
SHIPPED, RAW = (
    "shipped (selected codec)",
    "raw int32+bf16 (6 B per change)",
)  # fixed series: the plot's colours stay put

INTRO = f"""
# deltasync live: exact sparse weight sync for RL, in your browser

A **trainer** fine-tunes SmolLM2-135M-Instruct on CPU (fp32 masters, AdamW at an RL learning rate)
and publishes a **deltasync** version after every optimizer step: only the bf16 elements that changed,
as one sparse safetensors file, into a store (a local temporary directory, or your Hugging Face bucket).
A **replica** (a bf16 copy of the model in this process) follows the store, verifies and applies each
version in place, and answers your prompts. After every version both sides hash their bf16 weights:
the replica must be bit-identical to what the trainer published.

**The toy reward** (honest and simple): per step, two prompts of a small chat set; {SAMPLES} completions
sampled per prompt ({MAX_NEW_TOKENS} tokens, temperature 1) are scored by the share of the reference
answer's words they contain; the reference answer joins each group with reward 1, so every group has a
signal; the update is REINFORCE with the group-mean baseline. The smaller models keep the first layers of
the same checkpoint: steps are quicker, answers are gibberish, the sparsity is real.
"""


def _settings(layers: Any, lr: Any, anchor_every: Any, codec: str, steps: Any, bucket: str, token: str) -> Settings:
    try:
        return Settings(
            layers=int(layers),
            lr=float(lr),
            anchor_every=int(anchor_every),
            codec=codec,
            steps=int(steps),
            hf_bucket=bucket or "",
            hf_token=token or "",
        )
    except (TypeError, ValueError) as exc:
        raise gr.Error(str(exc)) from None


def _table(view: View) -> pd.DataFrame:
    rows = []
    for r in view.rows:
        codec = human_bytes(r.info.bytes) + (f" (+ anchor {human_bytes(r.anchor_bytes)})" if r.anchor_bytes else "")
        rows.append(
            [
                r.info.version,
                r.info.step,
                r.info.kind,
                r.exact(view.replica_version),
                f"{r.info.nnz:,}" + (f" ({100 * r.info.nnz / r.info.numel:.2f} %)" if r.info.kind == "delta" else ""),
                codec,
                human_bytes(r.raw_bytes),
                f"{r.info.dense_bytes / r.info.bytes:.0f}x" if r.info.bytes else "-",
                "-" if r.apply_s is None else f"{1e3 * r.apply_s:.0f}",
                "-" if r.lag_s is None else f"{r.lag_s:.2f}",
                f"{1e3 * r.info.t_diff:.0f}",
                f"{r.info.t_total:.2f}",
                "-" if r.reward is None else f"{r.reward:.2f}",
                "-" if r.loss is None else f"{r.loss:.3f}",
            ]
        )
    return pd.DataFrame(list(reversed(rows)), columns=COLUMNS)  # newest first


def _plots(view: View) -> tuple[pd.DataFrame, pd.DataFrame, list[float]]:
    """The two plots' data, and the version axis they share."""
    deltas = [r for r in view.rows if r.info.kind == "delta"]  # the anchor (v0) is the whole model
    size = pd.DataFrame(
        [(r.info.version, r.info.bytes / 1e6, SHIPPED) for r in deltas]
        + [(r.info.version, r.raw_bytes / 1e6, RAW) for r in deltas],
        columns=["version", "MB", "payload"],
    )
    changed = pd.DataFrame(
        [(r.info.version, 100 * r.info.nnz / r.info.numel) for r in deltas], columns=["version", "changed %"]
    )
    return (
        # Explicit dtypes: an empty first frame would otherwise make the axes categorical for good.
        size.astype({"version": "int64", "MB": "float64"}),
        changed.astype({"version": "int64", "changed %": "float64"}),
        version_axis([r.info.version for r in deltas]),
    )


def version_axis(versions: Sequence[int]) -> list[float]:
    """The x range of the plots: at least :data:`MIN_AXIS_VERSIONS` wide, so every tick is a whole version.

    The plots choose about one tick per 40 px; at the page's widths (at most about 400 px per plot) a
    range of ten or more versions gets a step of 1 or more, where a short one would get ticks at 1.5.
    """
    first = min(versions, default=1)
    return [first, max(max(versions, default=first), first + MIN_AXIS_VERSIONS)]


def _panels(view: View) -> tuple[str, str, str, str]:
    status = view.status if view.error is None else f"{view.status}: {view.error}"
    if view.publish_error:  # the trainer keeps training; the page must not look as if all were well
        status += f" · publishing is failing: {view.publish_error}"
    dense = human_bytes(view.rows[0].info.dense_bytes) if view.rows else "-"
    trainer = (
        f"**Trainer**: v{view.latest if view.latest is not None else '-'} committed · "
        f"{(view.params or 0) / 1e6:.1f} M parameters (dense bf16 {dense}) · "
        f"{view.coalesced} publishes coalesced · store `{view.store or '-'}`"
    )
    last = next((r for r in reversed(view.rows) if r.apply_s is not None), None)
    replica = (
        f"**Replica**: v{view.replica_version if view.replica_version is not None else '-'} · "
        f"lag {view.lag_versions if view.lag_versions is not None else '-'} versions"
        + (f" ({last.lag_s:.2f} s from publish to applied) · last apply {1e3 * last.apply_s:.0f} ms" if last else "")
        + (f" · last refused update: {view.replica_error}" if view.replica_error else "")
    )
    checked, matched, skipped = view.exact_counts()
    verdict = "ALL MATCH" if checked and matched == checked else ("MISMATCH" if checked else "waiting")
    exact = (
        f"**Bit-exact**: {verdict}: {matched}/{checked} versions the replica held hash equal to the trainer's "
        f"published bf16 (sha256 of bf16 bit patterns){f', {skipped} skipped by its route' if skipped else ''}"
    )
    return status, trainer, replica, exact


def build(session: Session) -> gr.Blocks:
    """The page, wired to ``session``."""
    default = Settings(layers=int(os.environ.get("DELTASYNC_SPACES_LAYERS", FULL_LAYERS)))
    with gr.Blocks(title="deltasync live") as demo:
        gr.Markdown(INTRO)
        with gr.Row():
            with gr.Column(scale=1, min_width=320):
                layers = gr.Dropdown(SIZES, value=default.layers, label="model", elem_id="layers")
                lr = gr.Number(default.lr, label="learning rate (AdamW)", elem_id="lr")
                anchor_every = gr.Number(
                    default.anchor_every, precision=0, label="anchor every N versions", elem_id="anchor-every"
                )
                codec = gr.Dropdown(codec_names(), value=default.codec, label="codec", elem_id="codec")
                steps = gr.Number(default.steps, precision=0, label="steps (0: until stopped)", elem_id="steps")
                with gr.Accordion("Hugging Face bucket (optional)", open=False):
                    bucket = gr.Textbox(
                        os.environ.get("DELTASYNC_HF_BUCKET", ""),
                        label="bucket: namespace/name[/prefix]",
                        elem_id="bucket",
                    )
                    token = gr.Textbox(
                        "", type="password", label="token (empty: HF_TOKEN of the Space)", elem_id="token"
                    )
                with gr.Row():
                    start = gr.Button("Start", variant="primary", elem_id="start")
                    stop = gr.Button("Stop", elem_id="stop")
            with gr.Column(scale=2):
                status = gr.Textbox("idle: press Start", label="status", interactive=False, elem_id="status")
                trainer_md = gr.Markdown(elem_id="trainer")
                replica_md = gr.Markdown(elem_id="replica")
                exact_md = gr.Markdown(elem_id="exact")
                with gr.Row():
                    size_plot = gr.LinePlot(
                        x="version",
                        y="MB",
                        color="payload",
                        title="MB per version (deltas)",
                        color_map={SHIPPED: "#ea580c", RAW: "#2563eb"},
                        height=260,
                        elem_id="plot-bytes",
                    )
                    sparsity_plot = gr.LinePlot(
                        x="version",
                        y="changed %",
                        title="bf16 elements changed per version (%)",
                        height=260,
                        elem_id="plot-sparsity",
                    )
        table = gr.Dataframe(
            headers=COLUMNS,
            column_widths=list(COLUMN_WIDTHS.values()),
            label="versions (newest first)",
            interactive=False,
            wrap=True,
            elem_id="versions",
        )
        with gr.Row():
            prompt = gr.Textbox("What is the capital of France?", label="ask the replica", scale=3, elem_id="prompt")
            ask = gr.Button("Ask", scale=1, elem_id="ask")
        answer_label = gr.Markdown(elem_id="answer-version")
        answer_box = gr.Textbox(label="replica's answer (greedy)", interactive=False, elem_id="answer")
        seen = gr.State(None)
        timer = gr.Timer(1.0)

        def on_start(*values: Any) -> str:
            try:
                session.start(_settings(*values))
            except RuntimeError as exc:
                raise gr.Error(str(exc)) from None
            return "starting"

        def on_stop() -> str:
            session.stop()
            return session.view().status

        def on_ask(text: str) -> tuple[str, str]:
            try:
                version, reply = session.ask(text)
            except (RuntimeError, ValueError, DeltaSyncError) as exc:
                raise gr.Error(str(exc)) from None
            shown = reply if reply.strip() else f"(whitespace only: {reply!r})"
            return f"answered by the replica at **v{version}**", shown

        def on_tick(previous: Any) -> tuple[Any, ...]:
            view = session.view()
            panels = _panels(view)
            key = tuple((r.info.version, r.replica_digest, r.loss, r.anchor_bytes) for r in view.rows)
            if key == previous:  # redraw plots and table only when something changed
                return (*panels, gr.skip(), gr.skip(), gr.skip(), previous)
            size, changed, axis = _plots(view)
            if size.empty:  # a chart first drawn from no rows draws later lines invisibly: wait for data
                return (*panels, gr.skip(), gr.skip(), _table(view), key)
            return (
                *panels, gr.LinePlot(size, x_lim=axis), gr.LinePlot(changed, x_lim=axis), _table(view), key
            )

        controls: Sequence[Any] = [layers, lr, anchor_every, codec, steps, bucket, token]
        start.click(on_start, controls, status)
        stop.click(on_stop, None, status)
        ask.click(on_ask, prompt, [answer_label, answer_box])
        prompt.submit(on_ask, prompt, [answer_label, answer_box])
        timer.tick(
            on_tick,
            seen,
            [status, trainer_md, replica_md, exact_md, size_plot, sparsity_plot, table, seen],
            show_progress="hidden",
        )
    return demo


def main(argv: Sequence[str] | None = None) -> None:
    """Serve the page until interrupted."""
    parser = argparse.ArgumentParser(description="deltasync live (Gradio)")
    parser.add_argument(
        "--host", default=os.environ.get("GRADIO_SERVER_NAME"), help="default: GRADIO_SERVER_NAME, then 127.0.0.1"
    )
    parser.add_argument("--port", type=int, default=None, help="default: GRADIO_SERVER_PORT, then 7860")
    args = parser.parse_args(argv)
    session = Session()
    # Ctrl-C and SIGTERM end the process through sys.exit, so the session stops its run and deletes its
    # temporary store (atexit) within seconds, instead of a kill that leaves it behind.
    atexit.register(session.close, timeout=10)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    build(session).queue(default_concurrency_limit=2).launch(
        server_name=args.host, server_port=args.port, show_error=True
    )


if __name__ == "__main__":
    main()
