"""Turns at the CUDA driver between page-locking and copies: a block's copies go first.

cudaHostRegister holds a driver lock for its whole run (a 0.7 GB block's pages: ~68 ms at
10 GB/s), and every copy call waits for it. Registrations on other threads, one after another,
then hold each of a block's ~30 copy calls for one registration: a load's first copy took 1.1 s
(bench/probes/pin_contention.py: the longest copy call beside 1 registering thread 68 ms, beside 4
344 ms; bench/RESULTS.md). Here a registration starts only while no copy burst waits or runs, so
a burst waits for at most the one registration in flight. Written here: the driver offers no
priority between the two. A thread inside its own burst or registration goes on at once (a pin
for its copy, an unpin run by the garbage collector) rather than wait for itself. Among waiting
registrations the one of the block called first goes next (`in_call_order`): the pinning threads
would otherwise take turns in any order, and the first call waits for its blocks in order.
A load's first call holds registrations off (`Hold`) except while it waits for a home to be
page-locked (`aside`): every kernel launch and allocation of its thread, ComfyUI's too, otherwise
waits for one registration piece, and traced on an H100 the GPU sat idle for 1.3 s of it.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

_cond = threading.Condition()
_bursts = 0             # copy bursts waiting or running
_registering = False    # a registration running (one at a time: the driver runs them so anyway)
_waiting: list[float] = []   # the call-order keys of the registrations waiting
_mine = threading.local()
_holds: dict[threading.Thread, "Hold"] = {}   # by thread: the first call's hold on registrations
PATIENCE_S = 1.0   # a hold whose thread has not waited for this long holds nothing (a first call that never comes)


class Hold:
    """From a load's attach to the end of its first call: the attaching thread's CUDA calls go
    before page-locking, which runs while that thread waits for a page-locked home (`aside`) or
    when it has not waited for PATIENCE_S. `release()` from any thread; idempotent."""

    def __init__(self) -> None:
        self.thread, self.aside, self.since = threading.current_thread(), False, time.monotonic()
        with _cond:   # one hold a thread: the latest load's (one never released holds nothing after PATIENCE_S)
            _holds[self.thread] = self

    def holding(self, now: float) -> bool:
        return not self.aside and now - self.since < PATIENCE_S

    def release(self) -> None:
        with _cond:
            if _holds.get(self.thread) is self:
                del _holds[self.thread]
                _cond.notify_all()


@contextmanager
def aside() -> Iterator[None]:
    """Around a wait that page-locking may be behind: this thread's hold lets registrations run meanwhile."""
    h = _holds.get(threading.current_thread())
    if h is None or h.aside:
        yield
        return
    with _cond:
        h.aside = True
        _cond.notify_all()
    try:
        yield
    finally:
        with _cond:
            h.aside, h.since = False, time.monotonic()


@contextmanager
def copies() -> Iterator[None]:
    """Around one block's copy calls: waits for a registration in flight, holds new ones off."""
    with _unless_mine(_burst):
        yield


@contextmanager
def registration() -> Iterator[None]:
    """Around one cudaHostRegister or cudaHostUnregister: waits while copy bursts wait or run."""
    with _unless_mine(_register):
        yield


@contextmanager
def in_call_order(key: float) -> Iterator[None]:
    """This thread's registrations inside wait behind those of blocks called before `key` (a block's
    index in call order); one without a key goes first (a staging buffer, an unpin)."""
    before = getattr(_mine, "key", float("-inf"))
    _mine.key = key
    try:
        yield
    finally:
        _mine.key = before


@contextmanager
def _unless_mine(turn) -> Iterator[None]:
    """`turn()`, unless this thread is inside its own burst or registration (it goes on at once);
    the thread is marked first, so what it registers while waiting (a __del__) does not wait."""
    h = _holds.get(threading.current_thread())
    if getattr(_mine, "busy", False) or h is not None and not h.aside:
        yield
        return
    _mine.busy = True
    try:
        with turn():
            yield
    finally:
        _mine.busy = False


@contextmanager
def _burst() -> Iterator[None]:
    global _bursts
    with _cond:
        _bursts += 1   # counted while it waits too: no registration starts meanwhile
    try:
        with _cond:
            _cond.wait_for(lambda: not _registering)
        yield
    finally:
        with _cond:
            _bursts -= 1
            _cond.notify_all()


def _held() -> bool:
    now = time.monotonic()
    return any(h.holding(now) for h in _holds.values())


@contextmanager
def _register() -> Iterator[None]:
    global _registering
    key = getattr(_mine, "key", float("-inf"))
    with _cond:
        _waiting.append(key)
        try:
            while not (not _bursts and not _registering and key <= min(_waiting) and not _held()):
                _cond.wait(PATIENCE_S / 4)
        except BaseException:   # given up (an interrupt): it no longer holds back those behind it
            _waiting.remove(key)
            _cond.notify_all()
            raise
        _waiting.remove(key)
        _registering = True
    try:
        yield
    finally:
        with _cond:
            _registering = False
            _cond.notify_all()
