"""The rows stage's Q3_K, Q4_K, Q8_0 and FP8 kernels (cuda_kquants.py, cuda_fp8.py, launched
through launch.py) against the numpy reference. Versions are the stage's records of each encoding
("q3_k_v1", "q3_k_v2", ..., "fp8_v2"), iterated from the registry.

Tolerance: exact. Every output word equals `reference.rows_reference(raw, encoding)` bit for bit:
for rows with finite scales, and for FP8 rows with NaN codes or NaN scales too (their NaN words are
0x7FFF on every backend). K-quant rows with an inf/NaN fp16 scale must give NaN in exactly the
reference's places, with any payload (the GPU returns one canonical NaN, x86 propagates payloads).
Outputs are poisoned with 0x7F7F so every element must be written.

Simulator tier: tiny shapes. GPU tier (`gpu` marker): 4096 tokens x 24 columns, decoded in order
and gathered by id from a table of more than 4 GiB (ids past 2^31 and 2^32 bytes), every word
checked; each check appends a summary to RESULTS.
"""
import numpy as np
import pytest
from numba import cuda

from engram_numba.bf16 import bf16_to_f32
from engram_numba.stages import registry
from engram_numba.stages.rows import launch as RL
from engram_numba.stages.rows.encodings import ENCODINGS, random_raw_rows
from engram_numba.stages.rows.fp8 import assemble_rows_fp8, split_rows_fp8
from engram_numba.stages.rows.reference import rows_reference

from .conftest import POISON, compare, poisoned

NAN_ROW = 0x7FC0
ENCS = ("q3_k", "q4_k", "q8_0", "fp8")
RECORDS = [(enc, name) for enc in ENCS for name in registry.names("rows", encoding=enc)]
FAST = [(enc, name) for enc, name in RECORDS if not name.endswith("_v1")]
RESULTS = []  # GPU tier summaries


def table_and_ids(rng, encoding, rows, n, dtype):
    table = random_raw_rows(encoding, rows, rng)
    ids = rng.integers(0, rows, n).astype(dtype)
    ids[: min(n, 3)] = [rows - 1, 0, rows - 1][: min(n, 3)]      # the table's end, its start, a repeat
    return table, ids


def scales_kwarg(encoding, table, separate):
    """(device table, extra launcher kwargs): for fp8 with separate scales, the codes and scales."""
    if not separate:
        return cuda.to_device(table), {}
    codes, scales = split_rows_fp8(table)
    return cuda.to_device(np.ascontiguousarray(codes)), {"scales": cuda.to_device(np.ascontiguousarray(scales))}


LAYOUTS = [(enc, name, False) for enc, name in RECORDS] + [(enc, name, True) for enc, name in RECORDS if enc == "fp8"]
LAYOUT_IDS = [f"{name}{'-separate-scales' if sep else ''}" for _, name, sep in LAYOUTS]


# ---- simulator tier -----------------------------------------------------------------------------

@pytest.mark.parametrize("encoding,version,n",
                         [(e, v, n) for e, v in RECORDS for n in registry.get("rows", v).sim_cases])
def test_decode_bit_exact(rng, encoding, version, n):
    raw = random_raw_rows(encoding, n, rng)
    out = poisoned(n)
    res = RL.decode_rows(cuda.to_device(raw), out, encoding=encoding, version=version)
    assert res is out
    compare(res.copy_to_host(), rows_reference(raw, encoding))


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("encoding,version,separate", LAYOUTS, ids=LAYOUT_IDS)
def test_gather_device_ids(rng, encoding, version, separate, id_dtype):
    table, ids = table_and_ids(rng, encoding, 13, 10, id_dtype)
    dev, extra = scales_kwarg(encoding, table, separate)
    out = poisoned(10)
    res = RL.gather_rows(dev, cuda.to_device(ids), out, encoding=encoding, version=version, **extra)
    assert res is out
    compare(res.copy_to_host(), rows_reference(table, encoding)[ids])


