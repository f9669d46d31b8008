"""q2k_r, the Q2_K wkv re-laid out for the GEMV: the numpy repack is a byte permutation with an exact
inverse, the device repack writes the same bytes, the device decode (the GEMV's own decode path)
gives the file's bf16 weights bit for bit, and the two-layer launch equals two single launches.

Inputs are fresh random Q2_K blocks (random bytes, finite random fp16 d and dmin of both signs) at
odd shapes: N not a multiple of the 16-row tile, K/256 odd (a zero pad block in the last unit).
"""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from engram_numba.stages.proj import cuda_gemv_q2kr as C
from engram_numba.stages.proj import launch as P
from engram_numba.stages.proj import reference as R
from engram_numba.stages.proj.q2k_r import (UNIT_BYTES, q2k_r_shape, repack_q2k_r, unpack_q2k_r,
                                            wkv_q2k_r_bf16)
from engram_numba.stages.proj.tests.test_proj_quant import POISON, random_q2k, random_x

SHAPES = [(1, 256), (5, 768), (16, 512), (37, 1280), (33, 6144)]


@pytest.mark.parametrize("N,K", SHAPES)
def test_numpy_repack_round_trip(rng, N, K):
    raw = random_q2k(rng, N, K)
    packed = repack_q2k_r(raw, K)
    assert packed.shape == q2k_r_shape(N, K) and packed.dtype == np.uint8
    np.testing.assert_array_equal(unpack_q2k_r(packed, N, K), raw)
    np.testing.assert_array_equal(wkv_q2k_r_bf16(packed, N, K), R.wkv_q2k_bf16(raw, K))
    # a permutation: the padded bytes are zeros, every byte of raw is somewhere once
    if N % 16 == 0 and K % 512 == 0:
        assert packed.nbytes == raw.nbytes
    assert np.array_equal(np.bincount(packed.ravel(), minlength=256) - np.bincount(raw.ravel(), minlength=256),
                          np.eye(256, dtype=np.int64)[0] * (packed.size - raw.size))


def test_layout_puts_each_lane_where_the_doc_says(rng):
    """Spot the three planes of unit 0 of tile 0 against the file's bytes (lane 6: g = 1, t = 2)."""
    N, K = 16, 512
    raw = random_q2k(rng, N, K)
    u = repack_q2k_r(raw, K)[0, :UNIT_BYTES]
    lane, g, n, h = 6, 1, 1, 0
    for b in range(2):
        for p in range(2):
            row, k = g + 8 * p, b * 2 + p
            blk = raw[row, b * 84:(b + 1) * 84]
            chunk = (b * 2 + p) * 32 + lane
            np.testing.assert_array_equal(u[16 * chunk:16 * chunk + 16], blk[16 + 32 * n + 16 * h:][:16])
            sc = u[2048 + 16 * lane + 4 * k:][:4]
            np.testing.assert_array_equal(sc, blk[[8 * n + h, 8 * n + h + 2, 8 * n + h + 4, 8 * n + h + 6]])
            np.testing.assert_array_equal(u[2560 + 16 * g + 4 * k:][:4], blk[80:84])


