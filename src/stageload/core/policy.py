"""Residency policies: which loaded models stay, which go, and what to load ahead.

``StagedModels`` asks its policy on every ``enter(stage)``. The default,
:class:`ReleaseUnlisted`, releases what the entered stage does not list. Under a memory
budget, :class:`FurthestNextUse` keeps models while they fit and, when something must go,
evicts the model whose next use is furthest away (Belady's rule; the plan is known, and
calls of a pipeline cycle through it). With prefetch on, it also names the next stage's
models to load in a background thread while the current stage computes.

Prefetching runs a loader on another thread, where ``preserved_rng()`` cannot help: torch's
global generator is process-wide, so restoring it there would undo the main thread's draws.
Only loaders that draw no random numbers may run there. Mark them with :func:`rng_free`
(the fast loader ``stageload.load.from_safetensors`` does), or list models in
``StagedModels(prefetch=[...])`` to opt them in yourself.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..load.loaders import is_rng_free
from .events import REASON_BUDGET, REASON_NOT_IN_PLAN
from .plan import Plan


@dataclass(frozen=True)
class PolicyView:
    """What a residency policy may look at: the stage plan and what is known of the models.

    ``stages`` is the :class:`~stageload.core.plan.Plan` (a mapping given here is made
    one): in pipeline order, and calls cycle through it; ask it for the next stage and the
    next use of a model. ``sizes`` holds bytes per
    model: measured at its last load, else given as ``StagedModels(sizes=...)``; a model
    missing from it has an unknown size. ``prefetchable`` names the models that may be
    loaded in the background.
    """

    stages: Plan
    pinned: frozenset[str]
    sizes: Mapping[str, int] = field(default_factory=dict)
    prefetchable: frozenset[str] = frozenset()
    #: Seconds each model's loads on demand (``load``, ``reload``) took, as their events
    #: measured them: the lower median of its last three.
    load_seconds: Mapping[str, float] = field(default_factory=dict)
    #: The same for its loads ahead (``prefetch``): into plain pages, not huge ones
    #: (``load.weights._destination``), and beside compute, they may take longer than on
    #: demand.
    prefetch_seconds: Mapping[str, float] = field(default_factory=dict)
    #: Seconds each stage computes: the shortest of its spans so far on the driving thread,
    #: less the time that thread spent loading or waiting for loads.
    compute_seconds: Mapping[str, float] = field(default_factory=dict)
    #: Seconds each stage took (measured as above, the shortest so far) while a prefetch ran
    #: beside it. The same statistic as ``compute_seconds``, so noise alone does not read
    #: as contention.
    contended_seconds: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.stages, Plan):  # a policy's own view, built from a dict
            object.__setattr__(self, "stages", Plan(self.stages))


#: The cost model weighs each model's load time as the lower median of its last this many
#: loads: one slow read (two reads at once, another process on the disk) does not decide
#: alone, even with only two timed.
LOADS_WEIGHED = 3


@dataclass
class Timings:
    """What the prefetch cost model weighs, measured as a pipeline runs: each model's last
    :data:`LOADS_WEIGHED` load times, on demand and ahead apart, and each stage's compute:
    its span on the driving thread less that thread's time in loads and waits for them, the
    shortest seen, alone and beside a load ahead. One per engine (``StagedModels``, auto's
    session); its owner's lock guards it."""

    loads: dict[str, list[float]] = field(default_factory=dict)
    aheads: dict[str, list[float]] = field(default_factory=dict)
    compute: dict[str, float] = field(default_factory=dict)
    #: A stage's span while a load ahead ran beside it: on few cores a background load
    #: slows the compute it overlaps, and only measuring shows by how much.
    contended: dict[str, float] = field(default_factory=dict)
    #: When the current stage's compute started, and the time its thread was blocked since.
    start: float = 0.0
    blocked: float = 0.0
    #: A load ahead ran during the current stage.
    ahead_in_stage: bool = False

    def loaded(self, name: str, seconds: float, *, ahead: bool, overlapped: bool = False) -> None:
        """A load of ``name`` took ``seconds``; one ``overlapped`` by another load counts
        only when none is timed yet (the first time is better than none)."""
        timed = self.aheads if ahead else self.loads
        if not overlapped or name not in timed:
            times = timed.setdefault(name, [])
            times.append(seconds)
            del times[:-LOADS_WEIGHED]

    def stage_ends(self, stage: str | None, now: float) -> None:
        """``stage`` (None: before the first) ended at ``now``; the next one starts."""
        if stage is not None:
            # The shortest span seen: other processes and a load ahead competing for the
            # cores only make it longer, and a longer one would make any prefetch look hidden.
            span = max(0.0, now - self.start - self.blocked)
            table = self.contended if self.ahead_in_stage else self.compute
            table[stage] = min(span, table.get(stage, span))
        self.start, self.blocked, self.ahead_in_stage = now, 0.0, False

    def view(
        self,
        stages: Plan,
        *,
        pinned: frozenset[str],
        sizes: Mapping[str, int],
        prefetchable: frozenset[str],
    ) -> PolicyView:
        """The policy's view: the plan and what is known of the models, with these times."""
        return PolicyView(
            stages=stages,
            pinned=pinned,
            sizes=sizes,
            prefetchable=prefetchable,
            load_seconds={n: statistics.median_low(t) for n, t in self.loads.items()},
            prefetch_seconds={n: statistics.median_low(t) for n, t in self.aheads.items()},
            compute_seconds=dict(self.compute),
            contended_seconds=dict(self.contended),
        )