@pytest.mark.parametrize("encoding,version,separate", LAYOUTS, ids=LAYOUT_IDS)
def test_gather_host_ids_and_default_version(rng, encoding, version, separate):
    table, ids = table_and_ids(rng, encoding, 7, 5, np.uint32)
    dev, extra = scales_kwarg(encoding, table, separate)
    res = RL.gather_rows(dev, ids, encoding=encoding, version=version, **extra)
    compare(res.copy_to_host(), rows_reference(table, encoding)[ids.astype(np.int64)])
    res = RL.gather_rows(dev, ids, encoding=encoding, **extra)          # the default record
    compare(res.copy_to_host(), rows_reference(table, encoding)[ids.astype(np.int64)])


@pytest.mark.parametrize("encoding,version,separate", LAYOUTS, ids=LAYOUT_IDS)
def test_bad_device_ids_give_nan_rows_count_and_error(rng, encoding, version, separate):
    table, ids = table_and_ids(rng, encoding, 9, 8, np.int64)
    ids[2], ids[5], ids[7] = -1, 9, 10**12
    dev, extra = scales_kwarg(encoding, table, separate)
    counter = cuda.to_device(np.zeros(1, np.uint32))
    out = poisoned(8)
    RL.gather_rows(dev, cuda.to_device(ids), out, encoding=encoding, version=version, bad_count=counter, **extra)
    assert int(counter.copy_to_host()[0]) == 3
    got = out.copy_to_host()
    bad = np.array([2, 5, 7])
    assert (got[bad] == NAN_ROW).all()
    good = np.setdiff1d(np.arange(8), bad)
    compare(got[good], rows_reference(table, encoding)[ids[good]])
    with pytest.raises(ValueError, match=r"row id -1 at index 2 is outside the table's \[0, 9\) rows \(3 out-of-range ids\)"):
        RL.gather_rows(dev, cuda.to_device(ids), poisoned(8), encoding=encoding, version=version, **extra)


@pytest.mark.parametrize("encoding", ENCS)
def test_bad_host_ids_raise_before_any_launch(rng, monkeypatch, encoding):
    table, ids = table_and_ids(rng, encoding, 9, 6, np.int64)
    ids[4] = 9
    dev, out = cuda.to_device(table), poisoned(6)
    monkeypatch.setattr(RL, "prepare_gather", lambda *a, **k: pytest.fail("launched although the ids were refused"))
    with pytest.raises(ValueError, match=r"row id 9 at index 4 is outside the table's \[0, 9\) rows"):
        RL.gather_rows(dev, ids, out, encoding=encoding)
    assert (out.copy_to_host() == POISON).all()


@pytest.mark.parametrize("encoding,version", [(e, v) for e, v in RECORDS if e != "fp8"])
def test_kquant_non_finite_scales_nan_in_place(rng, encoding, version):
    raw = random_raw_rows(encoding, 4, rng)
    offsets = {"q3_k": [108], "q4_k": [0, 2], "q8_0": [34, 136]}[encoding]
    for i, off in enumerate(offsets):
        raw[i, off:off + 2] = np.array([[0x7C00, 0xFE00][i % 2]], np.uint16).view(np.uint8)
    ref = rows_reference(raw, encoding)
    assert np.isnan(bf16_to_f32(ref)).any()
    got = RL.decode_rows(cuda.to_device(raw), poisoned(4), encoding=encoding, version=version).copy_to_host()
    compare(got, ref, allow_nan_payload=True)