def test_unpack_refuses_wrong_shapes():
    with pytest.raises(ValueError, match="q2k_r weight of N = 17"):
        unpack_q2k_r(np.zeros((1, 2688), np.uint8), 17, 512)
    with pytest.raises(ValueError, match="uint8 \\[N, 84\\]"):
        repack_q2k_r(np.zeros((3, 85), np.uint8), 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        repack_q2k_r(np.zeros((3, 84), np.uint8), 100)


def test_device_repack_and_decode_every_tile(rng):
    """Device repack == numpy repack byte for byte; the device decode of it == the file's decode."""
    N, K = 21, 768
    raw = random_q2k(rng, N, K)
    packed = C.repack_on_device(cuda.to_device(raw), N, K)
    np.testing.assert_array_equal(packed.copy_to_host(), repack_q2k_r(raw, K))
    out = cuda.to_device(np.full((N, K), POISON, np.uint16))
    P.prepare_wkv_to_bf16(packed, None, out, weight="q2k_r")()
    np.testing.assert_array_equal(out.copy_to_host(), R.wkv_q2k_bf16(raw, K))


def test_device_repack_refuses_bad_arguments(rng):
    raw = cuda.to_device(random_q2k(rng, 5, 256))
    ok = cuda.device_array(q2k_r_shape(5, 256), np.uint8)
    before = ok.copy_to_host()
    with pytest.raises(ValueError, match="raw must be"):
        C.prepare_repack(raw, ok, 6, 256)
    with pytest.raises(ValueError, match="packed must be"):
        C.prepare_repack(raw, cuda.device_array((1, 2000), np.uint8), 5, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        C.prepare_repack(raw, ok, 5, 200)
    np.testing.assert_array_equal(ok.copy_to_host(), before)


def test_project_q_refuses_bad_q2k_r(rng):
    x = cuda.to_device(random_x(rng, 1, 512))
    w = cuda.to_device(repack_q2k_r(random_q2k(rng, 20, 512), 512))
    with pytest.raises(ValueError, match="pass out"):
        P.prepare_project_q(x, w, weight="q2k_r")
    with pytest.raises(ValueError, match="q2k_r bytes for N = 40"):
        P.prepare_project_q(x, w, out=cuda.device_array((1, 40), np.uint16), weight="q2k_r")
    with pytest.raises(ValueError, match="wkv_raw must be \\[N, K/256\\*84\\]"):
        P.prepare_project_q(x, w, out=cuda.device_array((1, 20), np.uint16), weight="q2k", version="gemv_q2k_v4")
    assert P.pick(1, 512, 20, weight="q2k_r").name == "gemv_q2k_v4"


def test_prmt_and_umulhi_twins():
    """The helpers behind gemv_q2k_v7's picks, against their PTX definitions: prmt's nibbles pick
    bytes of the pair (b above a), bit 3 replicates the picked byte's sign; mul.hi.u32."""
    from engram_numba.stages.proj.cuda_bits import prmt, umulhi
    a, b = 0x8C3B2A19, 0x7F6E5D4C                      # bytes 0..7: 19 2A 3B 8C 4C 5D 6E 7F
    assert prmt(a, b, 0x7654) == b and prmt(a, b, 0x3210) == a
    assert prmt(a, b, 0x0473) == 0x194C7F8C
    assert prmt(a, b, 0x8B38) == 0x00FF8C00           # nibble 8: byte 0 (0x19) sign 0; B: byte 3 sign 1
    assert umulhi(0xFFFFFFFF, 0xFFFFFFFF) == 0xFFFFFFFE and umulhi(0x03020100, 0x220000) == 0x6644
    # pick4p's selectors: byte i of v * 0x22 + SEL_LO_ADD (values 0, 1) and of mul.hi(v, SEL_HI_MUL)
    # (values 2, 3) is 2q | (2q + 1) << 4 for every code q, v = codes | SEL_BIAS
    assert C.SEL_BIAS & 0x03030303 == 0
    for codes in range(256):
        q = [(codes >> (2 * i)) & 3 for i in range(4)]
        v = np.uint32(sum(qi << (8 * i) for i, qi in enumerate(q)) | C.SEL_BIAS)
        sel = [2 * qi | (2 * qi + 1) << 4 for qi in q]
        assert (int(v) * 0x22 + C.SEL_LO_ADD) & 0xFFFF == sel[0] | sel[1] << 8
        assert umulhi(v, C.SEL_HI_MUL) & 0xFFFF == sel[2] | sel[3] << 8


def test_v7_tables_and_picks_equal_v4s(rng):
    """gemv_q2k_v7's decode gives v4's bf16 values for every code of every scale byte, on d/dmin
    draws that include zeros of both signs: the same weights, only fewer instructions."""
    from engram_numba.stages.proj.cuda_gemv_q2k import lut_rounded, pick4
    ds = [np.float32(v) for v in (0.0, -0.0, 1.0, -3.5e-3, 6.1e-5, 65504.0)]
    ds += [np.float32(v) for v in rng.standard_normal(6) * 0.01]
    word = np.uint32(0b11100100_10010011_01001110_00111001)      # every code in every byte position
    for sc in range(256):
        for d, dmin in zip(ds, ds[::-1]):
            lo, hi = lut_rounded(np.uint32(sc), d, dmin)
            n = np.uint32(sc << 8)                                     # the scale byte as byte 1
            p01, p23 = C.lut_pairs(C.nibble_f32(n & np.uint32(0x0F0F0F0F), 1, C.NIB_MAGIC),
                                   C.nibble_f32((n >> np.uint32(4)) & np.uint32(0x0F0F0F0F), 1, C.NIB_MAGIC), d, dmin)
            for shift in (0, 2, 4, 6):
                assert C.pick4p(p01, p23, word, shift, C.SEL_BIAS) == pick4(lo, hi, word, shift), (sc, d, dmin, shift)


def test_v9_tables_equal_v7s(rng):
    """gemv_q2k_v9's table (y3 as one fma of the exact 3*s) gives v7's pair words for every scale
    byte, on d/dmin draws that include zeros of both signs, the fp16 extremes and subnormals."""
    ds = [np.float32(v) for v in (0.0, -0.0, 1.0, -3.5e-3, 6.1e-5, -5.96e-8, 65504.0, -65504.0)]
    ds += [np.float32(v) for v in rng.standard_normal(8) * 0.01]
    for sc in range(256):
        lo, hi = np.float32(sc & 15), np.float32(sc >> 4)
        for d, dmin in list(zip(ds, ds[::-1])) + list(zip(ds, ds[3:] + ds[:3])):
            assert C.lut_pairs9(lo, hi, d, dmin) == C.lut_pairs(lo, hi, d, dmin), (sc, d, dmin)

@pytest.mark.slow
def test_v7_is_v4_bit_for_bit(rng):
    """Same stream, values and summation order: v7's kv equals v4's bit for bit (a pad block,
    rows past N, tokens past T)."""
    T, K, N = 3, 768, 13
    raw = repack_q2k_r(random_q2k(rng, N, K), K)
    x = cuda.to_device(random_x(rng, T, K))
    outs = {}
    for v in ("gemv_q2k_v4", "gemv_q2k_v7"):
        outs[v] = cuda.to_device(np.full((T, N), POISON, np.uint16))
        P.project_q(x, cuda.to_device(raw), None, outs[v], weight="q2k_r", version=v)
    np.testing.assert_array_equal(outs["gemv_q2k_v7"].copy_to_host(), outs["gemv_q2k_v4"].copy_to_host())


def test_v8_grid_is_persistent():
    """gemv_q2k_v8 launches at most SMs x blocks-an-SM blocks (2 in the simulator) whatever the
    number of items, and never more blocks than items; its two-layer launch is one pool."""
    assert C.v8_grid(1, 25600) == 2 and C.v8_grid(1, 16) == 1 and C.v8_grid(9, 16, nlayers=2) == 2
    assert C.launch_config("gemv_q2k_v8", 3, 40) == ((2,), C.V8_TEAM * 32)
    assert C.launch_config("gemv_q2k_v8", 1, 40, nlayers=2) == ((2,), C.V8_PAIR_SHAPE[0] * 32)
    with pytest.raises(ValueError, match="team of 1, 2, 3 or 6"):
        C._make_gemv8(4, 3, 1)


def test_q2k_r_defaults_v12_at_few_tokens_on_a_gpu_only():
    """The measured split: v12 at 1..8 tokens on a GPU (and so the decode graph's two-layer launch,
    with its own shape), v4 at more tokens and everywhere in the simulator."""
    from engram_numba.stages import registry
    from engram_numba.stages.proj.records import Q2KR_FEW_MAX_TOKENS
    ctx = dict(K=6144, N=25600, aligned=True, weight="q2k_r", cc=(9, 0))
    for T in (1, 2, 4, Q2KR_FEW_MAX_TOKENS):
        assert registry.default("proj", dict(ctx, T=T, simulator=False)).name == "gemv_q2k_v12"
    for T, sim in ((Q2KR_FEW_MAX_TOKENS + 1, False), (16, False), (1, True), (8, True)):
        assert registry.default("proj", dict(ctx, T=T, simulator=sim)).name == "gemv_q2k_v4"
    assert C.V12_PAIR_SHAPE[0] == C.V12_SHAPE[0]      # one block shape: launch_config serves both launches
    assert C.PAIR_KERNELS["gemv_q2k_v12"] is not C.KERNELS["gemv_q2k_v12"]


def _two_layers_by_v4(rng, N, K, T):
    """Two layers' q2k_r weights, their x on the device and the kv gemv_q2k_v4 gives each alone."""
    raws = [repack_q2k_r(random_q2k(rng, N, K), K) for _ in range(2)]
    xs = [cuda.to_device(random_x(rng, T, K)) for _ in range(2)]
    want = []
    for i in range(2):
        o = cuda.to_device(np.full((T, N), POISON, np.uint16))
        P.project_q(xs[i], cuda.to_device(raws[i]), None, o, weight="q2k_r", version="gemv_q2k_v4")
        want.append(o.copy_to_host())
    return raws, xs, want


@pytest.fixture(scope="module")
def two_layers_20x512():
    """The two v8 tests' inputs and v4's kv on them (N = 20: 2 tiles, K = 512, T = 1), computed once:
    a simulated v4 launch is seconds of the module's time."""
    N, K, T = 20, 512, 1
    return (N, K, T) + _two_layers_by_v4(np.random.default_rng(20261202), N, K, T)


@pytest.mark.slow
def test_v8_is_v4_bit_for_bit_single_and_paired(two_layers_20x512):
    """v8 (persistent blocks, each taking several items; the cp.async ring across items) gives v4's
    kv bit for bit, alone and as one two-layer pool: 2 tiles x 2 layers over 2 blocks, a pad block,
    rows past N, shares with no unit."""
    N, K, T, raws, xs, want = two_layers_20x512
    single = cuda.to_device(np.full((T, N), POISON, np.uint16))
    P.project_q(xs[0], cuda.to_device(raws[0]), None, single, weight="q2k_r", version="gemv_q2k_v8")
    np.testing.assert_array_equal(single.copy_to_host(), want[0])
    outs = [cuda.to_device(np.full((T, N), POISON, np.uint16)) for _ in range(2)]
    launch = C.prepare_pair("gemv_q2k_v8", xs[0], xs[1], cuda.to_device(np.concatenate(raws)), outs[0], outs[1])
    assert launch.grid == (2,)
    launch()
    for i in range(2):
        np.testing.assert_array_equal(outs[i].copy_to_host(), want[i])


@pytest.mark.slow
@pytest.mark.parametrize("team,stages", [(3, 2)])      # team 2 takes the same shared-memory path
def test_v8_teams_are_v4_bit_for_bit(two_layers_20x512, team, stages):
    """The shapes the H200 sweep times (tools/q2kr_v8_variants.py): blocks of 2 or 3 warps that add
    their shares' fragments through shared memory (two buffers, one barrier an item) give v4's
    bits too: the two-layer pool, 2 tiles x 2 layers over 2 blocks (two items a block)."""
    from engram_numba.device.launch import PreparedLaunch
    from engram_numba.stages.proj.cuda_common import flat_u32
    N, K, T, raws, xs, want = two_layers_20x512
    _, pair = C._make_gemv8(team, stages, 1)
    outs = [cuda.to_device(np.full((T, N), POISON, np.uint16)) for _ in range(2)]
    both = cuda.to_device(np.concatenate(raws))
    PreparedLaunch("v8 team", pair, (C.v8_grid(T, N, 2),), team * 32, 0,
                   (flat_u32(xs[0]), flat_u32(xs[1]), both.reshape(both.size).view(np.uint32), outs[0], outs[1],
                    T, K), tuple(outs))()
    for i in range(2):
        np.testing.assert_array_equal(outs[i].copy_to_host(), want[i])



@pytest.fixture(scope="module")
def v4_kv():
    """(x and w on the device, gemv_q2k_v4's kv) at an (N, K, T), made once for the module's tests
    of that shape: a simulated v4 launch is seconds, and every version is compared with the same one.
    Inputs seeded from the shape, whichever test asks first."""
    import zlib
    made = {}

    def get(N, K, T):
        if (N, K, T) not in made:
            rng = np.random.default_rng(zlib.crc32(repr(("v4_kv", N, K, T)).encode()))
            w = cuda.to_device(repack_q2k_r(random_q2k(rng, N, K), K))
            x = cuda.to_device(random_x(rng, T, K))
            want = cuda.to_device(np.full((T, N), POISON, np.uint16))
            P.project_q(x, w, None, want, weight="q2k_r", version="gemv_q2k_v4")
            made[N, K, T] = x, w, want.copy_to_host()
        return made[N, K, T]
    return get


@pytest.mark.slow
def test_v9_is_v4_bit_for_bit(v4_kv):
    """v9 (one item a block of 2 warps, 3 shares each through a 2-slot cp.async ring, the shares
    summed after one barrier) gives v4's kv bit for bit: K/256 = 13 is 7 units in 2-unit shares,
    so warp 0 sums shares 0..2 and warp 1 has unit 6 (with the zero pad block) in share 3 and two
    empty shares; rows past N, tokens past T."""
    N, K, T = 13, 3328, 2
    x, w, want = v4_kv(N, K, T)
    got = cuda.to_device(np.full((T, N), POISON, np.uint16))
    P.project_q(x, w, None, got, weight="q2k_r", version="gemv_q2k_v9")
    np.testing.assert_array_equal(got.copy_to_host(), want)


@pytest.mark.parametrize("version", ["gemv_q2k_v9", "gemv_q2k_v10", "gemv_q2k_v11", "gemv_q2k_v12"])
def test_v9_v10_two_layer_launch_equals_its_single_launches(rng, version):
    """The two-layer launch (layer on grid z, layer b at its offset in the pair buffer; v9's and
    v10's each with its own shape) gives each layer the bits of the version's launch on it alone
    (which are v4's: test_v9_is_v4_bit_for_bit, test_v10_is_v4_bit_for_bit)."""
    team = {"gemv_q2k_v9": C.V9_TEAM, "gemv_q2k_v10": C.V10_SHAPE[0], "gemv_q2k_v11": C.V11_SHAPE[0],
            "gemv_q2k_v12": C.V12_SHAPE[0]}[version]
    N, K, T = 5, 256, 1
    raws = [repack_q2k_r(random_q2k(rng, N, K), K) for _ in range(2)]
    xs = [cuda.to_device(random_x(rng, T, K)) for _ in range(2)]
    want = []
    for i in range(2):
        o = cuda.to_device(np.full((T, N), POISON, np.uint16))
        P.project_q(xs[i], cuda.to_device(raws[i]), None, o, weight="q2k_r", version=version)
        want.append(o.copy_to_host())
    assert not np.array_equal(want[0], want[1])
    outs = [cuda.to_device(np.full((T, N), POISON, np.uint16)) for _ in range(2)]
    launch = C.prepare_pair(version, xs[0], xs[1], cuda.to_device(np.concatenate(raws)), outs[0], outs[1])
    assert launch.grid == (1, 1, 2) and launch.block == team * 32
    launch()
    for i in range(2):
        np.testing.assert_array_equal(outs[i].copy_to_host(), want[i])


def test_v9_shape_is_checked():
    """v9's factory refuses a team that does not split 6 shares, and more blocks an SM than the
    shared memory holds; the registered shape fits."""
    assert C.V9_BLOCKS_PER_SM * (C.v9_shared_bytes(C.V9_TEAM, C.V9_STAGES) + 1024) <= C.SM_SHARED_BYTES
    assert C.launch_config("gemv_q2k_v9", 9, 40) == ((3, 2), C.V9_TEAM * 32)
    with pytest.raises(ValueError, match="team of 1, 2, 3 or 6"):
        C._make_gemv9(4, 2, 1)
    with pytest.raises(ValueError, match="shared memory an SM"):
        C._make_gemv9(2, 2, 17)


def _factory_is_v4(v4_kv, version, shape):
    """`version` (registered, shape None) or `_make_gemv10(*shape)` on one 64-thread block against
    v4's kv at N, K, T = 13, 3328, 2 (K/256 = 13: a pad block, warp 1 with one unit and empty
    shares; rows past N, tokens past T), every output."""
    from engram_numba.device.launch import PreparedLaunch
    from engram_numba.stages.proj.cuda_common import flat_u32
    N, K, T = 13, 3328, 2
    x, w, want = v4_kv(N, K, T)
    got = cuda.to_device(np.full((T, N), POISON, np.uint16))
    if shape is None:
        P.project_q(x, w, None, got, weight="q2k_r", version=version)
    else:
        gemv, _ = C._make_gemv10(*shape)
        PreparedLaunch(f"{version}{shape}", gemv, (1, 1), 64, 0, (flat_u32(x), flat_u32(w), got, T, K), got)()
    np.testing.assert_array_equal(got.copy_to_host(), want)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [None,                              # the registered gemv_q2k_v10
                                   (2, 2, 14, False, False, False),   # v9's decode order and ring
                                   (2, 3, 10, True, True, True)])     # 3 slots, early, split
def test_v10_is_v4_bit_for_bit(v4_kv, shape):
    """v10 (v9's blocks; sub-blocks decoded in pairs, their mma alternating between the two chains;
    the early ring; split copies, each lane waiting for its own groups) gives v4's kv bit for bit:
    K/256 = 13 (a pad block, warp 1 with one unit and two empty shares), rows past N, tokens past T.
    The simulator lands a copy only at its wait, so a missing or short wait reads a stale slot."""
    _factory_is_v4(v4_kv, "gemv_q2k_v10", shape)


def test_v11_is_v4_bit_for_bit(rng):
    """v11 (v10 with its tables built by exact fma on 2^23 + nibble) gives v4's kv bit for bit: K/256
    = 3 (a pad block), rows past N, tokens past T, d and dmin finite of both signs (random_q2k), so
    every scale and offset nibble 0..15 meets both signs."""
    N, K, T = 13, 768, 2
    w = cuda.to_device(repack_q2k_r(random_q2k(rng, N, K), K))
    x = cuda.to_device(random_x(rng, T, K))
    outs = {}
    for v in ("gemv_q2k_v4", "gemv_q2k_v11"):
        outs[v] = cuda.to_device(np.full((T, N), POISON, np.uint16))
        P.project_q(x, w, None, outs[v], weight="q2k_r", version=v)
    np.testing.assert_array_equal(outs["gemv_q2k_v11"].copy_to_host(), outs["gemv_q2k_v4"].copy_to_host())


@pytest.mark.parametrize("shape", [(2, 2, 14, True, True, True, True, True),     # v11, d/dmin copied once
                                   (2, 3, 10, True, True, False, True, True)])   # 3 slots, one group a unit
def test_v11_dd_once_is_v4_bit_for_bit(v4_kv, shape):
    """v11 with each unit's d/dmin plane copied once by lanes 0..7 and read by every lane of its g
    after a warp barrier (the simulator lands a copy only at its copier's wait: a missing barrier
    reads a stale slot): v4's kv bit for bit over 3 units through the ring (K/256 = 6), rows past N,
    tokens past T."""
    from engram_numba.device.launch import PreparedLaunch
    from engram_numba.stages.proj.cuda_common import flat_u32
    N, K, T = 13, 1536, 2
    x, w, want = v4_kv(N, K, T)
    got = cuda.to_device(np.full((T, N), POISON, np.uint16))
    gemv, _ = C._make_gemv10(*shape)
    PreparedLaunch(f"v11{shape}", gemv, (1, 1), 64, 0, (flat_u32(x), flat_u32(w), got, T, K), got)()
    np.testing.assert_array_equal(got.copy_to_host(), want)


# d / dmin values the table tests meet: both signs, zero of both signs, an fp16 subnormal, the largest fp16
D_EDGES = np.array([0.0, -0.0, 6e-8, -6e-8, 1e-3, -0.0371, 1.0, 3.14159, -65504.0, 65504.0, 2.5e-5],
                   np.float16).astype(np.float32)


def test_v11_table_is_v9s_table():
    """lut_pairs11 (scale = fma(d, 2^23 + sc, -d*2^23), -offset = fma(-dmin, 2^23 + m, dmin*2^23))
    gives lut_pairs9's pair words for every nibble pair and d, dmin of both signs, subnormal, zero
    and the largest fp16, up to the sign of a zero entry (which adds a zero product to the kv sum)."""
    ds = D_EDGES
    two23 = np.float32(C.TWO23)
    for d in ds:
        for dmin in ds:
            for sc in range(16):
                for m in range(16):
                    want = C.lut_pairs9(np.float32(sc), np.float32(m), d, dmin)
                    got = C.lut_pairs11(two23 + np.float32(sc), two23 + np.float32(m), d, np.float32(d * -two23),
                                        np.float32(-dmin), np.float32(dmin * two23))
                    for a, b in zip(got, want):
                        a, b = int(a), int(b)
                        for sh in (0, 16):
                            ha, hb = (a >> sh) & 0xFFFF, (b >> sh) & 0xFFFF
                            assert ha == hb or (ha & 0x7FFF) == (hb & 0x7FFF) == 0, (d, dmin, sc, m)


def test_v12_table_is_v11s_table():
    """lut_pairs12 (entry 0 = -dmin*m itself) gives lut_pairs11's pair words bit for bit, zeros'
    signs included, for every nibble pair and d, dmin of both signs, subnormal, zero and the largest
    fp16: fma(0, d*sc, -dmin*m) is -dmin*m because that fma sum is never -0."""
    ds = D_EDGES
    two23 = np.float32(C.TWO23)
    for d in ds:
        for dmin in ds:
            for sc in range(16):
                for m in range(16):
                    args = (two23 + np.float32(sc), two23 + np.float32(m), d, np.float32(d * -two23),
                            np.float32(-dmin), np.float32(dmin * two23))
                    assert [int(v) for v in C.lut_pairs12(*args)] == [int(v) for v in C.lut_pairs11(*args)], \
                        (d, dmin, sc, m)


@pytest.mark.parametrize("shape", [None,                                                       # registered v12
                                   pytest.param((2, 2, 14, True, True, False, False, True, True, True),
                                                marks=pytest.mark.slow),                       # one group a unit
                                   pytest.param((2, 3, 10, True, True, True, False, True, True, True),
                                                marks=pytest.mark.slow)])                      # the pair shape
def test_v12_is_v4_bit_for_bit(v4_kv, shape):
    """v12 (v11 with entry 0 = -dmin*m and the ring's copies as zero fills where there is nothing to
    copy, no branch) gives v4's kv bit for bit: K/256 = 13 (a pad block; warp 1 with one unit and
    empty jobs, whose zero-filled copies must not be read), rows past N, tokens past T."""
    _factory_is_v4(v4_kv, "gemv_q2k_v12", shape)


def test_v12_zero_fill_needs_dd_once():
    """The branch-free copies copy the d/dmin plane once (lanes 0..7): the factory says so."""
    with pytest.raises(ValueError, match="dd_once"):
        C._make_gemv10(2, 2, 14, True, True, True, False, False, True, True)


def test_v10_shape_is_checked():
    """v10's factory refuses what v9's does; both registered shapes fit an SM's shared memory and
    share one block size (launch_config serves both launches)."""
    for team, stages, per_sm, *_ in (C.V10_SHAPE, C.V10_PAIR_SHAPE):
        assert per_sm * (C.v10_shared_bytes(team, stages) + 1024) <= C.SM_SHARED_BYTES
    assert C.V10_PAIR_SHAPE[0] == C.V10_SHAPE[0]
    assert C.launch_config("gemv_q2k_v10", 9, 40) == ((3, 2), C.V10_SHAPE[0] * 32)
    assert C.PAIR_KERNELS["gemv_q2k_v10"] is not C.KERNELS["gemv_q2k_v10"]
    with pytest.raises(ValueError, match="team of 1, 2, 3 or 6"):
        C._make_gemv10(4, 2, 1)
    with pytest.raises(ValueError, match="shared memory an SM"):
        C._make_gemv10(2, 2, 17)
    with pytest.raises(ValueError, match="need the early ring"):
        C._make_gemv10(2, 2, 14, True, False, True)
    with pytest.raises(ValueError, match="needs the early ring"):
        C._make_gemv10(2, 2, 14, True, False, False, True, True)


@pytest.mark.slow
def test_two_layer_launch_equals_the_single_launches(rng):
    """One launch over both layers' weights: layer b (found at an offset into the pair buffer) gets
    the bits its own launch gives, layer a (offset 0, the single launch's code) its yardstick."""
    from engram_numba.bf16 import bf16_ulp_distance
    N, K, T = 13, 768, 2
    raws = [random_q2k(rng, N, K) for _ in range(2)]
    xh = [random_x(rng, T, K) for _ in range(2)]
    xs = [cuda.to_device(x) for x in xh]
    pair = cuda.to_device(np.concatenate([repack_q2k_r(r, K) for r in raws]))
    outs = [cuda.to_device(np.full((T, N), POISON, np.uint16)) for _ in range(2)]
    C.prepare_pair("gemv_q2k_v4", xs[0], xs[1], pair, outs[0], outs[1])()
    single = cuda.to_device(np.full((T, N), POISON, np.uint16))
    P.project_q(xs[1], cuda.to_device(repack_q2k_r(raws[1], K)), None, single, weight="q2k_r", version="gemv_q2k_v4")
    np.testing.assert_array_equal(outs[1].copy_to_host(), single.copy_to_host())
    ref = R.projection_exact(xh[0], R.wkv_q2k_bf16(raws[0], K))
    assert bf16_ulp_distance(outs[0].copy_to_host(), ref).max() <= 1
    with pytest.raises(ValueError, match="wkv_pair must be"):
        C.prepare_pair("gemv_q2k_v4", xs[0], xs[1], cuda.to_device(repack_q2k_r(raws[0], K)), outs[0], outs[1])


# ---- GPU tier: the released shape, every tile ------------------------------------------------------

@pytest.mark.gpu
def test_gpu_repack_and_decode_released_every_tile(gpu_record):
    """At N = 25600, K = 6144: the device repack writes the numpy reference's bytes, and the q2k_r
    decode (the GEMV's decode path) equals the file-layout Q2_K decode (the rows stage's decoder)
    on every weight of every tile."""
    import time
    rng = np.random.default_rng(20260612)
    N, K = 25600, 6144
    raw = random_q2k(rng, N, K)
    d_raw = cuda.to_device(raw)
    t0 = time.perf_counter()
    packed = C.repack_on_device(d_raw, N, K)
    cuda.synchronize()
    repack_s = time.perf_counter() - t0
    same_bytes = bool(np.array_equal(packed.copy_to_host(), repack_q2k_r(raw, K)))
    a = cuda.to_device(np.full((N, K), POISON, np.uint16))
    b = cuda.to_device(np.full((N, K), POISON, np.uint16))
    P.prepare_wkv_to_bf16(packed, None, a, weight="q2k_r")()
    P.prepare_wkv_to_bf16(d_raw, None, b, weight="q2k")()
    got, want = a.copy_to_host(), b.copy_to_host()
    differ = int((got != want).sum())
    gpu_record(test="q2k_r repack + decode, released shape", shape=[N, K], repack_bytes_equal=same_bytes,
               weights_differing=differ, weights=N * K, repack_ms=round(repack_s * 1e3, 2),
               passed=same_bytes and differ == 0)
    assert same_bytes
    assert differ == 0


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,N", [(1, 6144, 25600), (4, 6144, 25600), (8, 6144, 25600),
                                   (9, 1536, 5),        # 2 token groups, warps with no unit (GPU: skipped)
                                   (3, 768, 13),        # a pad block (GPU: skipped), rows past N
                                   (2, 6656, 40)])      # 13 units over 6 warps x 2: the clamped loads