@dataclass(frozen=True)
class PrefetchDecision:
    """What a prefetch decision releases early and loads ahead, and why (``note``)."""

    early: list[str]
    names: list[str]
    note: str | None = None


class ResidencyPolicy(Protocol):
    """Decides what stays in memory. StagedModels asks it on every ``enter``.

    Three steps are optional (:class:`PolicySteps` gives their defaults). A policy may also
    define ``why(name, stage, plan) -> str``: the reason recorded in
    the ``release`` event of a model it released (``"not in plan"``, ``"budget"``);
    ``after_load(stage, loaded, plan, protect) -> list[str]``: what to release once a load
    revealed a size (never a name in ``protect``); and ``prefetch_note(stage, loaded,
    plan) -> str | None``: why the prefetch of ``enter(stage)`` was made or skipped.
    """

    def to_release(self, stage: str, loaded: Sequence[str], plan: PolicyView) -> list[str]:
        """Names of loaded models to release on entering ``stage``."""
        ...

    def to_prefetch(self, stage: str, loaded: Sequence[str], plan: PolicyView) -> list[str]:
        """Names to load right after entering ``stage``, before anyone asks: in a
        background thread when the registry prefetches, else right away."""
        ...


@dataclass(frozen=True)
class PolicySteps:
    """A policy's steps as :class:`StagedModels` calls them: the two the protocol requires,
    and the optional three with their defaults where the policy lacks them (no reason
    recorded, nothing released after a load, no note). Checked once, when the registry is
    made, so a policy that is not one fails there with a clear error."""

    to_release: Callable[[str, Sequence[str], PolicyView], list[str]]
    to_prefetch: Callable[[str, Sequence[str], PolicyView], list[str]]
    why: Callable[[str, str, PolicyView], str | None]
    after_load: Callable[[str, Sequence[str], PolicyView, frozenset[str]], list[str]]
    prefetch_note: Callable[[str, Sequence[str], PolicyView], str | None]

    @classmethod
    def of(cls, policy: object) -> PolicySteps:
        missing = [
            m for m in ("to_release", "to_prefetch") if not callable(getattr(policy, m, None))
        ]
        if missing:
            raise TypeError(
                f"policy must have to_release() and to_prefetch() (the ResidencyPolicy "
                f"protocol); {type(policy).__qualname__} lacks {', '.join(missing)}"
            )
        return cls(
            getattr(policy, "to_release"),  # noqa: B009 (checked above; policy is an object)
            getattr(policy, "to_prefetch"),  # noqa: B009
            getattr(policy, "why", lambda name, stage, plan: None),
            getattr(policy, "after_load", lambda stage, loaded, plan, protect: []),
            getattr(policy, "prefetch_note", lambda stage, loaded, plan: None),
        )


class ReleaseUnlisted:
    """Release every loaded model that the entered stage does not list (pinned ones stay)."""

    def to_release(self, stage: str, loaded: Sequence[str], plan: PolicyView) -> list[str]:
        wanted = set(plan.stages[stage]) | plan.pinned
        return [name for name in loaded if name not in wanted]

    def to_prefetch(self, stage: str, loaded: Sequence[str], plan: PolicyView) -> list[str]:
        return []

    def why(self, name: str, stage: str, plan: PolicyView) -> str:
        return REASON_NOT_IN_PLAN