@pytest.mark.parametrize("version", registry.names("rows", encoding="fp8"))
def test_fp8_nan_and_extreme_scales_bit_exact(rng, version):
    """NaN codes, NaN scales and the scale bytes outside the exact range (0..2: bf16 rounding of
    the smallest codes; 247..254: overflow to inf) give the reference's words exactly."""
    raw = random_raw_rows("fp8", 6, rng)
    raw[0, [3, 100]] = [0x7F, 0xFF]
    raw[1, 256 + 2] = 255
    raw[2, 256:] = [0, 1, 2, 0, 1, 2, 0, 1]
    raw[3, 256:] = [247, 248, 250, 252, 254, 249, 251, 253]
    raw[4, :256] = np.arange(256)                                  # every code, two NaN among them
    raw[5, :256] = np.arange(256)[::-1]
    raw[5, 256:] = [0, 254, 3, 246, 255, 127, 2, 247]
    ref = rows_reference(raw, "fp8")
    w = bf16_to_f32(ref)
    assert np.isnan(w).any() and np.isinf(w).any()
    got = RL.decode_rows(cuda.to_device(raw), poisoned(6), encoding="fp8", version=version).copy_to_host()
    compare(got, ref)
    codes, scales = split_rows_fp8(raw)
    got = RL.gather_rows(cuda.to_device(np.ascontiguousarray(codes)), np.array([5, 0, 3, 1]), encoding="fp8",
                         version=version, scales=cuda.to_device(np.ascontiguousarray(scales))).copy_to_host()
    compare(got, ref[[5, 0, 3, 1]])


@pytest.mark.parametrize("encoding", ENCS)
def test_unaligned_views_fall_back_to_v1(rng, encoding):
    width = ENCODINGS[encoding].row_bytes
    raw = random_raw_rows(encoding, 3, rng)
    flat = np.zeros(3 * width + 1, np.uint8)
    flat[1:] = raw.ravel()
    view = cuda.to_device(flat)[1:].reshape(3, width)               # 1 byte past an aligned allocation
    out = poisoned(3)
    assert RL.pick(encoding, None, view, out).name == f"{encoding}_v1"
    compare(RL.decode_rows(view, out, encoding=encoding).copy_to_host(), rows_reference(raw, encoding))
    for _, version in [r for r in FAST if r[0] == encoding]:
        with pytest.raises(ValueError, match="aligned"):
            RL.decode_rows(view, encoding=encoding, version=version)
    ids = np.array([2, 0], np.int64)
    compare(RL.gather_rows(view, ids, encoding=encoding).copy_to_host(), rows_reference(raw, encoding)[ids])


def test_fp8_unaligned_separate_scales_fall_back_to_v1(rng):
    raw = random_raw_rows("fp8", 4, rng)
    codes, scales = split_rows_fp8(raw)
    flat = np.zeros(4 * 8 + 2, np.uint8)
    flat[2:] = scales.ravel()
    sview = cuda.to_device(flat)[2:].reshape(4, 8)                  # 2 bytes off: not 4-byte aligned
    dcodes, out = cuda.to_device(np.ascontiguousarray(codes)), poisoned(4)
    assert RL.pick("fp8", None, dcodes, out, sview).name == "fp8_v1"
    ids = np.array([3, 1, 1, 0])
    compare(RL.gather_rows(dcodes, ids, out, encoding="fp8", scales=sview).copy_to_host(),
            rows_reference(raw, "fp8")[ids])
    with pytest.raises(ValueError, match="aligned"):
        RL.gather_rows(dcodes, ids, encoding="fp8", scales=sview, version="fp8_v2")


def test_default_rules_per_encoding():
    for enc in ENCS:
        for sim in (True, False):
            ctx = {"encoding": enc, "simulator": sim}
            assert registry.default("rows", dict(ctx, aligned=True)).name == f"{enc}_v2"
            assert registry.default("rows", dict(ctx, aligned=False)).name == f"{enc}_v1"
        assert RL.pick(enc, None).name == f"{enc}_v2"


