"""Reaching a Ray cluster, and the memory request a trace gives: what both the Ray Data
path (``_predictor``) and ``run_batch`` (``_stream``) need, so neither imports the package."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def connect(**init_kwargs: Any) -> bool:
    """Make sure this process talks to a Ray cluster; True when it started a local one.

    Uses the connection the caller opened with ``ray.init``; else the running cluster
    (``ray.init(address="auto")``, which follows ``RAY_ADDRESS``); else starts a local Ray
    bound to 127.0.0.1 without the dashboard (``init_kwargs`` go to that ``ray.init``).
    """
    import ray

    if ray.is_initialized():
        return False
    try:
        ray.init(address="auto", log_to_driver=False)
        return False
    except ConnectionError:
        pass
    options = {
        "address": "local",
        "_node_ip_address": "127.0.0.1",
        "include_dashboard": False,
        **init_kwargs,
    }
    ray.init(**options)
    return True


def peak_from(source: str | os.PathLike[str]) -> int:
    """The peak footprint recorded in a trace (JSONL) or a ``stageload report --json``
    file (its highest peak over all columns)."""
    import json

    path = Path(source)
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("{") and '"traces"' in text[:4096]:
        try:
            peaks = [t.get("peak_footprint") for t in json.loads(text)["traces"]]
        except (ValueError, KeyError, TypeError, AttributeError):
            peaks = []
    else:
        from ..report.trace import load_summary

        peaks = [load_summary(path).peak_footprint]
    peaks = [p for p in peaks if isinstance(p, int) and p > 0]
    if not peaks:
        raise ValueError(
            f"memory={os.fspath(source)!r}: no peak footprint in that file; give a trace "
            f"written by MemoryMeter or 'stageload meter', or memory= in bytes or '6G'"
        )
    return max(peaks)
