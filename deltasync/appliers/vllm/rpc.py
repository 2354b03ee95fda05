"""Transport, node side: how the follower reaches the workers of one vLLM engine.

Two engines answer the same five calls (``rpc``, ``pause``, ``resume``,
``label``, ``reset_prefix_cache``):

- :class:`InProcessEngine`: an ``LLM`` in this process; ``collective_rpc``
  already runs between engine steps, so pausing is a no-op. Arguments travel
  as raw ``bytes`` (``text = False``).
- :class:`ServerEngine`: a ``vllm serve`` server started with
  ``VLLM_SERVER_DEV_MODE=1``, through ``/collective_rpc``, ``/pause``,
  ``/resume``, ``/update_weight_version`` and ``/reset_prefix_cache``.
  Arguments travel as base64 text (``text = True``), since the server passes
  only strings through. A LoRA run's adapter is loaded through
  ``/v1/load_lora_adapter`` (:meth:`ServerEngine.load_lora`).

And the engine's weight-version label (:func:`version_label`,
:func:`parse_version_label`): version @ run id prefix.

Limitations:

- The in-process ``LLM`` must be driven from the thread that owns it (vLLM's
  synchronous client is not thread-safe).
- The server is reached with ``urllib``: no retries, no authentication
  header; an HTTP error or an unreachable server raises
  :class:`~deltasync.errors.DeltaSyncError` naming the URL.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any

from ... import errors
from ...errors import DeltaSyncError

__all__ = ["InProcessEngine", "ServerEngine", "HTTP_TIMEOUT_S", "version_label", "parse_version_label"]

HTTP_TIMEOUT_S = 600.0  # per request; also the collective_rpc timeout the server is given


class InProcessEngine:
    """An ``LLM`` in this process.

    Args:
        llm (`vllm.LLM`): started with the deltasync worker extension.
    """

    text = False
    """RPC payloads travel as raw bytes."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every worker; one answer per rank."""
        return list(self.llm.collective_rpc(method, args=args))

    def pause(self, mode: str) -> None:
        """Nothing to do: ``collective_rpc`` already runs between engine steps."""

    def resume(self) -> None:
        """Nothing to do (see :meth:`pause`)."""

    def label(self, version: str) -> None:
        """Set the engine's weight-version label."""
        self.llm.llm_engine.set_weight_version(version)

    def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks (computed with the old weights)."""
        self.llm.reset_prefix_cache()


class ServerEngine:
    """A ``vllm serve`` server in dev mode (``VLLM_SERVER_DEV_MODE=1``).

    Args:
        url (`str`): base URL, e.g. ``"http://127.0.0.1:8000"``.
        timeout (`float`, *optional*, defaults to `HTTP_TIMEOUT_S`): seconds per request.
    """

    text = True
    """RPC payloads travel as base64 text."""

    def __init__(self, url: str, timeout: float = HTTP_TIMEOUT_S) -> None:
        self.url, self.timeout = url.rstrip("/"), timeout

    def _post(self, path: str, body: Any = None, *, text: bool = False) -> Any:
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(
            self.url + path, data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            refused = _refusal(detail)
            if refused is not None:  # the deltasync backend refused: its own error, with its message
                raise refused from None
            raise DeltaSyncError(f"{self.url}{path} answered {exc.code}: {detail}", url=self.url) from None
        except urllib.error.URLError as exc:
            raise DeltaSyncError(
                f"cannot reach {self.url}{path} ({exc.reason}); is the server up with VLLM_SERVER_DEV_MODE=1?",
                url=self.url,
            ) from None
        except (OSError, http.client.HTTPException) as exc:  # reached, then the answer timed out or broke off
            raise DeltaSyncError(f"{self.url}{path}: the answer broke off ({exc})", url=self.url) from None
        if text:
            return raw.decode(errors="replace")
        try:
            return json.loads(raw) if raw else None
        except (ValueError, RecursionError):  # another service at this URL, or a proxy's error page
            raise DeltaSyncError(
                f"{self.url}{path} answered with something other than JSON ({raw[:60]!r}): is this URL a vLLM "
                "server started with the deltasync worker extension?", url=self.url,
            ) from None

    def wait_until_up(self, timeout: float, *, interval: float = 1.0, log: Any = None) -> None:
        """Wait for the server's ``/health`` to answer (a follower started beside a server still loading).

        Says once (through ``log``) that it is waiting.

        Raises:
            `DeltaSyncError`: not up within ``timeout`` seconds (``0``: a single try).
        """
        deadline = time.monotonic() + timeout
        said = False
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=min(self.timeout, 10.0)) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() >= deadline:
                raise DeltaSyncError(
                    f"no vLLM server answered at {self.url}/health within {timeout:.0f} s: start it (dev mode, "
                    "with the deltasync worker extension), check the URL, or wait longer (--wait-for-server)",
                    url=self.url,
                )
            if not said and log is not None:
                log(f"waiting for the vLLM server at {self.url} (up to {timeout:.0f} s) ...")
                said = True
            time.sleep(interval)

    def rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every worker through ``/collective_rpc``; one answer per rank."""
        body = {"method": method, "args": list(args), "timeout": self.timeout, **({"kwargs": kwargs} if kwargs else {})}
        answer = self._post("/collective_rpc", body)
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list):
            raise DeltaSyncError(f"{self.url}/collective_rpc answered without a list of results ({str(answer)[:80]}): "
                                 "is this URL a vLLM server in dev mode (VLLM_SERVER_DEV_MODE=1)?", url=self.url)
        return results

    def pause(self, mode: str) -> None:
        """``/pause?mode=...``: ``keep`` freezes the scheduler, ``wait`` / ``abort`` drain requests."""
        self._post(f"/pause?mode={mode}")

    def resume(self) -> None:
        """``/resume``."""
        self._post("/resume")

    def label(self, version: str) -> None:
        """Set the engine's weight-version label (``/update_weight_version``)."""
        self._post("/update_weight_version", {"new_version": version})

    def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks (computed with the old weights)."""
        self._post("/reset_prefix_cache")

    # ------------------------------------------------------------------ vLLM's weight-transfer round trip

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """``/init_weight_transfer_engine``: point the engine's weight-transfer backend at ``init_info``."""
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        """``/start_weight_update``."""
        self._post("/start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """``/update_weights``: a refusal of the deltasync backend raises its own typed error."""
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``/finish_weight_update``, labelling the weights ``weight_version``."""
        self._post("/finish_weight_update", {"weight_version": weight_version})

    def weight_version(self) -> str | None:
        """The engine's weight-version label (``/weight_info``)."""
        request = urllib.request.Request(self.url + "/weight_info", method="GET")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer = json.loads(response.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise DeltaSyncError(f"cannot read {self.url}/weight_info ({exc})", url=self.url) from None
        label = answer.get("weight_version") if isinstance(answer, dict) else None
        return label if isinstance(label, str) else None

    def load_lora(self, name: str, path: str) -> None:
        """Load the adapter in ``path`` as ``name``, replacing the one loaded under that name
        (``/v1/load_lora_adapter`` with ``load_inplace``; the server needs ``--enable-lora`` and
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``)."""
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": True}, text=True)


RUN_LABEL_CHARS = 12  # run id characters in the version label: enough to tell runs apart, short in logs


def version_label(version: int, run_id: str | None) -> str:
    """The engine's weight-version label: ``"7@3f1d2c4b5a6e"`` (version @ run id prefix), or ``"7"``.

    The run id part lets a trainer tell a server that follows its run from one
    that still holds the same version number of an earlier run.
    """
    return f"{version}@{run_id[:RUN_LABEL_CHARS]}" if run_id else str(version)


def parse_version_label(label: Any, run_id: str | None) -> int | None:
    """The version in ``label`` if it belongs to ``run_id`` (labels without a run id are accepted)."""
    if not isinstance(label, str):
        return None
    number, _, run = label.partition("@")
    if run and run_id is not None and not run_id.startswith(run):
        return None
    try:
        return int(number)
    except ValueError:
        return None  # "default": nothing applied yet


def _refusal(body: str) -> DeltaSyncError | None:
    """The deltasync error a server's JSON error body names (``{"error": {"type", "message"}}``), else ``None``."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError, RecursionError):
        return None
    kind = error.get("type") if isinstance(error, dict) else None
    cls = getattr(errors, kind, None) if isinstance(kind, str) else None
    if not (isinstance(cls, type) and issubclass(cls, DeltaSyncError)):
        return None
    try:
        return cls(str(error.get("message")))
    except TypeError:
        return DeltaSyncError(str(error.get("message")))
