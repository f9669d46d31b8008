"""The rows stage's @cuda.jit kernels (engram_numba/stages/rows/cuda_q2k.py, launched through
engram_numba/stages/rows/launch.py) against the numpy reference. Versions are the rows stage's
Q2_K kernel records ("q2k_v1", ...), iterated from the registry.

Tolerance: exact. Every output word must equal `reference.rows_reference(blocks)` bit for bit for
blocks whose fp16 d and dmin are finite. Blocks made of random bytes can carry an inf/NaN d or dmin;
their NaN outputs must sit in exactly the reference's places, but the NaN payload may differ (the
GPU's fp32 unit returns one canonical NaN, x86 propagates payloads), so there a NaN matches any NaN
and every non-NaN word must still be bit-identical.

Outputs are poisoned with 0x7F7F (bf16 max finite, which no Q2_K block decodes to: |y| <= 3e6) so
every element must be written. Simulator tier: tiny shapes (the simulator runs each thread as a
Python thread). GPU tier (`gpu` marker): the released V4.1 shapes (T in {1, 7, 128, 4096} tokens x
24 hash columns) and odd shapes, every element checked; each GPU test appends a summary to RESULTS.
"""

import numpy as np
import pytest
from numba import cuda

from engram_numba.bf16 import bf16_to_f32
from engram_numba.stages import registry
from engram_numba.stages.rows import cuda_q2k as D
from engram_numba.stages.rows import launch as RL
from engram_numba.stages.rows.encodings import ENCODINGS
from engram_numba.stages.rows.reference import rows_reference

from .conftest import POISON, compare, poisoned

NAN_ROW = 0x7FC0
VERSIONS = registry.names("rows", encoding="q2k")      # every Q2_K record, in version order
NAIVE = "q2k_v1"
FAST = [v for v in VERSIONS if v != NAIVE]             # word loads and 16-byte stores: aligned data only
RESULTS = []  # GPU tier: one summary dict per check, for the results file


# ---- inputs -------------------------------------------------------------------------------------

def _f16_bits(rng, n, kind):
    """n fp16 bit patterns (uint16) of one kind, all finite."""
    if kind == "typical":        # the magnitudes a real Q2_K table has, either sign
        v = rng.uniform(1e-4, 0.1, n) * rng.choice([-1.0, 1.0], n)
        return v.astype(np.float16).view(np.uint16)
    if kind == "subnormal":      # exponent 0: d = m * 2^-24
        return (rng.integers(1, 0x400, n) | (rng.integers(0, 2, n) << 15)).astype(np.uint16)
    if kind == "negative":
        return (rng.integers(0x0001, 0x7C00, n) | 0x8000).astype(np.uint16)
    if kind == "zero":
        return (rng.integers(0, 2, n) << 15).astype(np.uint16)   # +0 and -0
    return (rng.integers(0, 0x7C00, n) | (rng.integers(0, 2, n) << 15)).astype(np.uint16)  # any finite


_KINDS = ("typical", "subnormal", "negative", "any", "typical", "zero")