class FurthestNextUse:
    """Keep models while they fit in ``budget`` bytes; evict by furthest next use.

    On entering a stage, only what must go so that the stage's models fit is released.
    Victims, in order:

    1. models no stage lists (loaded by an unplanned access): needed by no later stage;
    2. the model whose next use is furthest away, the plan taken as a cycle (the stage
       after the last is the first: calls of a pipeline repeat it);
    3. among equally far models, the smaller first (cheaper to reload: a load reads its
       bytes).

    Then victims that turn out not to be needed (a far small model taken before a near
    large one that alone frees enough) are kept again, nearest first. The entered
    stage's models and pinned ones never go. A model of unknown size counts as 0 bytes
    until its first load measures it.

    With ``prefetch``, after entering a stage, the next stage's models that fit beside the
    current stage's models are named for a background load, in plan order. To make room,
    other models are released early by the same rule, seen from the next stage. That can
    cost a load the budget alone would not (a model kept for later goes now), in exchange
    for a load that overlaps the current stage's compute. With ``cost_model`` (the default)
    a prefetch that releases a model early is made only when it pays: the wall time over
    the next two calls, estimated from the measured load and compute times
    (:meth:`estimate`), is shorter prefetching at every stage than never prefetching. A
    prefetch that releases nothing early costs no load and is always made.
    """

    def __init__(self, budget: int, *, prefetch: bool = False, cost_model: bool = True) -> None:
        if budget <= 0:
            raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
        self.budget = budget
        self.prefetch = prefetch
        self.cost_model = cost_model
        # Prefetches skipped in a row only for what loads ahead measured (a stage slower
        # beside one, a slow load ahead). Skipping takes no new measurement, so one slow
        # sample (another process, two reads at once) would decide every later call; after
        # RETRY_AFTER of them, a trial.
        self._background_skips = 0
        # Decisions left in a trial: a retry prefetches for a whole call, since a lone load
        # ahead beside the loads on demand that skipping brings measures neither regime.
        self._trial = 0
        # The last decision and what it was made from: enter() asks for the same one up to
        # three times (its note, the early releases, the prefetch), each a simulation.
        self._memo: tuple[str, tuple[str, ...], PolicyView, PrefetchDecision] | None = None

    def __repr__(self) -> str:
        return (
            f"FurthestNextUse(budget={self.budget!r}, prefetch={self.prefetch!r}, "
            f"cost_model={self.cost_model!r})"
        )

    # -- the protocol --------------------------------------------------------------------
    def to_release(self, stage: str, loaded: Sequence[str], plan: PolicyView) -> list[str]:
        victims = self.victims(stage, loaded, plan)
        if not self.prefetch:
            return victims
        staying = [n for n in loaded if n not in victims]
        return victims + self.decide_prefetch(stage, staying, plan).early

    def to_prefetch(self, stage: str, loaded: Sequence[str], plan: PolicyView) -> list[str]:
        if not self.prefetch:
            return []
        return self.decide_prefetch(stage, loaded, plan).names

    def after_load(
        self, stage: str, loaded: Sequence[str], plan: PolicyView, protect: frozenset[str]
    ) -> list[str]:
        """What no longer fits once a load revealed its size: the same rule as on enter."""
        return self.victims(stage, loaded, plan, protect=protect)

    def prefetch_note(self, stage: str, loaded: Sequence[str], plan: PolicyView) -> str | None:
        """Why entering ``stage`` (with ``loaded`` before its releases) prefetches or not."""
        if not self.prefetch:
            return None
        staying = [n for n in loaded if n not in self.victims(stage, loaded, plan)]
        return self.decide_prefetch(stage, staying, plan).note

    def decide_prefetch(
        self, stage: str, loaded: Sequence[str], plan: PolicyView
    ) -> PrefetchDecision:
        """The prefetch for the stage after ``stage``, ``loaded`` being what stays on entry."""
        memo = self._memo
        if memo is not None and memo[0] == stage and memo[1] == tuple(loaded) and memo[2] == plan:
            return memo[3]
        decision = self._decide_prefetch(stage, loaded, plan)
        self._memo = (stage, tuple(loaded), plan, decision)
        return decision

    def _decide_prefetch(
        self, stage: str, loaded: Sequence[str], plan: PolicyView
    ) -> PrefetchDecision:
        early, names = self._prefetch_plan(stage, loaded, plan)
        if not names:
            return PrefetchDecision([], [])
        nxt = plan.stages.next_stage(stage)
        what = f"prefetch {', '.join(map(repr, names))} for stage {nxt!r}"
        if not early:
            return PrefetchDecision([], names, f"{what}: made, it releases nothing early")
        released = ", ".join(map(repr, early))
        if not self.cost_model:
            return PrefetchDecision(
                early, names, f"{what}: made, releasing {released} early (cost model off)"
            )
        with_, without = (
            self.estimate(stage, loaded, plan, True),
            self.estimate(stage, loaded, plan, False),
        )
        if with_ is None or without is None:
            return PrefetchDecision(
                [],
                [],
                f"{what}: skipped, it would release {released} early and the load "
                f"and compute times to weigh that are not measured yet",
            )
        estimated = (
            f"the next two calls estimated at {with_:.2f} s prefetching, {without:.2f} s not"
        )
        if with_ < without * (1 - self.MARGIN):
            self._background_skips = 0
            return PrefetchDecision(
                early, names, f"{what}: made, releasing {released} early; {estimated}"
            )
        free = self.estimate(stage, loaded, plan, True, background=False)
        if free is not None and free < without * (1 - self.MARGIN):
            # Only what was measured of loads ahead says no, and skipping measures nothing.
            skips = self._background_skips = self._background_skips + 1
            if self._trial or skips >= self.RETRY_AFTER:
                self._background_skips = 0
                self._trial = self._trial - 1 if self._trial else len(plan.stages) - 1
                return PrefetchDecision(
                    early,
                    names,
                    f"{what}: made, releasing {released} early, to measure loads ahead again "
                    f"for a whole call; {estimated}",
                )
        return PrefetchDecision(
            [], [], f"{what}: skipped, it would release {released} early; {estimated}"
        )

    #: After this many prefetches in a row skipped only for what loads ahead measured, the
    #: next call prefetches at every stage, to measure them again (two calls of three
    #: stages skipped, then one tried).
    RETRY_AFTER = 6
    #: A prefetch that releases early is made when it is estimated at least this much
    #: shorter: the estimate leaves out each load's fixed costs (thread starts, waits at
    #: ``enter``), and at a tie (short stages, warm loads as long as the compute) prefetching
    #: took 1.1-1.4 times as long (bench/residency.py cost, short, warm).
    MARGIN = 0.05

    def estimate(
        self,
        stage: str,
        loaded: Sequence[str],
        plan: PolicyView,
        prefetch: bool,
        *,
        background: bool = True,
    ) -> float | None:
        """Seconds for two calls from ``stage`` on (``loaded`` staying on its entry), with a
        prefetch at every stage or none, the rule otherwise as now; None when a time it
        needs is not measured. A stage takes its on-demand loads, then the longer of its
        compute and the loads prefetched during it. What was measured of loads in the
        background counts with ``background``: a stage with a prefetch beside it computes as
        long as measured with one (a background load competes for the cores), and a load
        ahead takes as long as that model's loads ahead took (until one is timed, as on
        demand). Without it, both are taken as if free. A model never loaded takes its bytes
        at the mean speed of the measured loads."""
        speeds = [
            plan.sizes[n] / s for n, s in plan.load_seconds.items() if s > 0 and n in plan.sizes
        ]
        bps = sum(speeds) / len(speeds) if speeds else None

        def load(name: str, ahead: bool = False) -> float | None:
            if ahead and background and name in plan.prefetch_seconds:
                return plan.prefetch_seconds[name]
            if name in plan.load_seconds:  # a load ahead not timed yet: as on demand
                return plan.load_seconds[name]
            if name in plan.prefetch_seconds:
                return plan.prefetch_seconds[name]
            if bps is None or name not in plan.sizes:
                return None
            return plan.sizes[name] / bps

        state = list(loaded)
        total = 0.0
        for step, s in enumerate(plan.stages.cycle(stage, 2 * len(plan.stages))):
            if step:
                gone = self.victims(s, state, plan)
                state = [n for n in state if n not in gone]
            ahead: list[str] = []
            if prefetch:
                early, ahead = self._prefetch_plan(s, state, plan)
                state = [n for n in state if n not in early]
            demand = [n for n in plan.stages[s] if n not in state]
            times = [load(n) for n in demand] + [load(n, ahead=True) for n in ahead]
            compute = plan.compute_seconds.get(s)
            if ahead and compute is not None and background:
                compute = max(compute, plan.contended_seconds.get(s, compute))
            if compute is None or any(t is None for t in times):
                return None
            total += sum(times[: len(demand)]) + max(compute, sum(times[len(demand) :]))  # type: ignore[arg-type]
            state += [*demand, *ahead]
        return total

    def why(self, name: str, stage: str, plan: PolicyView) -> str:
        return REASON_BUDGET if plan.stages.listed(name) else REASON_NOT_IN_PLAN

    # -- the rule ------------------------------------------------------------------------
    def victims(
        self,
        stage: str,
        loaded: Sequence[str],
        plan: PolicyView,
        *,
        protect: frozenset[str] = frozenset(),
    ) -> list[str]:
        """The loaded models to release so that ``stage``'s models fit, in eviction order."""
        needed = plan.stages[stage]
        resident = list(dict.fromkeys([*loaded, *needed]))
        excess = _total(resident, plan.sizes) - self.budget
        if excess <= 0:
            return []
        keep = set(needed) | plan.pinned | protect
        size = {n: plan.sizes.get(n, 0) for n in loaded}
        far = {n: plan.stages.next_use(n, stage) for n in loaded if n not in keep}
        # Models no stage lists cost no reload: they go first of all.
        chosen = sorted((n for n in far if far[n] == float("inf")), key=lambda n: size[n])
        for name in list(chosen):
            if excess <= 0:
                chosen.remove(name)
            excess -= size[name] if name in chosen else 0
        if excess <= 0:
            return chosen
        planned = [n for n in far if far[n] != float("inf")]
        return chosen + _fewest_furthest(planned, far, size, excess)

    def _prefetch_plan(
        self, stage: str, loaded: Sequence[str], plan: PolicyView
    ) -> tuple[list[str], list[str]]:
        """(models to release early, models to prefetch) for the stage after ``stage``."""
        nxt = plan.stages.next_stage(stage)
        current = plan.stages[stage]
        wanted = [
            n
            for n in plan.stages[nxt]
            if n not in loaded and n not in current and n in plan.prefetchable
        ]
        # A model of unknown size cannot be shown to fit: it loads on demand the first time.
        wanted = [n for n in wanted if n in plan.sizes]
        if nxt == stage or not wanted:
            return [], []
        resident = list(dict.fromkeys([*loaded, *current]))
        # Room beside the current stage's models (in use now): evict others by the same
        # rule, seen from the next stage.
        early = self.victims(nxt, resident, plan, protect=frozenset(current))
        staying = [n for n in resident if n not in early]
        room = self.budget - _total(staying, plan.sizes)
        names: list[str] = []
        for name in wanted:
            size = plan.sizes[name]
            if size > room:
                break  # keep plan order: a later model must not overtake an earlier one
            names.append(name)
            room -= size
        if not names:
            return [], []
        return [n for n in early if n in loaded], names


