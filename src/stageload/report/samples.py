"""Running statistics and a decimated series of a trace's samples, kept as they stream by.

A report needs per-stage maxima, minima and counts, and a plot a few thousand points per
line, so neither holds every sample (a trace of 10^6 samples held as objects took 400 MiB).

``SampleStats`` keeps the figures per *segment* of time. The segments are cut at
``bounds``, every time a window or a view can begin or end (all known from the events
before the samples are read): for each bound ``b`` one segment holds the samples at exactly
``t == b`` and one those strictly between ``b`` and the next bound. Any span whose ends are
bounds, half-open or closed, is then a run of whole segments, so a stage window's figures
are exact whatever order the samples come in. ``Lines`` keeps a plot's points: all of them
up to a few thousand, then the lowest and highest point of each of a few thousand time
buckets, so peaks and troughs still show.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

#: A line keeps every point up to ``4 * SERIES_BUCKETS``; beyond that, the lowest and
#: highest point of each of ``SERIES_BUCKETS`` to ``2 * SERIES_BUCKETS`` time buckets
#: (at most 8,000 points: a 10-inch panel at 110 dpi is 1,100 pixels wide).
SERIES_BUCKETS = 2000


@dataclass
class Figures:
    """What the report shows about a span of samples; ``None`` where no sample had it."""

    samples: int = 0
    peak_footprint: int | None = None
    lowest_available: int | None = None
    lowest_available_pct: float | None = None
    #: Swap in use at the first and last sample (by ``t``, then file order) that read it,
    #: and the highest reading.
    swap_start: int | None = None
    swap_end: int | None = None
    swap_peak: int | None = None
    device_peak: dict[str, int] = field(default_factory=dict)
    # ``t`` of swap_start and swap_end, to merge spans (a later span's first is later).
    _swap_start_t: float = 0.0
    _swap_end_t: float = 0.0

    def add(
        self,
        t: float,
        footprint: int | None,
        available: int | None,
        available_pct: float | None,
        swap_used: int | None,
        device: dict[str, int] | None,
    ) -> None:
        """Count one sample in (values already range-checked; ``None`` is missing)."""
        self.samples += 1
        if footprint is not None and (
            self.peak_footprint is None or footprint > self.peak_footprint
        ):
            self.peak_footprint = footprint
        if available is not None and (
            self.lowest_available is None or available < self.lowest_available
        ):
            self.lowest_available = available
        if available_pct is not None and (
            self.lowest_available_pct is None or available_pct < self.lowest_available_pct
        ):
            self.lowest_available_pct = available_pct
        if swap_used is not None:
            if self.swap_start is None:
                self.swap_start = self.swap_end = self.swap_peak = swap_used
                self._swap_start_t = self._swap_end_t = t
            else:
                # Strict for the first, not for the last: of samples at one t, the first
                # in the file is the start and the last in the file the end, as a stable
                # sort by t would have them.
                if t < self._swap_start_t:
                    self.swap_start, self._swap_start_t = swap_used, t
                if t >= self._swap_end_t:
                    self.swap_end, self._swap_end_t = swap_used, t
                if swap_used > self.swap_peak:  # type: ignore[operator]
                    self.swap_peak = swap_used
        if device:
            peaks = self.device_peak
            for key, value in device.items():
                if value > peaks.get(key, value - 1):
                    peaks[key] = value

    def merge(self, later: Figures) -> None:
        """Add the figures of ``later``, a span that comes after this one in time."""
        if not later.samples:
            return
        self.samples += later.samples
        self.peak_footprint = _pick(max, self.peak_footprint, later.peak_footprint)
        self.lowest_available = _pick(min, self.lowest_available, later.lowest_available)
        self.lowest_available_pct = _pick(
            min, self.lowest_available_pct, later.lowest_available_pct
        )
        if later.swap_start is not None:
            if self.swap_start is None:
                self.swap_start, self._swap_start_t = later.swap_start, later._swap_start_t
            self.swap_end, self._swap_end_t = later.swap_end, later._swap_end_t
            self.swap_peak = _pick(max, self.swap_peak, later.swap_peak)
        for key, value in later.device_peak.items():
            self.device_peak[key] = max(self.device_peak.get(key, value), value)


def _pick(fn, a, b):  # type: ignore[no-untyped-def]
    if a is None:
        return b
    return a if b is None else fn(a, b)


class SampleStats:
    """``Figures`` per segment between ``bounds`` (see the module docstring); ``series``
    also keeps the footprint, swap and available lines for a plot."""

    def __init__(self, bounds: Iterable[float], *, series: bool = False) -> None:
        self.bounds = sorted(set(bounds))
        # Segment 0: before the first bound; then for bound i, 1 + 2i holds t == bound and
        # 2 + 2i the samples strictly between it and the next bound.
        self._segments = [Figures() for _ in range(1 + 2 * len(self.bounds))]
        #: The plot's lines (``series=True``), else None.
        self.lines = Lines() if series else None
        #: The largest ``t`` added.
        self.last_t = 0.0
        # The segments merged pairwise for ``span`` (``_merged``); None until asked for.
        self._tree: list[Figures] | None = None

    def add(
        self,
        t: float,
        footprint: int | None,
        available: int | None,
        available_pct: float | None,
        swap_used: int | None,
        device: dict[str, int] | None = None,
    ) -> None:
        """Count one sample in (values already range-checked; ``None`` is missing)."""
        bounds = self.bounds
        i = bisect_right(bounds, t)  # bounds[i - 1] <= t < bounds[i]
        segment = 2 * i - 1 if i and bounds[i - 1] == t else 2 * i
        self._segments[segment].add(t, footprint, available, available_pct, swap_used, device)
        self._tree = None
        if t > self.last_t:
            self.last_t = t
        if self.lines is not None:
            self.lines.add(t, footprint, swap_used, available)

    def span(self, start: float, end: float, *, closed: bool) -> Figures:
        """The figures of the samples with ``start <= t < end`` (``<= end`` if ``closed``).

        ``start`` must be one of ``bounds``, and so must ``end`` unless no sample added
        is later than it (the last window ends at the last record): otherwise a segment
        would be cut, and ``ValueError`` says so.
        """
        bounds = self.bounds
        first = bisect_left(bounds, start)
        if first == len(bounds) or bounds[first] != start:
            raise ValueError(f"a span must start at a bound of the samples, not at t={start}")
        at = bisect_left(bounds, end)
        if at < len(bounds) and bounds[at] == end:
            stop = 2 * at + 2 if closed else 2 * at + 1
        elif end > self.last_t or (closed and end == self.last_t):  # no sample past end
            stop = 2 * at + 1
        else:
            raise ValueError(f"a span must end at a bound of the samples, not at t={end}")
        return self._merged(2 * first + 1, stop)

    def _merged(self, lo: int, hi: int) -> Figures:
        """The figures of segments ``lo`` to ``hi - 1``, in O(log n) merges: a report of a
        trace of thousands of processes asks for thousands of overlapping spans.

        ``_tree`` is a segment tree over the segments (built at the first span after an
        ``add``): node ``k`` holds nodes ``2k`` and ``2k + 1`` merged, leaf ``n + i``
        segment ``i``. ``Figures.merge`` is associative, so merging the nodes that cover
        the range, left to right, gives what merging its segments one by one would.
        """
        n = len(self._segments)
        if self._tree is None:
            tree = [Figures() for _ in range(n)] + self._segments
            for k in range(n - 1, 0, -1):
                tree[k].merge(tree[2 * k])
                tree[k].merge(tree[2 * k + 1])
            self._tree = tree
        tree = self._tree
        figures, later = Figures(), []
        lo, hi = lo + n, hi + n
        while lo < hi:
            if lo & 1:
                figures.merge(tree[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                later.append(tree[hi])
            lo, hi = lo // 2, hi // 2
        for node in reversed(later):
            figures.merge(node)
        return figures


class Lines:
    """The footprint, swap and available lines of a plot, decimated once there are many:
    the lowest and highest point of each line in each time bucket (shared by the three),
    so a peak of one sample still shows."""

    #: The lines, in the order ``add`` takes them.
    NAMES = ("footprint", "swap_used", "available")

    def __init__(self, buckets: int = SERIES_BUCKETS) -> None:
        self._limit = buckets
        self._raw: list[tuple[float, int | None, int | None, int | None]] | None = []
        self._width = 0.0
        # bucket -> for each line: t of its lowest, lowest, t of its highest, highest
        self._buckets: dict[int, list[Any]] = {}
        self._key = -1
        self._bucket: list[Any] = []

    @property
    def decimated(self) -> bool:
        return self._raw is None

    def add(self, t: float, *values: int | None) -> None:
        """Add the point at ``t`` of each line (``None``: that line has none there)."""
        raw = self._raw
        if raw is not None:
            raw.append((t, *values))
            if len(raw) > 4 * self._limit:
                self._to_buckets(raw)
            return
        key = int(t / self._width)
        if key == self._key:  # samples come nearly in time order: mostly the same bucket
            bucket = self._bucket
        else:
            bucket = self._buckets.get(key)  # type: ignore[assignment]
            if bucket is None:
                bucket = self._buckets[key] = [None] * (4 * len(self.NAMES))
                if len(self._buckets) > 2 * self._limit:
                    self._coarsen()
                    key = int(t / self._width)
                    bucket = self._buckets[key]
            self._key, self._bucket = key, bucket
        at = 0
        for value in values:
            if value is not None:
                if bucket[at + 1] is None:
                    bucket[at : at + 4] = (t, value, t, value)
                elif value < bucket[at + 1]:
                    bucket[at], bucket[at + 1] = t, value
                elif value > bucket[at + 3]:
                    bucket[at + 2], bucket[at + 3] = t, value
            at += 4

    def _to_buckets(self, raw: list[Any]) -> None:
        self._raw = None
        times = [point[0] for point in raw]
        self._width = (max(times) - min(times)) / self._limit or 1e-6
        for point in raw:
            self.add(*point)

    def _coarsen(self) -> None:
        """Halve the number of buckets: twice as wide, neighbours merged."""
        self._width *= 2
        self._key = -1
        merged: dict[int, list[Any]] = {}
        for key, bucket in sorted(self._buckets.items()):
            into = merged.get(key // 2)
            if into is None:
                merged[key // 2] = bucket
                continue
            for at in range(0, len(bucket), 4):
                if bucket[at + 1] is None:
                    continue
                if into[at + 1] is None:
                    into[at : at + 4] = bucket[at : at + 4]
                    continue
                if bucket[at + 1] < into[at + 1]:
                    into[at], into[at + 1] = bucket[at], bucket[at + 1]
                if bucket[at + 3] > into[at + 3]:
                    into[at + 2], into[at + 3] = bucket[at + 2], bucket[at + 3]
        self._buckets = merged

    def points(
        self, name: str, start: float = 0.0, end: float = float("inf")
    ) -> list[tuple[float, int]]:
        """The kept points of line ``name`` with ``start <= t <= end``, in time order."""
        i = self.NAMES.index(name)
        kept: list[tuple[float, int]] = []
        if self._raw is not None:
            # A stable sort: points at one t keep file order, as the samples did.
            for point in sorted(self._raw, key=lambda p: p[0]):
                if point[i + 1] is not None:
                    kept.append((point[0], point[i + 1]))
        else:
            at = 4 * i
            for key in sorted(self._buckets):
                t_low, low, t_high, high = self._buckets[key][at : at + 4]
                if low is None:
                    continue
                if (t_low, low) == (t_high, high):
                    kept.append((t_low, low))
                else:
                    kept += sorted([(t_low, low), (t_high, high)], key=lambda p: p[0])
        return [(t, v) for t, v in kept if start <= t <= end]
