"""Benchmark results out: the README table, the plot.

Both take a result in any record names (`results_io.upgrade` maps the earlier ones). To redraw the
README table and the plot from a committed result:

    python -m engram_numba.bench.report bench/results/h200.json --readme README.md --png bench/results/h200.png
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from .results_io import load_results, upgrade
from .timing import BF16_TFLOPS, FP8_TFLOPS

# the records of the suite's device section, one panel each in the plot
PLOTTED = ("rows_q2k", "proj_bf16", "gate", "proj+gate")

README_START, README_END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"


def _num(v, fmt="{:.1f}"):
    return "-" if v is None else fmt.format(v)


def _measured_at(result: dict) -> str:
    """"the decode section at `abc1234`; " for every section measured at another commit."""
    main = str(result["commit"])[:10]
    other, parts = {}, []
    for section, c in (result.get("section_commits") or {}).items():
        if ":" in section:                     # a part of a section ("variants:proj"), always named
            whole, part = section.split(":", 1)
            parts.append(f"the {whole} section's {part} records at `{str(c)[:10]}`; ")
        elif str(c)[:10] != main:
            other.setdefault(str(c)[:10], []).append(section)
    return "".join(f"the {' and '.join(s)} section{'s' if len(s) > 1 else ''} at `{c}`; "
                   for c, s in other.items()) + "".join(parts)


def markdown_table(result: dict) -> str:
    result = upgrade(result)
    lines = [f"Results at commit `{result['commit'][:10]}` ({_measured_at(result)}{result['device']}, copy bandwidth "
             f"{result['copy_gbps']:.0f} GB/s). Floor = max(bytes / copy bandwidth, FLOPs / {BF16_TFLOPS:.0f} TFLOP/s; "
             f"{FP8_TFLOPS:.0f} for the FP8 GEMM records, which carry `peak_tflops`).",
             "",
             "| record | T | kernel | time (us) | floor (us) | % of floor | GB/s | TFLOP/s | baselines (us) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in result["records"]:
        base = ", ".join(f"{k} {v:.1f}" for k, v in r["baselines"].items()) or "-"
        what = r.get("kernel", "-") + (f" ({r['variant']})" if r.get("variant") else "")
        lines.append(f"| {r['stage']} | {r['T']} | {what} | {r['time_us']:.1f} | {r['floor_us']:.1f} "
                     f"| {r['pct_of_floor']:.1f} | {r['gbps']:.0f} | {_num(r['tflops'], '{}')} | {base} |")
    if result.get("variants"):
        lines += ["", "Every kernel version in the registry where it competes (llm.c style: v1 is the naive "
                      "baseline), each checked against the numpy reference before it was timed:", "",
                  "| record | T | version | time (us) | % of floor | GB/s | TFLOP/s | valid |",
                  "|---|---:|---|---:|---:|---:|---:|---|"]
        for r in result["variants"]:
            lines.append(f"| {r['stage']} | {r['T']} | {r['variant']} | {r['time_us']:.1f} | {r['pct_of_floor']:.1f} "
                         f"| {r['gbps']:.0f} | {_num(r['tflops'], '{}')} | {r['validated']} |")
    host = result.get("host", {})
    if host:
        lines += ["", "Host: " + "; ".join(f"{k} {v}" for k, v in host.items() if not isinstance(v, dict))]
    return "\n".join(lines)


def update_readme(result: dict, readme: Path) -> bool:
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        return False
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(head + README_START + "\n" + markdown_table(result) + "\n" + README_END + tail)
    return True


def plot_results(result: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    result = upgrade(result)
    stages = [s for s in PLOTTED if any(r["stage"] == s for r in result["records"])]
    fig, axes = plt.subplots(1, max(len(stages), 1), figsize=(15, 3.8), sharey=False, squeeze=False)
    for ax, stage in zip(axes[0], stages):
        recs = [r for r in result["records"] if r["stage"] == stage]
        xs = np.arange(len(recs))
        ax.bar(xs - 0.2, [r["time_us"] for r in recs], 0.4, label="engram_numba")
        ax.bar(xs + 0.2, [r["floor_us"] for r in recs], 0.4, label="floor", color="grey", alpha=0.6)
        names = sorted({k for r in recs for k in r["baselines"]})
        colours = {k: f"C{i + 2}" for i, k in enumerate(names)}
        for r, x in zip(recs, xs):
            for name, v in r["baselines"].items():
                ax.plot([x - 0.4, x + 0.4], [v, v], lw=2, color=colours[name], label=name if x == 0 else None)
            ax.text(x - 0.2, r["time_us"], f"{r['pct_of_floor']:.0f}%", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(xs, [f"T={r['T']}" for r in recs])
        ax.set_yscale("log")
        ax.set_title(stage)
        ax.set_ylabel("us (log)")
        ax.legend(fontsize=7)
    fig.suptitle(f"engram_numba on {result['device']} at {result['commit'][:10]}: time vs floor (% of floor above bars)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    """Redraw the README table (between its markers) and/or the plot from a result JSON file."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m engram_numba.bench.report", description=main.__doc__)
    ap.add_argument("result", help="bench result JSON (any record names)")
    ap.add_argument("--readme", help="a Markdown file with the bench-table markers to rewrite")
    ap.add_argument("--png", help="write the plot here")
    args = ap.parse_args(argv)
    try:
        result = load_results(args.result)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.readme and not update_readme(result, Path(args.readme)):
        print(f"error: {args.readme} has no {README_START} ... {README_END} markers", file=sys.stderr)
        return 2
    if args.png:
        plot_results(result, Path(args.png))
    if not (args.readme or args.png):
        print(markdown_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