def _fewest_furthest(
    names: list[str], far: Mapping[str, float], size: Mapping[str, int], excess: int
) -> list[str]:
    """Victims among ``names`` freeing ``excess`` bytes: the fewest models (each one is a
    reload later), of those sets the one whose next uses are furthest away (Belady), then
    the one with fewer bytes (cheaper to reload). Equal sizes make this plain Belady."""
    by_distance = sorted(names, key=lambda n: (-far[n], size[n]))
    if len(names) > _EXACT_UP_TO:  # too many to try every set: furthest first, greedily
        chosen, freed = [], 0
        for name in by_distance:
            if freed >= excess:
                break
            chosen.append(name)
            freed += size[name]
        return chosen
    for count in range(1, len(names) + 1):
        best: tuple[Any, ...] | None = None
        for group in itertools.combinations(by_distance, count):
            if sum(size[n] for n in group) < excess:
                continue
            key = (sorted((far[n] for n in group), reverse=True), -sum(size[n] for n in group))
            if best is None or key > best[0]:
                best = (key, list(group))
        if best is not None:
            return best[1]
    return by_distance  # even all of them do not make it fit: the stage runs over budget


#: Up to this many candidates, every set of victims is considered.
_EXACT_UP_TO = 12


def _total(names: Sequence[str], sizes: Mapping[str, int]) -> int:
    return sum(sizes.get(n, 0) for n in names)


