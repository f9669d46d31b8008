"""`engram-numba bench`: the benchmark suite (needs a GPU; --smoke runs anywhere)."""
from __future__ import annotations

from .common import float_at_least, writable


def add_parser(sub) -> None:
    s = sub.add_parser("bench", help="benchmark every stage on the GPU (H200)")
    s.add_argument("--out", default=None, help="result JSON (default bench/results/h200.json)")
    s.add_argument("--png", default=None)
    s.add_argument("--quick", action="store_true", help="fewer repeats")
    s.add_argument("--smoke", action="store_true", help="tiny shapes, runs in the simulator: checks the suite itself")
    s.add_argument("--table-gb", type=float_at_least(0.001), default=2.0,
                   help="size of the random table on the device")
    s.add_argument("--variants-only", action="store_true", help="only time every kernel version")
    s.add_argument("--sections", help="comma-separated parts to run: host, device, decode, corpus, variants "
                                      "(default all); the JSON is rewritten after each part. 'access' alone: "
                                      "the CPU benchmark of row-access statistics on real text (no GPU; "
                                      "default --out bench/results/cpu_access.json)")
    s.add_argument("--access-tokens", type=int, default=20_000_000,
                   help="--sections access: tokens of real text to count (the corpus is repeated to reach it)")
    s.add_argument("--merge", action="store_true", help="add the sections run to the --out file of an earlier run")
    s.add_argument("--variant-stages", help="the variants section for these stage families only: rows, proj, gate "
                                            "(comma-separated; with --merge the other families' records are kept)")
    s.add_argument("--corpus-table-gb", type=float_at_least(0.001), default=None,
                   help="corpus_stats: each layer's device table in GB (default the released 32.3 GB)")
    s.add_argument("--no-variants", action="store_true", help="skip the per-version sweep")
    s.add_argument("--hash-only", action="store_true",
                   help="only the hasher's 4096-token prefill at the released configuration (CPU, no GPU needed)")
    s.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from ..bench.suite import main as bench_main
    if args.out:
        writable(args.out, "--out")
    return bench_main(args)
