import os
import threading
import time

import pytest

from bench.cores import shares, thread_cpu

PID = 100


def test_a_group_peer_splits_into_training_event_loop_and_named_threads() -> None:
    before = {PID: ("python", 1.0), 101: ("python", 10.0), 102: ("wrtc-network", 0.5),
              103: ("wrtc-worker", 0.0), 104: ("wrtc-network", 0.1)}
    after = {PID: ("python", 1.4), 101: ("python", 19.0), 102: ("wrtc-network", 0.6),
             103: ("wrtc-worker", 0.0), 104: ("wrtc-network", 0.2),
             105: ("python", 0.3)}  # a thread started inside the window counts from 0
    out = shares(PID, before, after, 10.0)
    assert out["training"] == pytest.approx(0.9)
    assert out["event loop"] == pytest.approx(0.04)
    assert out["wrtc-network"] == pytest.approx(0.02)  # two threads of one name, summed
    assert out["python"] == pytest.approx(0.03)
    assert "wrtc-worker" not in out  # idle threads are left out


def test_one_peer_alone_trains_in_its_main_thread_and_has_no_event_loop() -> None:
    before = {PID: ("python", 0.0), 101: ("python", 0.0)}
    after = {PID: ("python", 5.0), 101: ("python", 0.1)}
    out = shares(PID, before, after, 5.0)
    assert out["training"] == pytest.approx(1.0)
    assert out["event loop"] == 0.0
    assert out["python"] == pytest.approx(0.02)


def test_thread_cpu_reads_this_process_threads() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    worker = threading.Thread(target=spin, name="spinner")
    worker.start()
    try:
        before = thread_cpu(os.getpid())
        time.sleep(0.5)
        after = thread_cpu(os.getpid())
    finally:
        stop.set()
        worker.join()
    assert os.getpid() in after and worker.native_id in after
    out = shares(os.getpid(), before, after, 0.5)
    assert out["training"] > 0.2  # the spinning thread is the busiest
