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
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

_cond = threading.Condition()
_bursts = 0             # copy bursts waiting or running
_registering = False    # a registration running (one at a time: the driver runs them so anyway)
_waiting: list[float] = []   # the call-order keys of the registrations waiting
_mine = threading.local()


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
    if getattr(_mine, "busy", False):
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


@contextmanager
def _register() -> Iterator[None]:
    global _registering
    key = getattr(_mine, "key", float("-inf"))
    with _cond:
        _waiting.append(key)
        try:
            _cond.wait_for(lambda: not _bursts and not _registering and key <= min(_waiting))
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