def finite_blocks(rng, n):
    """Random Q2_K blocks [n, 84] with finite d and dmin, cycling through d/dmin kinds per row
    (typical magnitudes, subnormal, negative, any finite bit pattern, zeros)."""
    blocks = rng.integers(0, 256, (n, 84), dtype=np.uint8)
    i = np.arange(n)
    for col, kind_of_row in ((80, i % len(_KINDS)), (82, (i // len(_KINDS) + i) % len(_KINDS))):
        bits = np.empty(n, np.uint16)
        for k, kind in enumerate(_KINDS):
            rows = kind_of_row == k
            bits[rows] = _f16_bits(rng, int(rows.sum()), kind)
        blocks[:, col:col + 2] = bits.view(np.uint8).reshape(n, 2)
    return blocks


def random_byte_blocks(rng, n):
    """Blocks of uniformly random bytes: about 6 % of them have an inf/NaN d or dmin."""
    blocks = rng.integers(0, 256, (n, 84), dtype=np.uint8)
    blocks[0, 81] = 0x7C  # make sure one row has an inf/NaN d
    return blocks


# ---- simulator tier (also runs on a GPU) --------------------------------------------------------

@pytest.mark.parametrize("version,n", [(v, n) for v in VERSIONS for n in registry.get("rows", v).sim_cases])
def test_dequant_bit_exact_finite_scales(rng, version, n):
    blocks = finite_blocks(rng, n)
    out = poisoned(n)
    res = RL.decode_rows(cuda.to_device(blocks), out, version=version)
    assert res is out
    assert compare(res.copy_to_host(), rows_reference(blocks)) == 0


@pytest.mark.parametrize("version", VERSIONS)
def test_dequant_random_bytes(rng, version):
    blocks = random_byte_blocks(rng, 12)
    ref = rows_reference(blocks)
    got = RL.decode_rows(cuda.to_device(blocks), poisoned(12), version=version).copy_to_host()
    compare(got, ref, allow_nan_payload=True)
    print(f"{version}: {int(np.isnan(bf16_to_f32(ref)).sum())} NaN words, "
          f"{int((got != ref).sum())} differ only in NaN payload")


def test_dequant_allocates_output(rng):
    blocks = finite_blocks(rng, 5)
    res = RL.decode_rows(cuda.to_device(blocks))
    assert res.shape == (5, 256) and res.dtype == np.uint16
    compare(res.copy_to_host(), rows_reference(blocks))


def test_dequant_empty():
    res = RL.decode_rows(cuda.to_device(np.zeros((0, 84), np.uint8)))
    assert res.shape == (0, 256)


def _table_and_ids(rng, rows, n, dtype):
    table = finite_blocks(rng, rows)
    ids = rng.integers(0, rows, n).astype(dtype)
    ids[: min(n, 4)] = [rows - 1, rows - 2, rows - 1, 0][: min(n, 4)]  # the table end, and repeats
    if n > 8:
        ids[5:8] = ids[4]
    return table, ids


@pytest.mark.parametrize("n", [1, 33])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("version", VERSIONS)
def test_gather_device_ids(rng, version, id_dtype, n):
    table, ids = _table_and_ids(rng, 40, n, id_dtype)
    out = poisoned(n)
    res = RL.gather_rows(cuda.to_device(table), cuda.to_device(ids), out, version=version)
    assert res is out
    compare(res.copy_to_host(), rows_reference(table)[ids])


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64, np.uint32])
@pytest.mark.parametrize("version", VERSIONS)
def test_gather_host_ids(rng, version, id_dtype):
    table, ids = _table_and_ids(rng, 17, 9, id_dtype)
    res = RL.gather_rows(cuda.to_device(table), ids, version=version)
    compare(res.copy_to_host(), rows_reference(table)[ids.astype(np.int64)])


@pytest.mark.parametrize("bad_id", [-1, 17, 2**31 - 1])
def test_gather_host_bad_id_raises_before_copy_or_launch(rng, monkeypatch, bad_id):
    table, ids = _table_and_ids(rng, 17, 9, np.int64)
    ids[6] = bad_id
    dev_table, out = cuda.to_device(table), poisoned(9)

    def forbidden(*args, **kwargs):
        raise AssertionError("copied or launched although the ids were refused")
    monkeypatch.setattr(RL.cuda, "to_device", forbidden)
    monkeypatch.setattr(RL, "prepare_gather", forbidden)      # the only way to a launch
    with pytest.raises(ValueError, match=rf"row id {bad_id} at index 6 is outside the table's \[0, 17\) rows"):
        RL.gather_rows(dev_table, ids, out)
    monkeypatch.undo()
    assert (out.copy_to_host() == POISON).all(), "out was written although the ids were refused"


@pytest.mark.parametrize("version", VERSIONS)
def test_gather_device_bad_ids_raise_after_launch(rng, version):
    table, ids = _table_and_ids(rng, 17, 9, np.int32)
    ids[3], ids[7] = 17, -5
    msg = r"row id 17 at index 3 is outside the table's \[0, 17\) rows \(2 out-of-range ids\)"
    with pytest.raises(ValueError, match=msg):
        RL.gather_rows(cuda.to_device(table), cuda.to_device(ids), poisoned(9), version=version)


@pytest.mark.parametrize("version", VERSIONS)
def test_gather_bad_ids_give_nan_rows_and_count(rng, version):
    table, ids = _table_and_ids(rng, 17, 11, np.int64)
    ids[2], ids[9], ids[10] = -1, 17, 10**12   # 10**12 * 84 bytes is far beyond any table
    counter = cuda.to_device(np.zeros(1, np.uint32))
    out = poisoned(11)
    RL.gather_rows(cuda.to_device(table), cuda.to_device(ids), out, version=version,
                   bad_count=counter)
    assert int(counter.copy_to_host()[0]) == 3
    got = out.copy_to_host()
    bad = np.array([2, 9, 10])
    assert (got[bad] == NAN_ROW).all()
    good = np.setdiff1d(np.arange(11), bad)
    compare(got[good], rows_reference(table)[ids[good]])
    # check=False: no raise, same output
    out2 = poisoned(11)
    RL.gather_rows(cuda.to_device(table), cuda.to_device(ids), out2, version=version, check=False)
    assert (out2.copy_to_host() == got).all()


def test_gather_empty_ids(rng):
    table = cuda.to_device(finite_blocks(rng, 3))
    assert RL.gather_rows(table, np.zeros(0, np.int64)).shape == (0, 256)
    assert RL.gather_rows(table, cuda.to_device(np.zeros(0, np.int32))).shape == (0, 256)


def test_unaligned_input_falls_back_to_v1(rng):
    blocks = finite_blocks(rng, 3)
    flat = np.zeros(3 * 84 + 1, np.uint8)
    flat[1:] = blocks.ravel()
    view = cuda.to_device(flat)[1:].reshape(3, 84)   # data 1 byte past an aligned allocation
    out = poisoned(3)
    assert RL.pick("q2k", None, view, out).name == NAIVE
    compare(RL.decode_rows(view, out).copy_to_host(), rows_reference(blocks))
    assert FAST
    for version in FAST:
        with pytest.raises(ValueError, match="aligned"):
            RL.decode_rows(view, version=version)


def _rows_ctx(encoding="q2k", *, aligned=True, simulator=False):
    return {"encoding": encoding, "aligned": aligned, "simulator": simulator}


def test_default_rules():
    """q2k_v3 for aligned input and output, q2k_v1 otherwise (in the simulator and on a GPU);
    the launcher picks the same record."""
    for simulator in (False, True):
        assert registry.default("rows", _rows_ctx(aligned=True, simulator=simulator)).name == "q2k_v3"
        assert registry.default("rows", _rows_ctx(aligned=False, simulator=simulator)).name == "q2k_v1"
    assert RL.pick("q2k", None).name == "q2k_v3"                      # no arrays: taken as aligned
    raw, out = cuda.to_device(np.zeros((2, 84), np.uint8)), poisoned(2)
    assert RL.pick("q2k", None, raw, out).name == "q2k_v3"
    assert RL.prepare_decode(raw, out).name == "q2k_v3"
    assert RL.pick("q2k", "q2k_v2").name == "q2k_v2"


def test_default_rules_partition_the_contexts():
    """Exactly one record claims every context (registry.default raises otherwise), and every
    record with a default rule is the default somewhere."""
    claimed = set()
    for encoding in ENCODINGS:
        for T in (1, 2, 33, 128, 4096, 5000):
            for aligned in (True, False):
                for simulator in (True, False):
                    ctx = dict(_rows_ctx(encoding, aligned=aligned, simulator=simulator), T=T)
                    rec = registry.default("rows", ctx)
                    assert rec.encoding == encoding
                    claimed.add(rec.name)
    assert claimed == {r.name for r in registry.records("rows") if r.default_rule is not None}


def test_launch_geometry_covers_rows():
    for n in (1, 31, 32, 33, 98_304, 1_000_003):
        blocks, threads = registry.get("rows", NAIVE).geometry(n)
        assert blocks * threads >= n * 256 > (blocks - 1) * threads   # a thread per value
        for version in FAST:
            blocks, threads = registry.get("rows", version).geometry(n)
            rows_per_block = threads // 8 * (D.ROWS_PER_GROUP_V4 if version == "q2k_v4" else 1)
            assert blocks * rows_per_block >= n > (blocks - 1) * rows_per_block   # 8 lanes a row


# ---- argument validation ------------------------------------------------------------------------

def test_dequant_argument_validation(rng):
    blocks = finite_blocks(rng, 4)
    dev = cuda.to_device(blocks)
    with pytest.raises(TypeError, match="raw is a host numpy array"):
        RL.decode_rows(blocks)
    with pytest.raises(TypeError, match="raw must be a device array"):
        RL.decode_rows([[0] * 84])
    with pytest.raises(TypeError, match="raw must be uint8"):
        RL.decode_rows(cuda.to_device(blocks.astype(np.int8)))
    with pytest.raises(ValueError, match=r"raw must be uint8 \[n, 84\], got shape \(4, 83\)"):
        RL.decode_rows(cuda.to_device(blocks[:, :83].copy()))
    with pytest.raises(ValueError, match="raw must be C-contiguous"):
        RL.decode_rows(cuda.to_device(np.zeros((4, 168), np.uint8))[:, ::2])
    with pytest.raises(TypeError, match=r"out must be uint16"):
        RL.decode_rows(dev, cuda.to_device(np.zeros((4, 256), np.float32)))
    with pytest.raises(ValueError, match=r"out has 5 rows, the input gives 4"):
        RL.decode_rows(dev, poisoned(5))
    with pytest.raises(ValueError, match=r"out must be uint16 \[n, 256\]"):
        RL.decode_rows(dev, cuda.to_device(np.zeros((4, 128), np.uint16)))
    with pytest.raises(TypeError, match="out is a host numpy array"):
        RL.decode_rows(dev, np.zeros((4, 256), np.uint16))
    with pytest.raises(ValueError, match=r"no rows kernel version 7; versions are \["):
        RL.decode_rows(dev, version=7)
    with pytest.raises(ValueError, match=r"unknown table encoding 'q9'"):
        RL.decode_rows(dev, encoding="q9")
    # versions are record names; the old spellings ("v1", 1) are refused
    for v in ("v1", 1):
        with pytest.raises(ValueError, match=r"no rows kernel version .*; versions are \["):
            RL.decode_rows(dev, version=v)
    compare(RL.decode_rows(dev, version="q2k_v1").copy_to_host(), rows_reference(blocks))


def test_gather_argument_validation(rng):
    table = cuda.to_device(finite_blocks(rng, 5))
    ids = np.array([0, 4, 2], np.int64)
    with pytest.raises(TypeError, match="table is a host numpy array"):
        RL.gather_rows(finite_blocks(rng, 5), ids)
    with pytest.raises(ValueError, match=r"table must be uint8 \[n, 84\]"):
        RL.gather_rows(cuda.to_device(np.zeros((5, 80), np.uint8)), ids)
    with pytest.raises(TypeError, match="row_ids must be an integer array"):
        RL.gather_rows(table, ids.astype(np.float32))
    with pytest.raises(TypeError, match=r"row_ids must be 1-D"):
        RL.gather_rows(table, ids.reshape(3, 1))
    with pytest.raises(TypeError, match="row_ids must be int32 or int64, got uint32"):
        RL.gather_rows(table, cuda.to_device(ids.astype(np.uint32)))
    with pytest.raises(TypeError, match=r"row_ids must be 1-D, int32 or int64 \[n\]"):
        RL.gather_rows(table, cuda.to_device(ids.reshape(3, 1)))
    with pytest.raises(ValueError, match="row_ids must be C-contiguous"):
        RL.gather_rows(table, cuda.to_device(np.arange(6, dtype=np.int64) % 5)[::2])
    with pytest.raises(ValueError, match="out has 2 rows, the input gives 3"):
        RL.gather_rows(table, ids, poisoned(2))
    with pytest.raises(ValueError, match=r"bad_count must be uint32 \[1\]"):
        RL.gather_rows(table, ids, bad_count=cuda.to_device(np.zeros(2, np.uint32)))
    with pytest.raises(ValueError, match=r"no rows kernel version 0; versions are \["):
        RL.gather_rows(table, ids, version=0)
    # argument validation runs before the host ids' range check
    with pytest.raises(ValueError, match="out has 2 rows"):
        RL.gather_rows(table, np.array([0, 9, 1]), poisoned(2))
    with pytest.raises(ValueError, match=r"no rows kernel version 'v9'; versions are \["):
        RL.gather_rows(table, np.array([0, 9, 1]), version="v9")


# ---- GPU tier -----------------------------------------------------------------------------------

TOKENS = (1, 7, 128, 4096)
COLS = 24
TABLE_ROWS = 262_144    # 22 MB of Q2_K; ids are drawn fresh for every check


@pytest.fixture(scope="module")
def gpu_table():
    rng = np.random.default_rng(20240601)
    table = finite_blocks(rng, TABLE_ROWS)
    ref = np.concatenate([rows_reference(table[i:i + 32768]) for i in range(0, TABLE_ROWS, 32768)])
    return table, ref, cuda.to_device(table)


def _record(test, shape, version, n_bad, **extra):
    entry = dict(test=test, shape=shape, version=version, max_err="exact" if n_bad == 0 else f"{n_bad} words",
                 passed=n_bad == 0, **extra)
    RESULTS.append(entry)
    print(entry)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [t * COLS for t in TOKENS] + [1, 31, 1_000_003])
