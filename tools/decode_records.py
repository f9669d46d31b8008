"""The decode benchmark's projection records and decode_step at the released shapes, in two parts,
the JSON saved after each (so a timeout keeps what ran); for the GPU batch scripts.

    python3 tools/decode_records.py OUT_DIR NAME [--print-q2k] [--print-fp8] [--parts proj ...] [--weights fp8 ...]

Writes OUT_DIR/decode_dev_NAME.json. --print-q2k / --print-fp8: one line per proj_q2k / proj_fp8
record at the end. --parts: which of proj and decode_step (both by default); --weights: the
projection records' wkv encodings (q2k and fp8 by default).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("name")
    p.add_argument("--print-q2k", action="store_true")
    p.add_argument("--print-fp8", action="store_true")
    p.add_argument("--parts", nargs="+", choices=("proj", "decode_step"), default=("proj", "decode_step"))
    p.add_argument("--weights", nargs="+", choices=("q2k", "fp8"), default=("q2k", "fp8"))
    args = p.parse_args(argv)
    from engram_numba.bench import decode
    from engram_numba.bench.timing import RELEASED, commit, device_name
    t0 = time.time()
    res = {"commit": commit(), "device": device_name(), "records": [], "decode": {}}
    for part in args.parts:
        r = decode.run(RELEASED, quick=True, parts=(part,), n_tokens=256, proj_weights=tuple(args.weights))
        res["records"] += r["records"]
        res["decode"].update(r["decode"])
        res["seconds"] = round(time.time() - t0, 1)
        (args.out / f"decode_dev_{args.name}.json").write_text(json.dumps(res, indent=1, default=str))
    for stage, wanted in (("proj_q2k", args.print_q2k), ("proj_fp8", args.print_fp8)):
        for r in res["records"] if wanted else ():
            if r.get("stage") == stage:
                print(stage, r.get("T"), r.get("kernel"), r.get("time_us"), r.get("pct_of_floor"), r.get("validated"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