def test_gpu_v7_is_v4_bit_for_bit(rng, gpu_record, T, K, N):
    """On the GPU v7 takes its own paths (unconditional x loads, warp-uniform skips) where the
    simulator runs v4's zero fill: its kv must still be v4's, bit for bit, single and paired."""
    raw = repack_q2k_r(random_q2k(rng, N, K), K)
    xh = random_x(rng, T, K)
    x, w = cuda.to_device(xh), cuda.to_device(raw)
    outs = {}
    for v in ("gemv_q2k_v4", "gemv_q2k_v7"):
        outs[v] = cuda.to_device(np.full((T, N), POISON, np.uint16))
        P.project_q(x, w, None, outs[v], weight="q2k_r", version=v)
    got, want = outs["gemv_q2k_v7"].copy_to_host(), outs["gemv_q2k_v4"].copy_to_host()
    pa, pb = (cuda.to_device(np.full((T, N), POISON, np.uint16)) for _ in range(2))
    C.prepare_pair("gemv_q2k_v7", x, x, cuda.to_device(np.concatenate([raw, raw])), pa, pb)()
    differ = int((got != want).sum())
    pair_same = bool(np.array_equal(pa.copy_to_host(), got) and np.array_equal(pb.copy_to_host(), got))
    gpu_record(test="gemv_q2k_v7 vs gemv_q2k_v4 bits", shape=[T, K, N], outputs_differing=differ,
               pair_equals_single=pair_same, passed=differ == 0 and pair_same)
    assert differ == 0 and pair_same


