"""The ``deltasync/*`` figures a trainer's logs carry, from the versions committed since the last log."""

from __future__ import annotations

from collections.abc import Sequence

from ...publish.engine import PublishInfo

__all__ = ["publish_metrics"]


def publish_metrics(infos: Sequence[PublishInfo], version: int | None) -> dict[str, float]:
    """Averages over the deltas of ``infos`` (bytes, compression, sparsity, changed elements, diff and publish
    seconds, coalesced publishes, the adapter form's share), the newest anchor's size, what catch-up spans cost per
    version, and ``version``."""
    out: dict[str, float] = {}
    if version is not None:
        out["deltasync/version"] = version
    deltas = [i for i in infos if i.kind == "delta"]
    if deltas:
        n = len(deltas)
        out["deltasync/versions"] = n
        out["deltasync/bytes"] = sum(i.bytes for i in deltas) / n
        out["deltasync/dense_bytes"] = deltas[-1].dense_bytes
        out["deltasync/compression"] = sum(i.dense_bytes / max(i.bytes, 1) for i in deltas) / n
        out["deltasync/sparsity"] = sum(i.sparsity for i in deltas) / n
        out["deltasync/changed"] = sum(i.nnz for i in deltas) / n
        out["deltasync/diff_s"] = sum(i.t_diff for i in deltas) / n
        out["deltasync/publish_s"] = sum(i.t_total for i in deltas) / n
        out["deltasync/coalesced"] = sum(i.coalesced for i in deltas)
        if any(i.form for i in deltas):  # a LoRA run with lora="auto" / "adapter"
            out["deltasync/adapter_form"] = sum(i.form == "adapter" for i in deltas) / n
    anchors = [i for i in infos if i.kind == "anchor"]
    if anchors:
        out["deltasync/anchor_bytes"] = anchors[-1].bytes
    spans = [i for i in infos if i.kind == "span"]
    if spans and deltas:  # what catch-up spans cost the trainer, per version
        out["deltasync/span_bytes"] = sum(i.bytes for i in spans) / len(deltas)
        out["deltasync/span_s"] = sum(i.t_total for i in spans) / len(deltas)
    return out