def test_gpu_dequant_released_and_odd_shapes(gpu_table, rng, n):
    table, ref_table, _ = gpu_table
    ids = rng.integers(0, TABLE_ROWS, n)
    blocks = cuda.to_device(table[ids])
    ref = ref_table[ids]
    for version in VERSIONS:
        out = poisoned(n)
        RL.decode_rows(blocks, out, version=version)
        _record("dequant", [n, 256], version, compare(out.copy_to_host(), ref))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [t * COLS for t in TOKENS] + [1, 31, 1_000_003])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_gpu_gather_released_and_odd_shapes(gpu_table, rng, n, id_dtype):
    table, ref_table, dev_table = gpu_table
    for version in VERSIONS:
        ids = rng.integers(0, TABLE_ROWS, n).astype(id_dtype)   # fresh ids for every version
        ids[-1] = TABLE_ROWS - 1
        out = poisoned(n)
        RL.gather_rows(dev_table, cuda.to_device(ids), out, version=version)
        _record(f"gather[{np.dtype(id_dtype).name}]", [n, 256], version,
                compare(out.copy_to_host(), ref_table[ids]))


@pytest.mark.gpu
def test_gpu_random_bytes(rng):
    blocks = random_byte_blocks(rng, 4096)
    ref = rows_reference(blocks)
    for version in VERSIONS:
        got = RL.decode_rows(cuda.to_device(blocks), poisoned(4096), version=version).copy_to_host()
        _record("dequant[random bytes, NaN payload free]", [4096, 256], version,
                compare(got, ref, allow_nan_payload=True))


