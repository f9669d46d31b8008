"""Run a Python module under cProfile on EVERY thread it starts (cProfile alone sees one thread).

    python tools/profile_threads.py OUT_DIR -m engram_numba.bench.corpus --quick --no-host --chunks 64

Each thread's profile is written to OUT_DIR/<thread name>.prof and its top 25 functions by
cumulative and by own time to OUT_DIR/<thread name>.txt when the thread ends (the main thread's at
exit). Meant for finding where a pipeline thread's seconds go, e.g. the corpus run's device loop.
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import runpy
import sys
import threading


def _dump(prof: cProfile.Profile, out: str, name: str) -> None:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    prof.dump_stats(os.path.join(out, safe + ".prof"))
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("cumulative").print_stats(25)
    st.sort_stats("tottime").print_stats(25)
    with open(os.path.join(out, safe + ".txt"), "w") as f:
        f.write(buf.getvalue())


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        sys.exit("usage: python tools/profile_threads.py OUT_DIR -m MODULE [ARGS...]")
    out, module, args = sys.argv[1], sys.argv[3], sys.argv[4:]
    os.makedirs(out, exist_ok=True)
    original_run = threading.Thread.run

    def run(self):
        prof = cProfile.Profile()
        prof.enable()
        try:
            original_run(self)
        finally:
            prof.disable()
            _dump(prof, out, self.name)

    threading.Thread.run = run
    sys.argv = [module] + args
    prof = cProfile.Profile()
    prof.enable()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        prof.disable()
        _dump(prof, out, "main")


if __name__ == "__main__":
    main()