def _gpu_against_v4(rng, gpu_record, version, T, K, N, **extra):
    """`version` against gemv_q2k_v4 on every output at T x K x N, alone and as the two-layer launch
    (each layer against v4 on that layer alone); the counts go to the gpu results."""
    raw, raw_b = (C.repack_on_device(cuda.to_device(random_q2k(rng, N, K)), N, K) for _ in range(2))
    x, xb = (cuda.to_device(random_x(rng, T, K)) for _ in range(2))
    want = []
    for xi, wi in ((x, raw), (xb, raw_b)):
        o = cuda.to_device(np.full((T, N), POISON, np.uint16))
        P.project_q(xi, wi, None, o, weight="q2k_r", version="gemv_q2k_v4")
        want.append(o.copy_to_host())
    single = cuda.to_device(np.full((T, N), POISON, np.uint16))
    P.project_q(x, raw, None, single, weight="q2k_r", version=version)
    got = single.copy_to_host()
    pa, pb = (cuda.to_device(np.full((T, N), POISON, np.uint16)) for _ in range(2))
    both = cuda.to_device(np.concatenate([raw.copy_to_host(), raw_b.copy_to_host()]))
    C.prepare_pair(version, x, xb, both, pa, pb)()
    differ = int((got != want[0]).sum())
    pair_differ = int((pa.copy_to_host() != want[0]).sum() + (pb.copy_to_host() != want[1]).sum())
    gpu_record(test=f"{version} vs gemv_q2k_v4 bits", shape=[T, K, N], outputs_differing=differ,
               pair_outputs_differing=pair_differ, **extra, passed=differ == 0 and pair_differ == 0)
    assert differ == 0 and pair_differ == 0


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,N", [(1, 6144, 25600), (4, 6144, 25600), (8, 6144, 25600),
                                   (16, 6144, 25600),   # 2 token groups: 3200 items, a second round
                                   (9, 1536, 5),        # shares with no unit (GPU: skipped)
                                   (3, 768, 13),        # a pad block (GPU: skipped), rows past N
                                   (2, 6656, 40)])      # 13 units: 4-unit shares, two of them empty
