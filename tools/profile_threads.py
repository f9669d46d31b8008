"""Run a Python module while sampling every thread's stack (a statistical profiler that sees all
threads on any Python: cProfile sees one thread, and on 3.12 only one profiler may be active).

    python tools/profile_threads.py OUT.txt [--interval-ms 1] -m engram_numba.bench.corpus --quick --no-host --chunks 64

Every interval a sampler thread reads `sys._current_frames()`; for each thread (by name) it counts
the innermost function (own samples) and every function on the stack (cumulative samples, once a
sample). At exit OUT.txt gets, per thread, its sample count and the top 30 functions both ways,
with the share of that thread's samples. A thread blocked in C (a lock, a device sync, a nogil
njit) shows as the Python frame that called it. Meant for finding where a pipeline thread's
seconds go, e.g. the corpus run's device loop against its producer and reducer.
"""
from __future__ import annotations

import atexit
import collections
import runpy
import sys
import threading
import time


def _label(code) -> str:
    return f"{code.co_filename.rsplit('/', 2)[-2:][-1]}:{code.co_firstlineno}({code.co_name})"


def main() -> None:
    argv = sys.argv[1:]
    interval = 0.001
    if len(argv) >= 2 and argv[1] == "--interval-ms":
        interval = float(argv[2]) / 1000.0
        argv = argv[:1] + argv[3:]
    if len(argv) < 3 or argv[1] != "-m":
        sys.exit("usage: python tools/profile_threads.py OUT.txt [--interval-ms MS] -m MODULE [ARGS...]")
    out, module, args = argv[0], argv[2], argv[3:]
    own: dict = collections.defaultdict(collections.Counter)
    cum: dict = collections.defaultdict(collections.Counter)
    total: collections.Counter = collections.Counter()
    done = threading.Event()
    me = threading.get_ident()

    def sample():
        while not done.wait(interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, str(ident))
                total[name] += 1
                own[name][_label(frame.f_code)] += 1
                seen = set()
                while frame is not None:
                    lab = _label(frame.f_code)
                    if lab not in seen:
                        seen.add(lab)
                        cum[name][lab] += 1
                    frame = frame.f_back

    def report():
        done.set()
        lines = [f"sampling every {interval * 1000:g} ms; {module} {' '.join(args)}"]
        for name, n in total.most_common():
            lines.append(f"\n== thread {name}: {n} samples (~{n * interval:.2f} s)")
            for title, table in (("own", own[name]), ("cumulative", cum[name])):
                lines.append(f"  -- {title}")
                for lab, k in table.most_common(30):
                    lines.append(f"  {100.0 * k / n:6.1f}%  {k:8d}  {lab}")
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")

    me = threading.Thread(target=sample, name="profile-sampler", daemon=True)
    me.start()
    me = me.ident
    atexit.register(report)
    sys.argv = [module] + args
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
