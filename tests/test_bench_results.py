"""Bench result files: today's record names, the loader that maps the earlier ones, and the README
table generated from the committed H200 result."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engram_numba.bench import report
from engram_numba.bench.results_io import RENAMED_RECORDS, load_results, record_name, upgrade

ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "bench" / "results" / "h200.json"
STAGES = ("hash", "rows", "proj", "gate")
END_TO_END = {"decode_step", "engine_build", "corpus_stats", "corpus_stats_distributed", "access_stats"}

# a result as the bench wrote it before the records were named after the stages
OLD = {
    "commit": "0123456789abcdef", "device": "NVIDIA H200", "copy_gbps": 4273.0,
    "section_commits": {"device": "0123456789", "decode": "fedcba9876"},
    "records": [
        {"stage": "gather_dequant", "T": 16, "time_us": 5.2, "floor_us": 0.05, "pct_of_floor": 1.0, "bytes": 1,
         "flops": 0, "gbps": 45.0, "tflops": None, "baselines": {"torch_index_select_dequant": 372.5},
         "kernel": "q2k_v3", "encoding": "q2k"},
        {"stage": "projection", "T": 1, "time_us": 83.0, "floor_us": 73.6, "pct_of_floor": 88.7, "bytes": 2,
         "flops": 3, "gbps": 3790.0, "tflops": 3.79, "baselines": {"torch_cublas_matmul": 93.5}, "kernel": "gemv_v3"},
        {"stage": "apply", "T": 1, "time_us": 90.1, "floor_us": 73.7, "pct_of_floor": 81.8, "bytes": 4, "flops": 3,
         "gbps": 3496.0, "tflops": 3.49, "baselines": {}, "kernel": "gemv_v3+gate_v3"},
        {"stage": "projection_q2k", "T": 4, "time_us": 46.3, "floor_us": 12.2, "pct_of_floor": 26.4, "bytes": 5,
         "flops": 6, "gbps": 1121.0, "tflops": 27.2, "baselines": {}, "kernel": "gemv_q2k_v4", "encoding": "q2k_r"},
        {"stage": "projection_fp8", "T": 8, "time_us": 68.2, "floor_us": 37.2, "pct_of_floor": 54.5, "bytes": 7,
         "flops": 8, "gbps": 2317.0, "tflops": 36.9, "baselines": {}, "kernel": "gemv_fp8_v2", "encoding": "fp8"},
        {"stage": "decode_step", "T": 1, "time_us": 96.7, "floor_us": 1.0, "pct_of_floor": 1.0, "bytes": 9,
         "flops": 0, "gbps": 1.0, "tflops": None, "baselines": {}},
    ],
    "variants": [
        {"stage": "gather_dequant", "T": 4096, "variant": "fp8_v2", "time_us": 33.2, "pct_of_floor": 54.2,
         "gbps": 2318.0, "tflops": None, "validated": True, "encoding": "fp8"},
        {"stage": "projection", "T": 128, "variant": "gemm_v6", "time_us": 105.0, "pct_of_floor": 71.9,
         "gbps": 3074.0, "tflops": 383.51, "validated": True},
    ],
}


def _is_today(name: str) -> bool:
    return name in END_TO_END or name == "proj+gate" or name.split("_")[0] in STAGES


def test_old_names_map_to_stage_names():
    new = upgrade(OLD)
    assert [r["stage"] for r in new["records"]] == ["rows_q2k", "proj_bf16", "proj+gate", "proj_q2k", "proj_fp8",
                                                    "decode_step"]
    assert [r["stage"] for r in new["variants"]] == ["rows_fp8", "proj_bf16"]
    assert new["records"][0]["baselines"] == {"torch_index_select_decode": 372.5}
    # everything else is carried over unchanged, and the input is not modified
    assert new["records"][3]["encoding"] == "q2k_r" and new["records"][1]["time_us"] == 83.0
    assert OLD["records"][0]["stage"] == "gather_dequant"
    assert "torch_index_select_dequant" in OLD["records"][0]["baselines"]
    # a result already in today's names comes back the same
    assert upgrade(new) == new
    assert record_name("gate") == "gate" and record_name("gather_dequant", {}) == "rows_q2k"


def test_load_results_reads_an_old_file(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(OLD))
    got = load_results(path)
    assert got == upgrade(OLD)
    assert json.loads(path.read_text()) == OLD          # the file itself is left as it was


@pytest.mark.parametrize("text, what", [("[1, 2]", "JSON object"), ("{", "invalid JSON"),
                                        ('{"records": [1]}', "'records' must be a list")])
def test_load_results_names_a_bad_file(tmp_path, text, what):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=what) as info:
        load_results(path)
    assert str(path) in str(info.value)


def test_report_of_an_old_result_uses_todays_names(tmp_path):
    table = report.markdown_table(OLD)
    assert "gather_dequant" not in table and "projection" not in table and "| rows_q2k | 16 |" in table
    assert "the decode section at `fedcba9876`" in table
    report.plot_results(OLD, tmp_path / "old.png")
    assert (tmp_path / "old.png").stat().st_size > 1000


def test_committed_h200_result_loads_in_todays_names():
    raw = json.loads(H200.read_text())
    res = load_results(H200)
    names = {r["stage"] for r in res["records"] + res["variants"]}
    assert all(_is_today(n) for n in names), sorted(names)
    assert not names & set(RENAMED_RECORDS)
    assert {"rows_q2k", "proj_bf16", "gate", "proj+gate", "proj_q2k", "proj_fp8"} <= names
    # one record out for one record in, same order, same figures
    assert len(res["records"]) == len(raw["records"]) and len(res["variants"]) == len(raw["variants"])
    for old, new in zip(raw["records"] + raw["variants"], res["records"] + res["variants"]):
        assert {k: v for k, v in old.items() if k not in ("stage", "baselines")} == \
               {k: v for k, v in new.items() if k not in ("stage", "baselines")}
        assert sorted(old.get("baselines", {}).values()) == sorted(new.get("baselines", {}).values())
    # every rows record of the sweep is named after the encoding it decodes
    assert all(r["stage"] == f"rows_{r['encoding']}" for r in res["variants"] if r["stage"].startswith("rows_"))


def test_readme_table_is_the_committed_result():
    """The README's results table is generated from bench/results/h200.json (report.main redraws it)."""
    text = (ROOT / "README.md").read_text()
    table = text.split(report.README_START, 1)[1].split(report.README_END, 1)[0].strip()
    assert table == report.markdown_table(load_results(H200)).strip()


