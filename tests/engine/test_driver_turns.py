"""swap/driver_turns.py: a block's copy calls go before page-locking, and wait for at most the one in flight."""
import contextlib
import threading
import time

from ringswap.swap import driver_turns


def test_a_registration_waits_for_copies_and_copies_wait_for_one_registration():
    log, started = [], threading.Event()

    def register(name, hold):
        with driver_turns.registration():
            started.set()
            log.append(f"{name} in")
            time.sleep(hold)
            log.append(f"{name} out")

    first = threading.Thread(target=register, args=("r1", 0.2))
    first.start()
    started.wait()
    with driver_turns.copies():   # waits for r1, then holds r2 off while it runs
        log.append("copies in")
        second = threading.Thread(target=register, args=("r2", 0.0))
        second.start()
        time.sleep(0.1)
        log.append("copies out")
    first.join()
    second.join()
    assert log == ["r1 in", "r1 out", "copies in", "copies out", "r2 in", "r2 out"]


def _in_a_thread(*turns) -> list:
    """Enter `turns` nested on a thread of its own; [True] once it got through (within 5 s)."""
    done = []

    def nested():
        with contextlib.ExitStack() as stack:
            for turn in turns:
                stack.enter_context(turn())
            done.append(True)
    t = threading.Thread(target=nested)
    t.start()
    t.join(timeout=5)
    return done


def test_a_thread_in_a_burst_registers_without_waiting_for_itself():
    assert _in_a_thread(driver_turns.copies, driver_turns.copies, driver_turns.registration) == [True]
    with driver_turns.registration():   # nothing left held
        pass


def test_an_unpin_inside_a_registration_of_the_same_thread_goes_on():
    """The garbage collector may unpin (a buffer's __del__) while its thread registers."""
    assert _in_a_thread(driver_turns.registration, driver_turns.registration, driver_turns.copies) == [True]


def test_an_interrupted_wait_leaves_no_turn_held():
    with driver_turns.registration():
        pass
    try:
        with driver_turns.copies():
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    with driver_turns.registration():   # nothing left counted
        assert not driver_turns._bursts


def test_waiting_registrations_go_in_call_order():
    """Pinning threads waiting for their turn go by the call order of their blocks; one without a
    block (a staging buffer, an unpin) before them all."""
    log, n = [], 4
    waiting = threading.Barrier(n + 1)

    def register(key):
        def go():
            waiting.wait()
            with driver_turns.registration():
                log.append(key)
        if key is None:
            go()
            return
        with driver_turns.in_call_order(key):
            go()

    threads = [threading.Thread(target=register, args=(k,)) for k in (7, 3, None, 5)]
    with driver_turns.copies():   # every registration waits behind this burst
        for t in threads:
            t.start()
        waiting.wait()
        deadline = time.time() + 5
        while len(driver_turns._waiting) < n and time.time() < deadline:
            time.sleep(0.01)
    for t in threads:
        t.join(timeout=5)
    assert log == [None, 3, 5, 7]
    assert not driver_turns._waiting


def _registering_thread(log: list) -> threading.Thread:
    def register():
        with driver_turns.registration():
            log.append("registered")
    t = threading.Thread(target=register)
    t.start()
    return t


def test_a_first_calls_hold_lets_registrations_run_only_while_it_waits_aside():
    """A load's first call holds page-locking off (its kernel launches would each wait for one
    registration piece) except while it waits for a home: then the registration runs."""
    log = []
    hold = driver_turns.Hold()
    try:
        t = _registering_thread(log)
        time.sleep(0.2)
        assert log == []   # held off
        with driver_turns.registration():   # the holding thread's own goes on at once
            log.append("mine")
        with driver_turns.aside():
            t.join(timeout=5)
        assert log == ["mine", "registered"]
        t = _registering_thread(log)
        time.sleep(0.2)
        assert log == ["mine", "registered"]   # held again after the wait
    finally:
        hold.release()
        hold.release()   # idempotent
    t.join(timeout=5)
    assert log == ["mine", "registered", "registered"] and not driver_turns._holds


def test_a_hold_its_thread_never_lets_go_expires(monkeypatch):
    """A first call that never comes (an attach, then an error before sampling) holds registrations
    off for at most PATIENCE_S; a hold released from another thread frees them at once."""
    monkeypatch.setattr(driver_turns, "PATIENCE_S", 0.3)
    log = []
    hold = driver_turns.Hold()
    t0 = time.monotonic()
    _registering_thread(log).join(timeout=5)
    assert log == ["registered"] and time.monotonic() - t0 >= 0.25
    hold.release()
    holder = []
    taken = threading.Event()

    def hold_in_a_thread():
        holder.append(driver_turns.Hold())
        taken.set()
    threading.Thread(target=hold_in_a_thread).start()
    taken.wait(timeout=5)
    t = _registering_thread(log)
    time.sleep(0.1)
    assert log == ["registered"]
    holder[0].release()
    t.join(timeout=5)
    assert log == ["registered", "registered"] and not driver_turns._holds


def test_a_new_hold_on_a_thread_replaces_one_never_released():
    """A load whose first use was never taken down must not leave the next load's first call unheld."""
    log = []
    stale = driver_turns.Hold()
    hold = driver_turns.Hold()
    t = _registering_thread(log)
    time.sleep(0.2)
    stale.release()   # the old one's release leaves the new hold in place
    time.sleep(0.2)
    assert log == []
    hold.release()
    t.join(timeout=5)
    assert log == ["registered"] and not driver_turns._holds
