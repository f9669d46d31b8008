"""`engine_build` alone: start-up from a released-size sparse GGUF, on the file's first read and
from the page cache (with each of the uploader's read methods), with the split between reading
(file -> pinned) and copying (pinned -> device). About a minute on an H200 (three builds of 64.5 GB
after a tiny one that compiles, plus writing the files' wkv).

    # on the GPU machine, with the carried wheels installed as docs/gpu.md says (PYTHONPATH = .site:repo root):
    OUT=<folder> python3 tools/engine_build_bench.py [--table-gib 30] [--smoke]

Writes $OUT/engine_build.json (the bench record, `engram_numba/bench/decode.py`'s engine_build) and
prints the record's summary lines; the exit status is 0 when the build from the page cache reached
--target GB/s (default 10). The sparse file goes to $ENGRAM_BENCH_TMP (else the system's temporary
folder): a disk filesystem's first read allocates the page cache's pages, tmpfs reads holes as
zeros without caching them (the record names the filesystem).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table-gib", type=float, default=None,
                    help="table size per layer in GiB (default the released 30, tiny with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the simulator's wiring check)")
    ap.add_argument("--target", type=float, default=10.0, help="GB/s the page-cache build must reach")
    args = ap.parse_args(argv)
    from engram_numba.bench import decode
    from engram_numba.bench.timing import RELEASED, SMOKE
    from numba.cuda import config
    smoke = args.smoke or bool(config.ENABLE_CUDASIM)
    shape = SMOKE if smoke else RELEASED
    gib = args.table_gib if args.table_gib is not None else (0.0005 if smoke else decode.RELEASED_TABLE_GIB)
    if gib <= 0:
        print(f"error: --table-gib must be > 0, got {gib}", file=sys.stderr)
        return 2
    rec = decode.bench_engine_build(shape, print, gib, smoke)
    out = Path(os.environ.get("OUT", REPO / "gpu_out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_build.json").write_text(json.dumps(rec, indent=1))
    first = rec["first_read"]
    print(f"engine_build from the page cache: {rec['gbps']} GB/s (target >= {args.target}); readers "
          f"{rec['read_gb_per_s']} GB/s, copies {rec['copy_gb_per_s']} GB/s, link {rec['h2d_pinned_gbps']} GB/s; "
          f"first read {first['gbps']} GB/s; {rec['filesystem']}; written to {out / 'engine_build.json'}")
    return 0 if smoke or rec["gbps"] >= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