def test_gpu_v8_is_v4_bit_for_bit(rng, gpu_record, T, K, N):
    """gemv_q2k_v8 (persistent grid, cp.async ring, v7's decode and skips) against v4 on every
    output, alone and in the two-layer pool (whose items interleave both layers in each block)."""
    _gpu_against_v4(rng, gpu_record, "gemv_q2k_v8", T, K, N, grid=C.v8_grid(T, N))


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,N", [(1, 6144, 25600), (4, 6144, 25600), (8, 6144, 25600),
                                   (16, 6144, 25600),   # 2 token groups
                                   (9, 1536, 5),        # 3 units: warp 1 has none (GPU: skipped)
                                   (3, 768, 13),        # a pad block (GPU: skipped), rows past N
                                   (2, 6656, 40)])      # 13 units: 4-unit shares, some of them empty
def test_gpu_v9_is_v4_bit_for_bit(rng, gpu_record, T, K, N):
    """gemv_q2k_v9 (one item a block of 2 warps, static cp.async ring, warp-uniform skips) against
    v4 on every output, alone and as the two-layer launch."""
    _gpu_against_v4(rng, gpu_record, "gemv_q2k_v9", T, K, N)


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,N", [(1, 6144, 25600), (4, 6144, 25600), (8, 6144, 25600),
                                   (16, 6144, 25600),   # 2 token groups
                                   (9, 1536, 5),        # 3 units: warp 1 has none (GPU: skipped)
                                   (3, 768, 13),        # a pad block (GPU: skipped), rows past N
                                   (2, 6656, 40)])      # 13 units: 4-unit shares, some of them empty
