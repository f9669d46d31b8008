"""Reading benchmark JSON, whatever names the file was written with.

The bench's record names follow the stages (`hash`, `rows`, `proj`, `gate`):

    rows_<encoding>   gather rows by id from a device table and decode them to bf16 (rows_q2k, rows_fp8, ...)
    proj_bf16         kv = bf16(x @ wkv^T) on a bf16 weight
    proj_q2k          the same on a Q2_K weight (read as stored, or re-laid out as q2k_r: the `encoding` field)
    proj_fp8          the same on an FP8 weight (e4m3 codes + e8m0 tile scales)
    gate              the gate and the in-place highway update
    proj+gate         the projection and the gate on its output, as `EngramV41.apply` runs them
    decode_step, engine_build, corpus_stats, corpus_stats_distributed, access_stats   end to end

Files written before these names used others (`gather_dequant`, `projection`, `projection_q2k`,
`projection_fp8`, `apply`, and a `torch_index_select_dequant` baseline). `load_results` and
`upgrade` return a result in today's names, so the report, the plot and `--merge` read old and new
files alike; the file on disk is left as it is.
"""
from __future__ import annotations

import json
from pathlib import Path

# old record name -> new; "{encoding}" is filled from the record (rows records say what they decode)
RENAMED_RECORDS = {
    "gather_dequant": "rows_{encoding}",
    "projection": "proj_bf16",
    "projection_q2k": "proj_q2k",
    "projection_fp8": "proj_fp8",
    "apply": "proj+gate",
}
RENAMED_BASELINES = {"torch_index_select_dequant": "torch_index_select_decode"}


def record_name(old: str, record: dict | None = None) -> str:
    """Today's name of a record written as `old` (unchanged when it is already today's)."""
    new = RENAMED_RECORDS.get(old)
    if new is None:
        return old
    return new.format(encoding=(record or {}).get("encoding") or "q2k")


def upgrade_record(record: dict) -> dict:
    """A copy of one record with today's record and baseline names."""
    rec = dict(record)
    if "stage" in rec:
        rec["stage"] = record_name(rec["stage"], rec)
    if isinstance(rec.get("baselines"), dict):
        rec["baselines"] = {RENAMED_BASELINES.get(k, k): v for k, v in rec["baselines"].items()}
    return rec


def upgrade(result: dict) -> dict:
    """A copy of a bench result with every record (and version-sweep record) in today's names."""
    if not isinstance(result, dict):
        raise ValueError(f"a bench result is a JSON object with 'records', got {type(result).__name__}")
    out = dict(result)
    for key in ("records", "variants"):
        if key in out:
            if not isinstance(out[key], list) or not all(isinstance(r, dict) for r in out[key]):
                raise ValueError(f"bench result: {key!r} must be a list of records (JSON objects)")
            out[key] = [upgrade_record(r) for r in out[key]]
    return out


def load_results(path) -> dict:
    """A bench result JSON file, in today's record names (the file is not changed)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a bench result (invalid JSON: {exc})") from None
    try:
        return upgrade(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