def test_scales_argument_validation(rng):
    raw = random_raw_rows("fp8", 5, rng)
    codes, scales = (cuda.to_device(np.ascontiguousarray(a)) for a in split_rows_fp8(raw))
    ids = np.array([0, 4])
    with pytest.raises(ValueError, match=r"scales= is for fp8 tables .* q8_0 rows carry their own scales"):
        RL.gather_rows(cuda.to_device(random_raw_rows("q8_0", 5, rng)), ids, encoding="q8_0", scales=scales)
    with pytest.raises(ValueError, match=r"table \(fp8 codes, scales given separately\) must be uint8 \[n, 256\]"):
        RL.gather_rows(cuda.to_device(raw), ids, encoding="fp8", scales=scales)
    with pytest.raises(ValueError, match=r"scales must be uint8 \[n, 8\]"):
        RL.gather_rows(codes, ids, encoding="fp8", scales=cuda.to_device(np.zeros((5, 4), np.uint8)))
    with pytest.raises(ValueError, match="scales has 4 rows, the table of codes 5"):
        RL.gather_rows(codes, ids, encoding="fp8", scales=cuda.to_device(np.zeros((4, 8), np.uint8)))
    with pytest.raises(TypeError, match="scales is a host numpy array"):
        RL.gather_rows(codes, ids, encoding="fp8", scales=np.zeros((5, 8), np.uint8))
    with pytest.raises(ValueError, match=r"table must be uint8 \[n, 264\]"):
        RL.gather_rows(codes, ids, encoding="fp8")
    with pytest.raises(ValueError, match=r"rows kernel 'fp8_v1' decodes 'fp8' rows, not 'q4_k'"):
        RL.decode_rows(cuda.to_device(random_raw_rows("q4_k", 2, rng)), encoding="q4_k", version="fp8_v1")


# ---- GPU tier -----------------------------------------------------------------------------------

TOKENS, COLS = 4096, 24
N_IDS = TOKENS * COLS
BIG_TABLE_BYTES = 2**32 + 2**28            # a table past 4 GiB: ids beyond 2^31 and 2^32 bytes


def _record(test, version, n_bad, **extra):
    entry = dict(test=test, shape=[N_IDS, 256], version=version, max_err="exact" if n_bad == 0 else f"{n_bad} words",
                 passed=n_bad == 0, **extra)
    RESULTS.append(entry)
    print(entry)


@cuda.jit
def _scatter_rows(table, ids, rows):
    # table[ids[i], :] = rows[i, :] for uint8 tables of any size (64-bit row index)
    i = cuda.grid(1)
    if i >= rows.shape[0] * rows.shape[1]:
        return
    r = i // rows.shape[1]
    c = i % rows.shape[1]
    table[np.int64(ids[r]), c] = rows[r, c]


