"""Several images through one Pixal3D pipeline, stage-major: each model loaded once.

:class:`BatchRun` is a :class:`Pixal3DRun` whose per-image state (an :class:`Image`: the
image's port arguments, its current stage, the stages it reached, its fingerprints) lives
in the context of the image's call, so :meth:`StagedModels.map` can interleave the images
at stage boundaries. The pipeline, its hooks and the staged models are the run's, shared.
With ``load="auto"`` the same batch runs on auto's
:class:`~stageload.autostage.StageMajor` (auto loads the models); with
``load="eager"`` the images run one after the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .adapter import Image, Pixal3DRun, RunResult
from .fingerprints import Fingerprints


class BatchRun(Pixal3DRun):
    """A Pixal3DRun for several images; :meth:`execute_many` runs them.

    ``fingerprints``, if given, is a folder that gets one subfolder per image (its output
    file's stem).
    """

    def __init__(self, port: Any, args: Any, **options: Any) -> None:
        self._folder = options.get("fingerprints")
        super().__init__(port, args, **options)

    def execute_many(self, images: list[Any]) -> list[RunResult | Exception]:
        """Run every image (each its port ``args``); results in order, an image that failed
        has its exception in its slot and the others still run. Staged or auto: stage-major,
        so each model loads once for all images."""
        if self.models is not None:
            results = self.models.map(self._one, images, return_exceptions=True)
        elif self.auto_stages is not None:  # the same order, auto loading
            results = self.auto_stages.map(self._one, images, return_exceptions=True)
        else:
            results = [_caught(self._one, args) for args in images]
        for result in results:  # an interrupt is no image's failure
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
        return results

    def _one(self, args: Any) -> RunResult:
        folder = None if self._folder is None else Path(self._folder) / Path(args.output).stem
        return self.run_image(Image(args, Fingerprints(folder)))


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
