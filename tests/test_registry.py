"""The kernel registry (engram_numba.stages.registry): what every record must carry, and the
lookups' refusals. The records come from `engram_numba.stages.catalog`, which loads every stage."""
import dataclasses
import re

import pytest

from engram_numba.stages import STAGES, catalog, registry
from engram_numba.stages.registry import CompileTarget, KernelRecord

NAME = re.compile(r"^[a-z0-9]+(_[a-z0-9]+)*_v\d+$")   # <family>_v<N>; a family may name its encoding (gemv_q2k)
RECORDS = catalog.records()


def _rid(rec):
    return f"{rec.stage}.{rec.name}"


def test_the_catalog_has_records_for_every_cuda_stage():
    assert {r.stage for r in RECORDS} == {"rows", "proj", "gate"}
    # within a family, the versions in ascending order (the order tools list them in)
    last: dict = {}
    for r in RECORDS:
        family, v = r.name.rsplit("_v", 1)
        assert int(v) == last.get((r.stage, family), 0) + 1, f"{r.stage}.{r.name} does not follow its family's last"
        last[(r.stage, family)] = int(v)
    # every family keeps its naive v1, bit-exact with the reference (the teaching baseline)
    for (stage, family), _ in last.items():
        if family != "cublas":
            assert registry.get(stage, f"{family}_v1").bit_exact, f"{stage}.{family}_v1"
    # the lookups by encoding are filters of the same list
    assert registry.names("rows", "fp8") == ["fp8_v1", "fp8_v2"]
    assert {r.encoding for r in registry.records("proj")} == {"bf16", "q2k", "fp8", "q2k_r"}


@pytest.mark.parametrize("rec", RECORDS, ids=_rid)
def test_record_fields(rec):
    assert isinstance(rec, KernelRecord)
    assert rec.stage in STAGES
    assert NAME.match(rec.name), rec.name
    assert isinstance(rec.changelog, str) and rec.changelog.strip(), "empty changelog"
    assert "\n" not in rec.changelog and "\r" not in rec.changelog, "the changelog must be one line"
    assert callable(rec.launcher), "no launcher: the stage's generic prepare"
    if not rec.requires:        # a numba kernel: the record carries it, its geometry and argument form
        assert rec.kernel is not None and callable(rec.geometry) and rec.args, rec
        assert rec.args.startswith(("naive", "u8")) == (rec.align == 0), (rec.args, rec.align)
    if rec.simulate:
        assert rec.sim_cases, "a record the simulator runs names its simulator cases"
    assert rec.default_rule is None or callable(rec.default_rule)
    assert isinstance(rec.default_when, str) and rec.default_when and "\n" not in rec.default_when
    assert (rec.default_rule is None) == rec.default_when.startswith("never"), (rec.default_rule, rec.default_when)
    assert registry.get(rec.stage, rec.name) is rec


@pytest.mark.parametrize("rec", RECORDS, ids=_rid)
def test_record_compile_targets(rec):
    targets = rec.compile_targets()
    # only a record that runs another library's kernels (rec.requires: cuBLAS through torch) has none
    assert isinstance(targets, list) and (targets or rec.requires), "no compile targets"
    prefix = _rid(rec)
    for t in targets:
        assert isinstance(t, CompileTarget), t
        assert t.name.startswith(prefix), (t.name, prefix)
        assert t.name[len(prefix):len(prefix) + 1] in ("", "[", "."), (t.name, prefix)   # not "q2k_v10"
        assert t.kernel is not None and isinstance(t.argtypes, tuple) and t.argtypes


def test_names_are_unique_within_a_stage():
    keys = [(r.stage, r.name) for r in RECORDS]
    assert len(set(keys)) == len(keys)
    all_targets = [t.name for t in catalog.compile_targets()]
    assert len(set(all_targets)) == len(all_targets)


def test_registering_a_duplicate_raises():
    old = RECORDS[0]
    twin = dataclasses.replace(old, changelog="a second record under the same name")
    with pytest.raises(ValueError, match=rf"kernel {old.stage}\.{old.name} is registered twice"):
        registry.register(twin)
    assert registry.get(old.stage, old.name) is old            # the first one stays
    assert registry.register(old) is old                       # re-registering the same record is harmless
    assert registry.records() == RECORDS


def test_registering_an_unknown_stage_raises():
    rec = KernelRecord(stage="dequant", name="x_v1", changelog="-", launcher=lambda *a, **k: None)
    with pytest.raises(ValueError, match="KernelRecord.stage must be one of"):
        registry.register(rec)
    assert registry.records() == RECORDS


@pytest.mark.parametrize("stage", ["rows", "proj", "gate"])
def test_get_of_an_unknown_name_lists_the_versions(stage):
    names = registry.names(stage)
    with pytest.raises(ValueError, match=re.escape(f"no {stage} kernel version 'nope_v1'; versions are {names}")):
        registry.get(stage, "nope_v1")
    with pytest.raises(ValueError, match=f"no {stage} kernel version"):
        registry.get(stage, 1)                                 # the old int spelling


def test_unknown_stage_raises():
    with pytest.raises(ValueError, match="unknown stage 'dequant'"):
        registry.get("dequant", "q2k_v1")
    with pytest.raises(ValueError, match="unknown stage 'dequant'"):
        registry.records("dequant")


def test_a_record_without_a_launcher_says_so():
    rec = KernelRecord(stage="rows", name="x_v1", changelog="-")
    with pytest.raises(RuntimeError, match="rows.x_v1 has no launcher"):
        rec.prepare()


def test_table_lists_every_record():
    table = catalog.table()
    for rec in RECORDS:
        assert rec.name in table and rec.changelog in table