def _big_table(rng, encoding, width):
    """A device table [rows, width] of more than 4 GiB (mostly uninitialised) and N_IDS random ids
    over all of it, whose rows hold random raw rows: (device table, ids, the raw rows of the ids)."""
    n_rows = BIG_TABLE_BYTES // width + 1
    ids = rng.integers(0, n_rows, N_IDS, dtype=np.int64)
    ids[:6] = [0, 2**31 // width, 2**31 // width + 1, 2**32 // width, 2**32 // width + 1, n_rows - 1]
    uniq, inverse = np.unique(ids, return_inverse=True)
    rows = random_raw_rows(encoding, uniq.size, rng)
    dev = cuda.device_array((n_rows, width), np.uint8)
    return dev, uniq, rows, ids, inverse


@pytest.mark.gpu
@pytest.mark.parametrize("encoding", ENCS)
def test_gpu_decode_released_shape(rng, encoding):
    raw = random_raw_rows(encoding, N_IDS, rng)
    ref = rows_reference(raw, encoding)
    dev = cuda.to_device(raw)
    for version in registry.names("rows", encoding=encoding):
        out = poisoned(N_IDS)
        RL.decode_rows(dev, out, encoding=encoding, version=version)
        _record("decode", version, compare(out.copy_to_host(), ref))


@pytest.mark.gpu
@pytest.mark.parametrize("separate", [False, True], ids=["inline", "separate-scales"])
@pytest.mark.parametrize("encoding", ENCS)
def test_gpu_gather_released_shape_from_a_table_past_4gib(rng, encoding, separate):
    if separate and encoding != "fp8":
        pytest.skip("separate scales are an fp8 layout")
    width = 256 if separate else ENCODINGS[encoding].row_bytes
    dev, uniq, rows, ids, inverse = _big_table(rng, encoding, width)
    ref = rows_reference(rows, encoding)[inverse]                      # [N_IDS, 256]
    extra = {}
    if separate:
        codes, scales = split_rows_fp8(rows)
        d_scales = cuda.device_array((dev.shape[0], 8), np.uint8)
        _scatter_rows.forall(scales.size)(d_scales, cuda.to_device(uniq), cuda.to_device(np.ascontiguousarray(scales)))
        rows = np.ascontiguousarray(codes)
        extra = {"scales": d_scales}
    _scatter_rows.forall(rows.size)(dev, cuda.to_device(uniq), cuda.to_device(rows))
    cuda.synchronize()
    for version in registry.names("rows", encoding=encoding):
        for id_dtype in (np.int32, np.int64):
            out = poisoned(N_IDS)
            RL.gather_rows(dev, cuda.to_device(ids.astype(id_dtype)), out, encoding=encoding, version=version, **extra)
            _record(f"gather>4GiB[{np.dtype(id_dtype).name}{', separate scales' if separate else ''}]", version,
                    compare(out.copy_to_host(), ref), table_gib=round(dev.nbytes / 2**30, 2))
    del dev


@pytest.mark.gpu
@pytest.mark.parametrize("version", registry.names("rows", encoding="fp8"))
def test_gpu_fp8_nan_and_extreme_scales(rng, version):
    raw = random_raw_rows("fp8", 4096, rng)
    raw[::7, 256 + 3] = 255
    raw[1::11, 17] = 0x7F
    raw[2::13, 256:] = rng.integers(0, 3, (raw[2::13].shape[0], 8))
    raw[3::13, 256:] = rng.integers(247, 255, (raw[3::13].shape[0], 8))
    ref = rows_reference(raw, "fp8")
    got = RL.decode_rows(cuda.to_device(raw), poisoned(4096), encoding="fp8", version=version).copy_to_host()
    _record("decode[fp8 NaN and extreme scales]", version, compare(got, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("encoding", [e for e in ENCS if e != "fp8"])
def test_gpu_kquant_non_finite_scales(rng, encoding):
    raw = rng.integers(0, 256, (4096, ENCODINGS[encoding].row_bytes), dtype=np.uint8)   # ~6% inf/NaN scales
    ref = rows_reference(raw, encoding)
    for version in registry.names("rows", encoding=encoding):
        got = RL.decode_rows(cuda.to_device(raw), poisoned(4096), encoding=encoding, version=version).copy_to_host()
        _record("decode[random bytes, NaN payload free]", version, compare(got, ref, allow_nan_payload=True))


@pytest.mark.gpu
def test_gpu_fp8_split_and_inline_layouts_agree(rng):
    raw = random_raw_rows("fp8", 1 << 16, rng)
    codes, scales = split_rows_fp8(raw)
    np.testing.assert_array_equal(assemble_rows_fp8(codes, scales), raw)
    ids = cuda.to_device(rng.integers(0, 1 << 16, N_IDS))
    a = RL.gather_rows(cuda.to_device(raw), ids, encoding="fp8").copy_to_host()
    b = RL.gather_rows(cuda.to_device(np.ascontiguousarray(codes)), ids, encoding="fp8",
                       scales=cuda.to_device(np.ascontiguousarray(scales))).copy_to_host()
    _record("gather[inline == separate scales]", "default", int((a != b).sum()))
    assert (a == b).all()