def test_gpu_v10_is_v4_bit_for_bit(rng, gpu_record, T, K, N):
    """gemv_q2k_v10 (v9 with paired sub-blocks, alternating mma chains) against v4 on every output,
    alone and as the two-layer launch."""
    _gpu_against_v4(rng, gpu_record, "gemv_q2k_v10", T, K, N)


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,N", [(1, 6144, 25600), (4, 6144, 25600), (8, 6144, 25600),
                                   (16, 6144, 25600),   # 2 token groups
                                   (9, 1536, 5),        # 3 units: warp 1 has none (GPU: skipped)
                                   (3, 768, 13),        # a pad block (GPU: skipped), rows past N
                                   (2, 6656, 40)])      # 13 units: 4-unit shares, some of them empty
def test_gpu_v11_is_v4_bit_for_bit(rng, gpu_record, T, K, N):
    """gemv_q2k_v11 (v10 with fma-built tables) against v4 on every output, alone and as the
    two-layer launch."""
    _gpu_against_v4(rng, gpu_record, "gemv_q2k_v11", T, K, N)


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,N", [(1, 6144, 25600), (4, 6144, 25600), (8, 6144, 25600),
                                   (16, 6144, 25600),   # 2 token groups
                                   (9, 1536, 5),        # 3 units: warp 1 has none (zero-filled copies)
                                   (3, 768, 13),        # a pad block, rows past N
                                   (2, 6656, 40)])      # 13 units: 4-unit shares, some of them empty
def test_gpu_v12_is_v4_bit_for_bit(rng, gpu_record, T, K, N):
    """gemv_q2k_v12 (v11 with entry 0 = -dmin*m and branch-free ring copies) against v4 on every
    output, alone and as the two-layer launch."""
    _gpu_against_v4(rng, gpu_record, "gemv_q2k_v12", T, K, N)
