"""Rewrite the table at the top of tests/gpu_results/README.md from a gpu-tier results file.

    python tools/summarize_gpu_tests.py tests/gpu_results/h200_gpu_tests.json
(the file tests/gpu_run.sh writes to $OUT/gpu_tests.json, copied here).
"""
import collections
import json
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "tests" / "gpu_results" / "README.md"


def summarize(path: Path) -> str:
    d = json.loads(path.read_text())
    agg = collections.OrderedDict()
    for r in d["records"]:
        module = r.get("module") or r.get("test_id", "").split("::")[0] or "?"
        module = module.rsplit("/", 1)[-1].removesuffix(".py").replace("test_kernels_", "").replace("test_", "")
        a = agg.setdefault((module, r.get("test", "?")), {"runs": 0, "passed": 0, "max": {}})
        a["runs"] += 1
        a["passed"] += bool(r.get("passed", True))
        for k, v in r.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and any(
                    t in k for t in ("err", "ulp", "max", "bad", "host_us")):
                a["max"][k] = max(a["max"].get(k, v), v)
    lines = ["# GPU tier on the H200", "",
             f"commit `{d['commit']}` on {d['device']}: **{d['passed']} passed, {d['failed']} failed, "
             f"{d['skipped']} skipped** (`ENGRAM_COMMIT=<hash> bash tests/gpu_run.sh --no-bench`). Every kernel "
             "version at the released shapes (dim 5120, hc 4, 24 columns, T in 1, 7, 128, 4096) and odd shapes, "
             "fresh random inputs, outputs poisoned, every element checked.", "",
             "| module | check | runs | passed | largest errors recorded |", "|---|---|---:|---:|---|"]
    for (m, t), a in agg.items():
        errs = ", ".join(f"{k} {v:g}" for k, v in a["max"].items()) or "exact (bit-identical)"
        lines.append(f"| {m} | {t} | {a['runs']} | {a['passed']} | {errs} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    readme = README
    text = readme.read_text()
    tail = text[text.index("\nFull records:"):]
    readme.write_text(summarize(Path(sys.argv[1])) + tail)