def check_sizes(
    sizes: Mapping[str, int | str] | None, loaders: Mapping[str, Any]
) -> dict[str, int]:
    """``StagedModels(sizes=...)`` as bytes per model, or a clear error."""
    from ..units import parse_size

    if sizes is None:
        return {}
    if not isinstance(sizes, Mapping):
        raise TypeError(
            f"sizes must map model names to bytes, e.g. {{'vae': '160M'}}; got {sizes!r}"
        )
    known = ", ".join(sorted(loaders)) or "(none)"
    out = {}
    for name, size in sizes.items():
        if name not in loaders:
            raise ValueError(f"sizes names {name!r}, which has no loader; models: {known}")
        try:
            out[name] = parse_size(size)
        except (TypeError, ValueError) as err:  # the message names the model, then the fix
            kind = TypeError if isinstance(err, TypeError) else ValueError
            raise kind(f"sizes[{name!r}]: {err}") from None
    return out


def prefetchable(
    prefetch: bool | Iterable[str] | None, loaders: Mapping[str, Any]
) -> frozenset[str]:
    """The models ``StagedModels(prefetch=...)`` may load in the background.

    ``True``: those whose loader is marked :func:`rng_free`. A list: exactly those named
    (the caller vouches that their loaders draw no random numbers).
    """
    if prefetch is True:
        return frozenset(n for n, loader in loaders.items() if is_rng_free(loader))
    if prefetch is False or prefetch is None:
        return frozenset()
    if isinstance(prefetch, str) or not isinstance(prefetch, Iterable):
        raise TypeError(
            f"prefetch must be True, False or a list of model names, e.g. ['vae']; got {prefetch!r}"
        )
    names = frozenset(prefetch)
    known = ", ".join(sorted(loaders)) or "(none)"
    for name in names:
        if name not in loaders:
            raise ValueError(f"prefetch names {name!r}, which has no loader; models: {known}")
    return names