@pytest.mark.gpu
def test_gpu_gather_beyond_2gib(rng):
    """Row ids whose byte offsets pass 2^31 and 2^32: the address arithmetic must be 64-bit."""
    rows = (2**32 + 2**20) // 84                # a 4.1 GB table, mostly left uninitialised
    dev = cuda.device_array((rows, 84), np.uint8)
    picks = np.array([0, 2**31 // 84 - 1, 2**31 // 84, 2**31 // 84 + 1, 2**32 // 84, rows - 1], np.int64)
    blocks = finite_blocks(rng, picks.size)
    for i, r in enumerate(picks):
        dev[r:r + 1].copy_to_device(blocks[i:i + 1])
    ids = np.repeat(picks, 5)
    rng.shuffle(ids)
    ref = rows_reference(blocks)[np.searchsorted(picks, ids)]
    for version in VERSIONS:
        for id_dtype in (np.int32, np.int64):
            out = poisoned(ids.size)
            RL.gather_rows(dev, cuda.to_device(ids.astype(id_dtype)), out, version=version)
            _record(f"gather>4GiB[{np.dtype(id_dtype).name}]", [ids.size, 256], version,
                    compare(out.copy_to_host(), ref))
    del dev


@pytest.mark.gpu
@pytest.mark.parametrize("version", VERSIONS)
def test_gpu_bad_device_ids(gpu_table, rng, version):
    _, ref_table, dev_table = gpu_table
    ids = rng.integers(0, TABLE_ROWS, 3000).astype(np.int64)
    ids[[10, 2000]] = [TABLE_ROWS, -7]
    with pytest.raises(ValueError, match=rf"row id {TABLE_ROWS} at index 10 .*\(2 out-of-range ids\)"):
        RL.gather_rows(dev_table, cuda.to_device(ids), poisoned(3000), version=version)
    out = poisoned(3000)
    counter = cuda.to_device(np.zeros(1, np.uint32))
    RL.gather_rows(dev_table, cuda.to_device(ids), out, version=version, bad_count=counter)
    got = out.copy_to_host()
    ok = int(counter.copy_to_host()[0]) == 2 and (got[[10, 2000]] == NAN_ROW).all()
    good = np.setdiff1d(np.arange(3000), [10, 2000])
    _record("gather[bad ids]", [3000, 256], version, compare(got[good], ref_table[ids[good]]) + (not ok))
    assert ok, "bad ids must give NaN rows and a count of 2"
