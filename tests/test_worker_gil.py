"""The measuring tools of bench.worker_gil (what a Dask worker's side work costs a host-bound
thread): GIL seconds from a spinning thread's schedstat, CPU seconds by thread, thread kinds."""
import os
import threading
import time

import pytest

from engram_numba.bench import worker_gil as wg

linux = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc (Linux)")


@linux
def test_gil_held_sees_python_and_not_a_sleep():
    def busy():                      # pure Python: holds the GIL whenever it runs
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.1:
            pass
    held = wg.gil_held(busy, reps=2)
    asleep = wg.gil_held(lambda: time.sleep(0.1), reps=2)
    assert held["cpu_s"] >= 0.1 and held["gil_held_s"] >= 0.03, held
    assert asleep["cpu_s"] < 0.01 and asleep["gil_held_s"] < 0.02, asleep


@linux
def test_cpu_by_thread_kind_and_threads_that_ended():
    def burn(seconds):
        t0 = time.thread_time()
        while time.thread_time() - t0 < seconds:
            pass
    before = wg.thread_cpu()
    t = threading.Thread(target=burn, args=(0.15,), name="engram-stats_7")
    t.start()
    t.join()                                        # gone before the second reading
    burnt, done = threading.Event(), threading.Event()
    live = threading.Thread(target=lambda: (burn(0.15), burnt.set(), done.wait(60)), name="engram-partials_0")
    live.start()
    burnt.wait(60)
    d = wg.cpu_diff(before, wg.thread_cpu())
    done.set()
    live.join()
    assert d["engram-partials"] >= 0.1               # a live thread, by its pool's name
    assert d["ended"] >= 0.1                          # the ended one: the process's CPU less the live threads'
    assert abs(d["process"] - sum(v for k, v in d.items() if k not in ("process", "minor_faults"))) < 1e-3
    assert d["minor_faults"] >= 0                     # a count of pages, apart from the seconds
    assert wg.thread_kind("engram-0-Dask-Default-Threads-17-0") == "Dask-Default-Threads"
    assert wg.thread_kind("engram-stats_3") == "engram-stats" and wg.thread_kind("MainThread") == "MainThread"


def test_driver_stand_in_reports_its_rate():
    r = wg.driver(0.2, launches=4, wait_us=100)
    assert r["iters_per_s"] > 0 and r["iter_us_p50"] >= 100 and r["probe_late_us_max"] >= 0