def test_report_main_rewrites_a_readme(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{report.README_START}\nstale\n{report.README_END}\ntail\n")
    src = tmp_path / "old.json"
    src.write_text(json.dumps(OLD))
    assert report.main([str(src), "--readme", str(readme)]) == 0
    body = readme.read_text()
    assert "stale" not in body and "| proj_fp8 | 8 |" in body and body.endswith("tail\n")
    assert report.main([str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    (tmp_path / "plain.md").write_text("no markers\n")
    assert report.main([str(src), "--readme", str(tmp_path / "plain.md")]) == 2


def test_decode_bench_refuses_an_unknown_part_before_any_device_work():
    """A misspelt part gave an empty record list without a word (the GPU batch's decode records came
    back empty once); now it is refused by name, before the copy-bandwidth probe or any launch."""
    from engram_numba.bench import decode
    with pytest.raises(ValueError, match=r"unknown part\(s\) \['projection'\].*'proj', 'decode_step'"):
        decode.run(parts=("projection", "decode_step"))


def test_decode_bench_refuses_an_unknown_projection_weight_before_any_device_work():
    """proj_weights picks the projection records' wkv encodings (the FP8 GPU batch runs fp8 alone); a
    misspelt one is refused by name before any device work, not skipped into an empty record list."""
    from engram_numba.bench import decode
    with pytest.raises(ValueError, match=r"unknown projection weight\(s\) \['fp9'\].*'q2k', 'fp8'"):
        decode.run(parts=("proj",), proj_weights=("fp8", "fp9"))


def test_variants_merge_replaces_only_the_stage_families_run():
    """`bench --merge --sections variants --variant-stages proj` re-times the projection versions and keeps
    the rows and gate versions of the earlier run (a whole sweep is long; the FP8 GEMMs change alone)."""
    from engram_numba.bench.suite import merge_variants
    old = [{"stage": "rows_q2k", "variant": "q2k_v1"}, {"stage": "proj_bf16", "variant": "gemm_v4"},
           {"stage": "gate", "variant": "gate_v1"}]
    new = [{"stage": "proj_bf16", "variant": "gemm_v12"}, {"stage": "proj_fp8_deepseek", "variant": "gemm_fp8_v8"}]
    got = merge_variants(old, new, ("proj",))
    assert [r["variant"] for r in got] == ["q2k_v1", "gate_v1", "gemm_v12", "gemm_fp8_v8"]


@pytest.mark.parametrize("argv, message", [
    (["--sections", "variants", "--variant-stages", "projection"], r"unknown variant stage\(s\) \['projection'\]"),
    (["--sections", "device", "--variant-stages", "proj"], "needs the variants section"),
    (["--sections", "variants", "--no-variants", "--variant-stages", "proj"], "needs the variants section"),
])
def test_bench_refuses_bad_variant_stages_before_any_device_work(argv, message, capsys):
    """Checked before the GPU probe: on a machine without a GPU the message is about the argument."""
    from engram_numba.cli import main
    assert main(["bench", *argv]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_fp8_records_are_floored_at_the_fp8_tensor_core_rate():
    """DeepSeek's FP8 GEMMs run e4m3 MMAs at twice the bf16 rate: their floor says so (a bf16 floor made
    gemm_fp8_v8 look 90% of the way there at half the FP8 peak's throughput)."""
    from engram_numba.bench.timing import BF16_TFLOPS, FP8_TFLOPS, make_record
    flops = 2 * 4096 * 6144 * 25600
    bf16 = make_record("proj_bf16", 4096, 1800.0, 1, flops, 4000.0, {})
    fp8 = make_record("proj_fp8_deepseek", 4096, 1800.0, 1, flops, 4000.0, {}, peak_tflops=FP8_TFLOPS)
    assert FP8_TFLOPS == 2 * BF16_TFLOPS and "peak_tflops" not in bf16 and fp8["peak_tflops"] == FP8_TFLOPS
    assert fp8["floor_us"] == pytest.approx(bf16["floor_us"] / 2, rel=1e-4)
    assert fp8["pct_of_floor"] == pytest.approx(bf16["pct_of_floor"] / 2, abs=0.1)


def test_merged_parts_keep_the_commit_they_were_measured_at(tmp_path, monkeypatch):
    """`bench --merge` stamps each part with its commit: the part run now with today's, a kept part
    without a commit of its own with the earlier file's, so the README never says a part ran later
    than it did. The device work is stubbed out; only the bookkeeping runs."""
    import types as pytypes

    from engram_numba.bench import suite
    earlier = {"commit": "aaaaaaa", "device": "H200", "copy_gbps": 4000.0, "timing": "t",
               "section_commits": {"decode": "bbbbbbb"},
               "records": [{"stage": "gate", "T": 1}, {"stage": "decode_step", "T": 1}],
               "variants": [{"stage": "rows_q2k", "variant": "q2k_v1"}, {"stage": "proj_bf16", "variant": "gemm_v4"}],
               "host": {"x": 1}}
    out = tmp_path / "r.json"
    out.write_text(json.dumps(earlier))
    monkeypatch.setattr(suite, "bench_variants", lambda shape, quick, stages: [{"stage": "proj_fp8_deepseek",
                                                                                 "variant": "gemm_fp8_v8"}])
    monkeypatch.setattr(suite, "commit", lambda: "ccccccc")
    monkeypatch.setattr(suite, "plot_results", lambda result, png: None)
    monkeypatch.setattr(suite, "markdown_table", lambda result: "")
    monkeypatch.setattr("numba.cuda.is_available", lambda: True)
    monkeypatch.setattr("numba.cuda.config.ENABLE_CUDASIM", 0, raising=False)
    args = pytypes.SimpleNamespace(out=str(out), merge=True, sections="variants", variant_stages="proj", quick=True)
    assert suite.main(args) == 0
    got = json.loads(out.read_text())
    assert got["commit"] == "ccccccc"
    assert got["section_commits"] == {"device": "aaaaaaa", "decode": "bbbbbbb", "host": "aaaaaaa",
                                      "variants": "aaaaaaa", "variants:proj": "ccccccc"}
    assert [r["variant"] for r in got["variants"]] == ["q2k_v1", "gemm_fp8_v8"]


def test_bench_refuses_an_empty_section_list():
    """`--sections ,` named no section and ran nothing without a word; now it is refused like a misspelt one."""
    from engram_numba.bench.suite import _sections, _variant_stages
    with pytest.raises(ValueError, match=r"unknown bench section\(s\) \[','\]"):
        _sections(",")
    with pytest.raises(ValueError, match=r"unknown variant stage\(s\) \[','\]"):
        _variant_stages(",")
