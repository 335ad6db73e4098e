"""The bell: waiting for a state a lock guards, and knowing whether this thread holds it."""

from __future__ import annotations

import threading

import pytest

from stageload import bell


def test_owned_says_which_thread_holds_an_rlock() -> None:
    lock = threading.RLock()
    assert not bell.owned(lock)
    with lock:
        assert bell.owned(lock)
        seen: list[bool] = []
        other = threading.Thread(target=lambda: seen.append(bell.owned(lock)))
        other.start()
        other.join()
        assert seen == [False]  # held, but by this thread, not that one
    assert not bell.owned(lock)


def test_owned_answers_false_for_a_plain_lock() -> None:
    lock = threading.Lock()
    with lock:
        assert not bell.owned(lock)  # a plain Lock cannot say who holds it


def test_wait_holding_its_rlock_raises_rather_than_hang() -> None:
    lock = threading.RLock()
    with lock:
        assert bell.Bell().wait(lock, lambda: True)  # ready: nothing to sleep for
        with pytest.raises(RuntimeError, match="holding its lock"):
            bell.Bell().wait(lock, lambda: False, timeout=5)


def test_wait_returns_once_another_thread_rings_the_state_in() -> None:
    lock = threading.Lock()
    ring = bell.Bell()
    state = {"done": False}
    waiting = threading.Event()

    def finish() -> None:
        waiting.wait()
        with lock:
            state["done"] = True
            ring.ring()

    worker = threading.Thread(target=finish)
    worker.start()

    def ready() -> bool:
        waiting.set()  # asked under the lock: the worker's change comes after this look
        return state["done"]

    assert ring.wait(lock, ready, timeout=60)
    worker.join()


def test_wait_gives_up_after_its_timeout() -> None:
    assert not bell.Bell().wait(threading.Lock(), lambda: False, timeout=0.05)