def choose_policy(
    policy: ResidencyPolicy | None, budget: int | None, prefetch: bool
) -> ResidencyPolicy:
    """The policy ``StagedModels`` uses: the one given, else one for its budget."""
    if budget is not None and policy is not None:
        raise ValueError(
            "pass budget= or policy=, not both: budget= builds the FurthestNextUse policy"
        )
    if prefetch and budget is None and policy is None:
        raise ValueError(
            "prefetch needs a budget: it loads the next stage's models only where they fit "
            "beside the current ones; pass budget='auto' or a size such as budget='12G'"
        )
    if policy is not None:
        return policy
    return ReleaseUnlisted() if budget is None else FurthestNextUse(budget, prefetch=prefetch)


def unprefetchable(stages: Mapping[str, Sequence[str]], allowed: frozenset[str]) -> str | None:
    """A note naming the planned models that prefetch will not load ahead, if any."""
    left = sorted({n for names in stages.values() for n in names} - allowed)
    if not left:
        return None
    return (
        f"prefetch: {', '.join(map(repr, left))} will load on demand, not ahead: their loaders "
        f"are not marked as drawing no random numbers; mark them with stageload.rng_free() "
        f"or list them in prefetch=[...] (docs/residency.md)"
    )


def over_budget(
    stage: str, resident: Iterable[str], sizes: Mapping[str, int], budget: int, after: str | None
) -> tuple[int, str] | None:
    """(bytes over, note) when ``resident`` models exceed ``budget`` in ``stage``, else None."""
    from ..units import format_apart, format_size

    total = sum(sizes.get(n, 0) for n in resident)
    if total <= budget:
        return None
    what = f"after loading {after!r}" if after else "its models"
    held, limit = format_apart(total, budget)
    return total - budget, (
        f"stage {stage!r} holds {held} with {what}, over the budget of "
        f"{limit} by {format_size(total - budget)}; it runs anyway (give "
        f"sizes= to plan ahead, or raise the budget)"
    )
