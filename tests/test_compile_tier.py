"""Compile-only tier: every kernel compiles for sm_90a (what numba builds for on an H100/H200),
the fast paths do not spill, and the warpgroup-MMA kernels keep their MMAs asynchronous.

The simulator does no type checking, so this is what catches a kernel that runs there but would
not compile for the GPU. It runs `engram_numba.stages.compile_check` in a subprocess with the
simulator off (numba reads NUMBA_ENABLE_CUDASIM once, at import), no GPU needed. What it compiles
is every kernel record's `compile_targets()` (`engram_numba.stages.catalog`).
"""
import json
import os
import subprocess
import sys

import pytest

from engram_numba.stages import catalog, registry

CUDA_STAGES = ("rows", "proj", "gate")


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBA_ENABLE_CUDASIM"] = "0"
    proc = subprocess.run([sys.executable, "-m", "engram_numba.stages.compile_check", "--json"],
                          capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert lines, f"compile_check printed no report:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def _of_record(target_name: str, stage: str, name: str) -> bool:
    """Target names are "stage.name" then "[variant]" or ".form[variant]" (or nothing)."""
    prefix = f"{stage}.{name}"
    return target_name == prefix or target_name[len(prefix):len(prefix) + 1] in ("[", ".") \
        and target_name.startswith(prefix)


def test_every_module_has_targets(report):
    stages = {r["name"].split(".")[0] for r in report}
    assert set(CUDA_STAGES) <= stages, stages


def test_every_record_has_targets(report):
    """Each kernel record of rows/proj/gate contributes at least one target to the report, and
    every target in the report belongs to a record."""
    names = [r["name"] for r in report]
    # a record that runs another library's kernels (rec.requires, e.g. cuBLAS) has nothing to compile
    records = [(rec.stage, rec.name) for stage in CUDA_STAGES for rec in catalog.records(stage)
               if rec.compile_targets() or not rec.requires]
    assert records
    missing = [f"{s}.{n}" for s, n in records if not any(_of_record(t, s, n) for t in names)]
    assert not missing, missing
    orphans = [t for t in names if not any(_of_record(t, s, n) for s, n in records)]
    assert not orphans, orphans
    assert len(set(names)) == len(names), "two targets share a name"


def test_every_kernel_compiles_for_sm90a(report):
    failed = [(r["name"], r["error"]) for r in report if not r["ok"]]
    assert not failed, failed


def test_fast_kernels_do_not_spill(report):
    spilling = [(r["name"], r["spill_stores"], r["spill_loads"], r["stack_bytes"])
                for r in report if r["ok"] and r["spill_free_required"]
                and (r["spill_stores"] != 0 or r["spill_loads"] != 0)]
    assert not spilling, spilling


def test_vector_memory_ops_present_where_promised(report):
    # The fast paths were written around 16-byte loads/stores; a refactor that silently
    # drops them to scalar accesses costs bandwidth, so pin it.
    promised = [r for r in report if r["vector_io"]]
    assert promised, "no target is marked vector_io"
    for r in promised:
        if r["ok"]:
            i = r["instructions"]
            assert i["ld.global.v4"] + i["st.global.v4"] > 0, r["name"]


def test_fp8_gemv_v3_streams_16_byte_chunks(report):
    """gemv_fp8_v3 reads its codes only as 16-byte cp.async copies (4 a step, plus the ring's
    first steps) and x as 16-byte loads, with 16 mma a step and no local memory."""
    r = next(r for r in report if r["name"] == "proj.gemv_fp8_v3")
    assert r["ok"] and r["spill_stores"] == 0 and r["spill_loads"] == 0, r
    i = r["instructions"]
    assert i["cp.async"] >= 4 and i["ld.global.v4"] >= 2 and i["mma"] == 16 and i["local"] == 0, i


def test_report_flags_match_the_records(report):
    """vector_io and spill_free in the report are what the records' CompileTargets say."""
    want = {t.name: t for stage in CUDA_STAGES for rec in registry.records(stage) for t in rec.compile_targets()}
    for r in report:
        t = want[r["name"]]
        assert (r["vector_io"], r["spill_free_required"]) == (t.vector_io, t.spill_free), r["name"]


def test_wgmma_kernels_stay_asynchronous(report):
    """The Hopper kernels issue wgmma and fill shared memory with cp.async or TMA copies, and ptxas did
    not serialize their wgmma (it does when a kernel contains a call, e.g. a 64-bit division, or
    cannot prove the accumulators safe)."""
    wg = [r for r in report if r["ok"] and r["instructions"].get("wgmma", 0)]
    assert {r["name"].split("[")[0] for r in wg} >= {"proj.gemm_v4", "proj.gemm_v5", "proj.gemm_v6",
                                                      "proj.gemm_v7", "proj.gemm_v10", "proj.gemm_v11",
                                                      "proj.gemm_v12"}, \
        [r["name"] for r in wg]
    for r in wg:
        assert r["instructions"]["cp.async"] + r["instructions"]["tma.load"] > 0, r["name"]
        assert not r["wgmma_serialized"], r["name"]


def test_tma_gemms_load_by_tma_only(report):
    """gemm_v10 / gemm_v11 / gemm_v12 fill their stages with TMA box copies (x and w: two a k tile) and no
    cp.async; their "tma" epilogue stores by TMA (4 boxes), the fallback for N % 8 != 0 does not; no spills."""
    tma = {r["name"]: r for r in report if r["name"].split("[")[0] in ("proj.gemm_v10", "proj.gemm_v11", "proj.gemm_v12")}
    assert len(tma) == 6, sorted(tma)
    for name, r in tma.items():
        i = r["instructions"]
        assert r["ok"] and r["spill_stores"] == 0 and r["spill_loads"] == 0, name
        assert i["cp.async"] == 0 and i["tma.load"] >= 2, (name, i)
        assert (i["tma.store"] > 0) == ("/tmastore" in name), (name, i)


def _fp8_gemm_targets(report, name):
    by_name = {r["name"]: r for r in report if r["name"] == f"proj.{name}" or r["name"].startswith(f"proj.{name}[")}
    assert set(by_name) == {f"proj.{name}", f"proj.{name}[act_quant]", f"proj.{name}[e8m0_table]"}, sorted(by_name)
    assert all(r["ok"] and r["spill_stores"] == 0 and r["spill_loads"] == 0 for r in by_name.values()), by_name
    return by_name[f"proj.{name}"]


def test_fp8_gemm_v4_stays_asynchronous_without_spills(report):
    """gemm_fp8_v4: its 8 unrolled e4m3 wgmma a k-tile pair stay asynchronous (a partial tile in
    flight across a loop edge would serialize them), and its accumulator and two partial tiles fit
    the 128 registers of a 512-thread CTA without spilling (written plainly it spilled: see the
    kernel's notes on opaque_copy and after_retired)."""
    gemm = _fp8_gemm_targets(report, "gemm_fp8_v4")
    assert gemm["instructions"]["wgmma"] == 8 and gemm["instructions"]["cp.async"] > 0, gemm["instructions"]
    assert not gemm["wgmma_serialized"] and 0 < gemm["registers"] <= 128, gemm


def test_fp8_gemm_v5_stays_asynchronous_without_spills(report):
    """gemm_fp8_v5: v3's 4 e4m3 wgmma a k tile stay asynchronous, and its accumulator and two
    m64n128 partial tiles (192 registers) plus the loader's offsets computed before the loop fit
    without spilling, with room left (232 registers at the time of writing; the 255 limit would
    spill)."""
    gemm = _fp8_gemm_targets(report, "gemm_fp8_v5")
    assert gemm["instructions"]["wgmma"] == 4 and gemm["instructions"]["cp.async"] > 0, gemm["instructions"]
    assert not gemm["wgmma_serialized"] and 0 < gemm["registers"] <= 240, gemm


def test_fp8_gemm_v6_stays_asynchronous_without_spills(report):
    """gemm_fp8_v6 (one partial tile a warpgroup, a loader warpgroup: 384 threads): its e4m3 wgmma
    stay asynchronous (4 in the PTX, one a k32 block; one left in flight across a loop edge
    serialized them all), and the accumulator and partial tile fit the 168 registers a thread of a
    384-thread block without spilling (156 at the time of writing)."""
    gemm = _fp8_gemm_targets(report, "gemm_fp8_v6")
    assert gemm["instructions"]["wgmma"] == 4 and gemm["instructions"]["cp.async"] > 0, gemm["instructions"]
    assert not gemm["wgmma_serialized"] and 0 < gemm["registers"] <= 168, gemm


def test_fp8_gemm_v7_stays_asynchronous_without_spills(report):
    """gemm_fp8_v7 (v6's roles, the loader making the scale products, a persistent grid): its 4 e4m3
    wgmma a k tile stay asynchronous (the output-tile index is divided with a 32-bit div.u32: numba's
    64-bit division is a call, which serialized them), and it fits the 168 registers a thread of a
    384-thread block without spilling (160 at the time of writing)."""
    gemm = _fp8_gemm_targets(report, "gemm_fp8_v7")
    assert gemm["instructions"]["wgmma"] == 4 and gemm["instructions"]["cp.async"] > 0, gemm["instructions"]
    assert not gemm["wgmma_serialized"] and 0 < gemm["registers"] <= 168, gemm
