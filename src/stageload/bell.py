"""Waiting for a state that a lock guards, safe at any Ctrl-C.

``threading.Condition.wait`` lets go of its lock in Python code: a Ctrl-C just after
leaves the lock released under the caller's ``with``, which releases it again on the way
out (a plain Lock taken meanwhile by another thread, or an RLock's ``RuntimeError: cannot
release un-acquired lock`` in place of the KeyboardInterrupt). A :class:`Bell` waiter
sleeps outside the lock, on a ticket of its own, so the lock is only ever taken and given
back by ``with`` (C code, between whose two steps no signal handler runs).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

#: How long a wait sleeps before it looks again (a ring lost to a Ctrl-C costs this).
RECHECK = 0.1


class Bell:
    """Wakes the threads waiting for a state that a lock guards to change.

    :meth:`wait` is the whole protocol; written out, for a waiter with more to do under
    the lock once the state is there::

        while True:
            with lock:
                if ready():
                    break
                ticket = bell.ticket()
            ticket.acquire(timeout=RECHECK)

    ``ticket`` and ``ring`` are called holding the lock. A wake-up lost to a Ctrl-C inside
    ``ring`` costs the waiter its recheck, not a hang."""

    def __init__(self) -> None:
        self._tickets: dict[Any, bool] = {}

    def ticket(self) -> Any:
        """A lock that :meth:`ring` releases: acquiring it waits for the next ring."""
        ticket = threading.Lock()
        ticket.acquire()
        self._tickets[ticket] = True  # after the acquire: a ring never finds it unheld
        return ticket

    def ring(self) -> None:
        """Wake every thread waiting on a ticket."""
        while self._tickets:
            ticket, _ = self._tickets.popitem()
            ticket.release()

    def wait(self, lock: Any, ready: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait until ``ready()``, asked holding ``lock``, is true: True then, False once
        ``timeout`` seconds passed first. The caller must not hold ``lock``: a thread that
        sleeps holding it keeps every thread that would ring from getting there: an RLock
        held by an outer frame raises here, once ``ready()`` is false, rather than hang."""
        held = owned(lock)
        deadline = None if timeout is None else time.monotonic() + timeout
        ticket = None
        while True:
            with lock:
                if ready():
                    if ticket is not None:
                        self._tickets.pop(ticket, None)  # not rung: no ticket piles up
                    return True
                if held:
                    raise RuntimeError("Bell.wait() would sleep holding its lock: never rung")
                if ticket is None or ticket not in self._tickets:
                    ticket = self.ticket()
            left = RECHECK if deadline is None else min(RECHECK, deadline - time.monotonic())
            if left <= 0:
                with lock:
                    self._tickets.pop(ticket, None)
                return False
            if ticket.acquire(timeout=left):
                ticket = None  # rung (and out of the table): a new one next time


def owned(lock: Any) -> bool:
    """Whether this thread holds ``lock``: an RLock says, a plain Lock answers False.

    ``_is_owned`` is the check CPython's own ``Condition`` makes of an RLock. A wrapper
    that counted its owner in Python would take the lock and count it in two steps, and a
    Ctrl-C between them would leave the lock held for good: the C lock is asked instead."""
    check = getattr(lock, "_is_owned", None)
    return bool(check()) if check is not None else False
