"""Memory budgets: ``parse_budget`` turns ``"12G"``, ``"80%"`` or ``"auto"`` into bytes.

Sizes parse as every size does (:func:`stageload.units.parse_size`); shares and ``"auto"``
read this machine's memory (cgroup-aware, :func:`stageload.memory.read_system`), which is
why the parser sits with the memory readers rather than in ``units``, the base layer.
"""

from __future__ import annotations

#: What ``budget="auto"`` keeps free for working memory (activations, temporaries): this
#: share of the memory the process may use, and never less than ``AUTO_RESERVE_MIN``.
AUTO_RESERVE_SHARE = 0.10
AUTO_RESERVE_MIN = 1 << 30


def parse_budget(value: int | str) -> int:
    """A memory budget in bytes from ``12884901888``, ``"12G"``, ``"80%"`` or ``"auto"``.

    ``"80%"`` is a share of the memory this process may use (the machine's, or its memory
    cgroup's limit when lower). ``"auto"`` is the memory available now (cgroup-aware, as
    ``stageload.memory.read_system`` reads it) minus a reserve for working memory:
    ``AUTO_RESERVE_SHARE`` of the total, at least ``AUTO_RESERVE_MIN``.
    """
    from ..units import parse_size

    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"budget must be bytes (int), a size like '12G', a share like '80%' or 'auto'; "
            f"got {value!r}"
        )
    text = value.strip().lower() if isinstance(value, str) else None
    if text == "auto" or (text is not None and text.endswith("%")):
        from ..memory import read_system

        system = read_system()
        if text == "auto":
            if system.available is None or system.total is None:
                why = system.errors.get("available") or system.errors.get("total") or "unknown"
                raise ValueError(
                    f"budget='auto' needs the available memory, which cannot be read here "
                    f"({why}); pass a size instead, e.g. budget='12G'"
                )
            reserve = max(AUTO_RESERVE_MIN, int(system.total * AUTO_RESERVE_SHARE))
            budget = system.available - reserve
            if budget <= 0:
                raise ValueError(
                    f"budget='auto' leaves nothing: {system.available} bytes available, "
                    f"{reserve} kept for working memory; free memory or pass a size"
                )
            return budget
        try:
            share = float(text[:-1])  # type: ignore[index]
        except ValueError:
            share = -1.0
        if not 0 < share <= 100:
            raise ValueError(
                f"invalid budget {value!r}: a share is more than 0% and at most 100%, e.g. '80%'"
            )
        if system.total is None:
            raise ValueError(
                f"budget={value!r} needs the total memory, which cannot be read here "
                f"({system.errors.get('total', 'unknown')}); pass a size, e.g. budget='12G'"
            )
        return int(system.total * share / 100)
    try:
        budget = parse_size(value)
    except ValueError:
        raise ValueError(
            f"invalid budget {value!r}: use whole bytes, a size like '12G' or '1.5G', a share "
            f"like '80%', or 'auto'"
        ) from None
    if budget <= 0:
        raise ValueError(f"invalid budget {value!r}: it must be more than 0 bytes, e.g. '12G'")
    return budget


def over_memory(budget: int) -> str | None:
    """Why ``budget`` (bytes) means nothing here, or None: it is more than the memory this
    process may use (the machine's, or its memory cgroup's limit when lower), so memory
    runs out before the budget does (``--budget 2TB`` on a 24 GiB machine)."""
    from ..memory import read_system
    from ..units import format_size

    total = read_system().total
    if total is None or budget <= total:
        return None
    return (
        f"the budget, {format_size(budget)}, is more than the {format_size(total)} of memory "
        f"this process may use: memory runs out before anything is released for the budget"
    )
