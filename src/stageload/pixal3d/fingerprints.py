"""Hash each sampler's latent, so runs can be compared bit for bit."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch


def latent_tensors(latent: Any) -> dict[str, torch.Tensor]:
    """The tensors of a latent: itself, or a sparse tensor's ``feats`` and ``coords``."""
    if isinstance(latent, torch.Tensor):
        return {"samples": latent}
    found = {k: getattr(latent, k, None) for k in ("feats", "coords")}
    found = {k: v for k, v in found.items() if isinstance(v, torch.Tensor)}
    if not found:
        raise TypeError(
            f"cannot fingerprint a latent of type {type(latent).__qualname__}: expected a "
            "tensor or an object with .feats/.coords tensors"
        )
    return found


def sha256(latent: Any) -> str:
    """sha256 over each tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name, t in latent_tensors(latent).items():
        t = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Fingerprints:
    """Collects one record per sampler call; writes them (and the latents) to a folder."""

    def __init__(self, folder: str | Path | None = None) -> None:
        self.folder = None if folder is None else Path(folder)
        self.records: list[dict[str, Any]] = []
        self._latents: list[dict[str, torch.Tensor]] = []

    def add(self, latent: Any, *, sampler: str, stage: str | None) -> dict[str, Any]:
        tensors = latent_tensors(latent)
        record = {
            "index": len(self.records),
            "stage": stage,
            "sampler": sampler,
            "sha256": sha256(latent),
            "shapes": {k: list(v.shape) for k, v in tensors.items()},
        }
        self.records.append(record)
        if self.folder is not None:
            self._latents.append({k: v.detach().to("cpu").clone() for k, v in tensors.items()})
        return record

    def hashes(self) -> list[str]:
        return [r["sha256"] for r in self.records]

    def write(self, **meta: Any) -> Path | None:
        """Write ``fingerprints.json`` and one ``NN-stage.pt`` copy per latent."""
        if self.folder is None:
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        for record, tensors in zip(self.records, self._latents, strict=True):
            name = f"{record['index']:02d}-{record['stage']}.pt"
            torch.save(tensors, self.folder / name)
            record["file"] = name
        path = self.folder / "fingerprints.json"
        path.write_text(json.dumps({**meta, "latents": self.records}, indent=1) + "\n")
        return path
