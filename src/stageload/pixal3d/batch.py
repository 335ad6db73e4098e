"""Several images through one Pixal3D pipeline, stage-major: each model loaded once.

:class:`BatchRun` is a :class:`Pixal3DRun` whose per-image state (the image's port
arguments, its current stage, the stages it reached, its fingerprints) lives in the
thread of the image's call, so :meth:`StagedModels.map` can interleave the images at
stage boundaries. The pipeline, its hooks and the staged models are the run's, shared.
With ``load="eager"`` the images run one after the other on the eagerly loaded pipeline.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from .adapter import Pixal3DRun, RunResult
from .fingerprints import Fingerprints

# Pixal3DRun's attributes that belong to one image; each is kept per call thread.
_PER_IMAGE = ("args", "stage", "reached", "fingerprints")


def _per_image(name: str) -> property:
    def get(self: BatchRun) -> Any:
        local = self.__dict__["_local"]
        return getattr(local, name) if getattr(local, "image", False) else self.__dict__[name]

    def set_(self: BatchRun, value: Any) -> None:
        local = self.__dict__["_local"]
        if getattr(local, "image", False):
            setattr(local, name, value)
        else:  # the run's own value, set by Pixal3DRun.__init__
            self.__dict__[name] = value

    return property(get, set_, doc=f"``{name}`` of the image whose call runs in this thread.")


class BatchRun(Pixal3DRun):
    """A Pixal3DRun for several images; :meth:`execute_many` runs them.

    ``fingerprints``, if given, is a folder that gets one subfolder per image (its output
    file's stem).
    """

    args = _per_image("args")
    stage = _per_image("stage")
    reached = _per_image("reached")
    fingerprints = _per_image("fingerprints")

    def __init__(self, port: Any, args: Any, **options: Any) -> None:
        self.__dict__["_local"] = threading.local()
        self._folder = options.get("fingerprints")
        super().__init__(port, args, **options)

    def execute_many(self, images: list[Any]) -> list[RunResult | Exception]:
        """Run every image (each its port ``args``); results in order, an image that failed
        has its exception in its slot and the others still run. Staged: stage-major through
        ``models.map``, so each model loads once for all images."""
        if self.models is not None:
            results = self.models.map(self._one, images, return_exceptions=True)
        else:
            results = [_caught(self._one, args) for args in images]
        for result in results:  # an interrupt is no image's failure
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
        return results

    def _one(self, args: Any) -> RunResult:
        local = self._local
        folder = None if self._folder is None else Path(self._folder) / Path(args.output).stem
        local.__dict__.update(image=True, args=args, stage=None, reached=[])
        local.fingerprints = Fingerprints(folder)
        try:
            return self.execute()  # its state is this image's (see _per_image)
        finally:
            local.image = False


def _caught(fn: Any, args: Any) -> RunResult | Exception:
    try:
        return fn(args)
    except Exception as exc:  # noqa: BLE001 (returned in the image's slot)
        return exc


def run_many(port: Any, images: list[Any], **options: Any) -> list[RunResult | Exception]:
    """Build one :class:`BatchRun` (from the first image's arguments) and run every image.

    ``images`` are the port's ``parse_args`` results, one per image; they must agree on
    everything but the image, the output and the seed (the pipeline is built once).
    """
    if not images:
        return []
    with BatchRun(port, images[0], **options) as batch_run:
        return batch_run.execute_many(images)
