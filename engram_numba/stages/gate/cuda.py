"""Gate and highway update (docs/math.md, section 6) on the GPU: the last stage of an Engram layer.

For token t and stream c, over d in 0..dim-1, all in fp32:

    h = highway[t, c, :]    k = key[t, c, :]    w = q_weight[c, :] * k_weight[c, :]
    dot  = sum(h*w*k) * rsqrt(mean(h*h) + eps) * rsqrt(mean(k*k) + eps) / sqrt(dim)
    gate = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot))        (0 for a masked token)
    highway[t, c, :] = h + gate * value[t, :]                     (in place)

Data (T tokens):
    highway   [T, hc, dim] fp32, C-contiguous, updated in place
    kv        [T, (hc+1)*dim] bf16 words (uint16): key of stream c at columns c*dim..(c+1)*dim,
              the value shared by all streams at hc*dim..(hc+1)*dim (the projection's output)
    w         [hc, dim] fp32, q_weight * k_weight, multiplied once by the caller
    token_mask [T] uint8 (or bool), optional: 0 = masked token, its streams are not written
    dot_out, gate_out [T, hc] fp32, optional: the normalised dot and the gate of every (t, c)

Everything except the three reductions follows `engram_numba.stages.gate.reference.gate_reference`
operation by operation (`(h*w)*k`, `1/sqrt(mean + eps)`, `((hk*inv_h)*inv_k)/sqrt(dim)`, the
sigmoid in float64 rounded once, and an unfused `h + (gate*v)`), so the only difference from
the reference is the order of the three fp32 sums: v1, which sums in the reference's order,
is bit-identical to it (dot, gate and highway).

The stage is pure bandwidth: at T=4096, dim 5120, hc 4 it moves 880 MB (highway read and
written, 2 x 335 MB; keys 168 MB; value 42 MB) for ~130 MFLOP, so the floor is ~210 us at the
H200's ~4.2 TB/s.

Kernel versions (never delete v1):
    v1  naive: one thread per (t, c), sequential loops over d with unfused fp32 ops; bit-exact
        with the numpy reference (the same summation order): a second reference.
    v2  one block per token (all hc streams, the value row read once per token) or per (t, c);
        the three sums in one pass of 16-byte loads (fp32 highway as uint32x4, keys as 8 bf16
        in one uint32x4), warp shuffles then one shared-memory step, then an update pass that
        re-reads h (L1/L2 hits) and writes with 16-byte stores.
    v3  v2 with each thread's h values held in registers between the two passes (the kernel is
        specialised on the nch chunks each thread owns and written out unrolled), so h is read
        once; every load (h, w, key and value) is issued before the block reduction, in
        straight-line code. One block per (t, c) by default.

    v3 pair  (`gate_v3_pair`, launched by `launch.prepare_gate_pair`): two layers' gates on one
        highway in one launch, v3's arithmetic for each, bit-identical to two gate_v3 launches
        in sequence (the one-token decode's two engram layers; see the comment above the kernel).
    v4  few tokens: each (t, c) row over S blocks (one chunk of 8 a thread), partial sums to
        global, the last block to arrive sums them in a fixed order and publishes the gate;
        blocks with higher indices, holding h and the value already, wait for it and store.
        No grid-wide barrier, no cooperative launch, nothing to reset between launches (a graph
        replays it as is). Its pair (`gate_v4_pair`) adds a middle role: bit-identical to two
        gate_v4 launches. See the comment above `_make_v4`.

v2, v3 and v4 are compiled per residual (the fp32 path carries no rounding code), v3 also per nch.

The launcher is `launch.prepare_gate` / `launch.run_gate` (the highway is updated in place); the
default rules, kernels and argument types are in records.py; `launch_config` says what a launch will
use, `prepare` (the stage's one launcher) builds it from a record.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, types

from ...config import GATE_CLAMP, MAX_HC, NORM_EPS
from ...device.devarray import data_address
from ...device.intrinsics import (SIMULATOR, add_rn, bf16_bits_to_f32, bf16x2_hi, bf16x2_lo, device_function,
                                  f32_as_u32, load_u32x4, mul_rn, round_to_bf16, store_u32x4, u32_as_f32, warp_sum)
from ...device.launch import NoLaunch, PreparedLaunch

LAYOUTS = ("token", "stream")   # one block per token (all hc streams) / one block per (t, c)

MAX_THREADS = 512               # the fast kernels' largest block
MAX_WARPS = MAX_THREADS // 32
V1_THREADS = 128
V3_MAX_CHUNKS = 8               # more chunks per thread than this would not fit in registers

_CLAMP = np.float32(GATE_CLAMP)
_NEG_ZERO = np.float32(-0.0)    # the identity of IEEE addition: -0 + x == x, even for x = -0
_ONE = np.float32(1.0)


# ---- device helpers shared by every version ------------------------------------------------

@device_function
def _gate_scalars(hk, hh, kk, dim, eps, live):
    """dot and gate of one (t, c) from its three sums, in the reference's operation order.

    math.sqrt compiles to sqrt.rn and `/` to div.rn (no fastmath), both correctly rounded like
    numpy; the simulator's math.* run in float64 and are rounded back to fp32 at once. The
    sigmoid runs in float64 and is rounded once, as the reference does: that is the correctly
    rounded fp32 sigmoid (but for a ~2^-29 chance), so the gate does not carry libdevice expf's
    ulps. One double exp per (t, c) costs nothing here."""
    f32 = np.float32
    dim32 = f32(dim)
    inv_h = _ONE / f32(math.sqrt(f32(f32(hh / dim32) + eps)))
    inv_k = _ONE / f32(math.sqrt(f32(f32(kk / dim32) + eps)))
    dot = f32(mul_rn(mul_rn(hk, inv_h), inv_k) / f32(math.sqrt(dim32)))
    a = abs(dot)
    if a < _CLAMP:          # max(|dot|, 1e-6) that keeps a NaN, like np.maximum
        a = _CLAMP
    g = f32(math.copysign(f32(math.sqrt(a)), dot))
    gate = f32(1.0 / (1.0 + math.exp(-np.float64(g))))
    if not live:
        gate = f32(0.0)
    return dot, gate


@device_function
def _h_value(word, residual_bf16):
    """h from its fp32 bits; for the bf16 residual, first rounded to bf16 (a select, no branch;
    the fast kernels pass a compile-time constant, so the fp32 path carries no rounding code)."""
    x = u32_as_f32(word)
    return round_to_bf16(x) if residual_bf16 else x


@device_function
def _new_h_word(h, gate, v, residual_bf16):
    """h + gate*v as the reference rounds it (product, then sum; optional bf16), as a word."""
    y = add_rn(h, mul_rn(gate, v))
    if residual_bf16:
        y = round_to_bf16(y)
    return f32_as_u32(y)


@device_function
def _chunk_sums(h0, h1, h2, h3, h4, h5, h6, h7, wa, wb, kq):
    """Partial sums (h*w)*k, h*h, k*k over one chunk of 8 elements.

    h0..h7: fp32 values of h (already bf16-rounded for that residual); wa, wb: two uint32x4
    tuples with the bits of w; kq: one uint32x4 tuple of 4 bf16x2 words of the key. The adds
    may fuse with the multiplies (FMA): the sums' order differs from the reference anyway."""
    k0 = bf16x2_lo(kq[0])
    k1 = bf16x2_hi(kq[0])
    k2 = bf16x2_lo(kq[1])
    k3 = bf16x2_hi(kq[1])
    k4 = bf16x2_lo(kq[2])
    k5 = bf16x2_hi(kq[2])
    k6 = bf16x2_lo(kq[3])
    k7 = bf16x2_hi(kq[3])
    hk = (h0 * u32_as_f32(wa[0])) * k0
    hk += (h1 * u32_as_f32(wa[1])) * k1
    hk += (h2 * u32_as_f32(wa[2])) * k2
    hk += (h3 * u32_as_f32(wa[3])) * k3
    hk += (h4 * u32_as_f32(wb[0])) * k4
    hk += (h5 * u32_as_f32(wb[1])) * k5
    hk += (h6 * u32_as_f32(wb[2])) * k6
    hk += (h7 * u32_as_f32(wb[3])) * k7
    hh = h0 * h0
    hh += h1 * h1
    hh += h2 * h2
    hh += h3 * h3
    hh += h4 * h4
    hh += h5 * h5
    hh += h6 * h6
    hh += h7 * h7
    kk = k0 * k0
    kk += k1 * k1
    kk += k2 * k2
    kk += k3 * k3
    kk += k4 * k4
    kk += k5 * k5
    kk += k6 * k6
    kk += k7 * k7
    return hk, hh, kk


@device_function
def _block_sums(s_hk, s_hh, s_kk, scratch, partial, tid, tps):
    """Sum each thread's partials over the tps threads of its stream (tps a multiple of 32).

    Every thread of the block must call this together. Returns the three totals to every
    thread of the stream, summed over its warps in a fixed order."""
    r_hk = warp_sum(s_hk, scratch)
    r_hh = warp_sum(s_hh, scratch)
    r_kk = warp_sum(s_kk, scratch)
    warp = tid // 32
    if tid % 32 == 0:
        partial[warp, 0] = r_hk
        partial[warp, 1] = r_hh
        partial[warp, 2] = r_kk
    cuda.syncthreads()
    wps = tps // 32
    w0 = (tid // tps) * wps
    hk = partial[w0, 0]
    hh = partial[w0, 1]
    kk = partial[w0, 2]
    for i in range(1, wps):
        hk += partial[w0 + i, 0]
        hh += partial[w0 + i, 1]
        kk += partial[w0 + i, 2]
    return hk, hh, kk


# ---- v1: naive, one thread per (t, c) ----------------------------------------------------------

@cuda.jit
def gate_v1(highway, kv, w, mask, dot_out, gate_out, has_mask, residual_bf16, has_dot, has_gate, eps):
    # highway [T, hc, dim] f32 (in place); kv [T, (hc+1)*dim] u16; w [hc, dim] f32; mask [T] u8
    # dot_out, gate_out [T, hc] f32 (or [1, 1] stand-ins when not wanted)
    T, hc, dim = highway.shape
    i = cuda.grid(1)
    if i >= T * hc:
        return
    t = i // hc
    c = i - t * hc
    live = True
    if has_mask != 0:
        live = mask[t] != 0
    if not live and has_dot == 0:
        if has_gate != 0:
            gate_out[t, c] = np.float32(0.0)
        return
    rb = residual_bf16 != 0
    # np.cumsum's order: start from element 0 (not from +0, which would lose a -0 sum), then
    # add left to right, every product and sum rounded on its own.
    h = _h_value(f32_as_u32(highway[t, c, 0]), rb)
    k = bf16_bits_to_f32(kv[t, c * dim])
    hk = mul_rn(mul_rn(h, w[c, 0]), k)
    hh = mul_rn(h, h)
    kk = mul_rn(k, k)
    for d in range(1, dim):
        h = _h_value(f32_as_u32(highway[t, c, d]), rb)
        k = bf16_bits_to_f32(kv[t, c * dim + d])
        hk = add_rn(hk, mul_rn(mul_rn(h, w[c, d]), k))
        hh = add_rn(hh, mul_rn(h, h))
        kk = add_rn(kk, mul_rn(k, k))
    dot, gate = _gate_scalars(hk, hh, kk, dim, eps, live)
    if has_dot != 0:
        dot_out[t, c] = dot
    if has_gate != 0:
        gate_out[t, c] = gate
    if not live:
        return
    vbase = hc * dim
    for d in range(dim):
        h = _h_value(f32_as_u32(highway[t, c, d]), rb)
        highway[t, c, d] = u32_as_f32(_new_h_word(h, gate, bf16_bits_to_f32(kv[t, vbase + d]), rb))


# ---- v2: block-wide reductions with 16-byte loads, h re-read in the update pass ---------------

def _make_v2(residual_bf16: bool):
    RB = bool(residual_bf16)    # frozen into the kernel as a constant

    def gate_v2(hw, kvw, ww, mask, dot_out, gate_out, hc, dim, tps, has_mask, has_dot, has_gate, eps):
        # hw  [T*hc*dim] u32: the fp32 highway's bits, updated in place
        # kvw [T*(hc+1)*dim/2] u32: bf16x2 words of kv;  ww [hc*dim] u32: the bits of w
        # Block b covers token t = b // (hc/spb) and spb streams (spb = blockDim/tps: hc or 1);
        # tps threads per stream walk its dim/8 chunks of 8 elements with stride tps.
        scratch = cuda.shared.array(MAX_THREADS, np.float32)    # warp_sum's simulator twin only
        partial = cuda.shared.array((MAX_WARPS, 3), np.float32)
        tid = cuda.threadIdx.x
        spb = cuda.blockDim.x // tps
        nsb = hc // spb
        t = cuda.blockIdx.x // nsb
        c = (cuda.blockIdx.x - t * nsb) * spb + tid // tps
        ls = tid % tps
        live = True
        if has_mask != 0:
            live = mask[t] != 0
        if not live and has_dot == 0:
            if ls == 0 and has_gate != 0:
                gate_out[t, c] = np.float32(0.0)
            return              # the whole block returns: no barrier is left waiting
        chunks = dim // 8
        h16 = (t * hc + c) * (dim // 4)           # uint32x4 index of h's first 4 values
        k16 = (t * (hc + 1) + c) * (dim // 8)     # uint32x4 index of the key's first 8 values
        w16 = c * (dim // 4)
        s_hk = _NEG_ZERO
        s_hh = _NEG_ZERO
        s_kk = _NEG_ZERO
        j = ls
        while j < chunks:
            ha = load_u32x4(hw, h16 + 2 * j)
            hb = load_u32x4(hw, h16 + 2 * j + 1)
            wa = load_u32x4(ww, w16 + 2 * j)
            wb = load_u32x4(ww, w16 + 2 * j + 1)
            kq = load_u32x4(kvw, k16 + j)
            p_hk, p_hh, p_kk = _chunk_sums(
                _h_value(ha[0], RB), _h_value(ha[1], RB), _h_value(ha[2], RB), _h_value(ha[3], RB),
                _h_value(hb[0], RB), _h_value(hb[1], RB), _h_value(hb[2], RB), _h_value(hb[3], RB),
                wa, wb, kq)
            s_hk += p_hk
            s_hh += p_hh
            s_kk += p_kk
            j += tps
        hk, hh, kk = _block_sums(s_hk, s_hh, s_kk, scratch, partial, tid, tps)
        dot, gate = _gate_scalars(hk, hh, kk, dim, eps, live)
        if ls == 0:
            if has_dot != 0:
                dot_out[t, c] = dot
            if has_gate != 0:
                gate_out[t, c] = gate
        if not live:
            return
        v16 = (t * (hc + 1) + hc) * (dim // 8)
        j = ls
        while j < chunks:
            vq = load_u32x4(kvw, v16 + j)
            ha = load_u32x4(hw, h16 + 2 * j)
            hb = load_u32x4(hw, h16 + 2 * j + 1)
            store_u32x4(hw, h16 + 2 * j,
                        _new_h_word(_h_value(ha[0], RB), gate, bf16x2_lo(vq[0]), RB),
                        _new_h_word(_h_value(ha[1], RB), gate, bf16x2_hi(vq[0]), RB),
                        _new_h_word(_h_value(ha[2], RB), gate, bf16x2_lo(vq[1]), RB),
                        _new_h_word(_h_value(ha[3], RB), gate, bf16x2_hi(vq[1]), RB))
            store_u32x4(hw, h16 + 2 * j + 1,
                        _new_h_word(_h_value(hb[0], RB), gate, bf16x2_lo(vq[2]), RB),
                        _new_h_word(_h_value(hb[1], RB), gate, bf16x2_hi(vq[2]), RB),
                        _new_h_word(_h_value(hb[2], RB), gate, bf16x2_lo(vq[3]), RB),
                        _new_h_word(_h_value(hb[3], RB), gate, bf16x2_hi(vq[3]), RB))
            j += tps

    name = f"gate_v2_{'bf16' if RB else 'fp32'}"
    gate_v2.__name__ = gate_v2.__qualname__ = name
    return cuda.jit(gate_v2)


# ---- v3: v2 with h kept in registers (specialised on chunks per thread) ----------------------
#
# A thread owns chunks ls + i*tps for i < NCH. Its 8*NCH h values must live in registers across
# the block reduction, which needs every index known at compile time: a loop over i with a
# local array did not unroll for NCH = 5 (ptxas: 160-byte stack, local loads). So each chunk's
# loads and partial sums are one device function returning its values as a tuple (SSA values,
# registers), the kernel calls it once per chunk under `if NCH > i` (NCH is a constant of the
# closure: numba prunes the dead branches), and the stores follow the same pattern. Loads use a
# clamped chunk index (always in bounds) and out-of-range chunks add -0 (a select, not a
# branch), so the first pass is straight-line code and all its loads can be in flight at once;
# only the stores are guarded. The value is loaded with h and k, before the block reduction: it
# does not depend on the gate, and issuing it early takes a DRAM round trip off the critical
# path (a store to hw might alias kvw as far as the compiler knows, so it would not hoist it
# past the stores itself).

@device_function
def _v3_load(hw, ww, kvw, h16, k16, w16, v16, j, chunks, residual_bf16):
    """Chunk j's loads and partial sums -> (in range, clamped index, its 8 h values, its value
    words, hk, hh, kk); the partial sums are -0 for a chunk past the end."""
    ok = j < chunks
    jj = min(j, chunks - 1)
    ha = load_u32x4(hw, h16 + 2 * jj)
    hb = load_u32x4(hw, h16 + 2 * jj + 1)
    wa = load_u32x4(ww, w16 + 2 * jj)
    wb = load_u32x4(ww, w16 + 2 * jj + 1)
    kq = load_u32x4(kvw, k16 + jj)
    vq = load_u32x4(kvw, v16 + jj)
    h = (_h_value(ha[0], residual_bf16), _h_value(ha[1], residual_bf16), _h_value(ha[2], residual_bf16),
         _h_value(ha[3], residual_bf16), _h_value(hb[0], residual_bf16), _h_value(hb[1], residual_bf16),
         _h_value(hb[2], residual_bf16), _h_value(hb[3], residual_bf16))
    p_hk, p_hh, p_kk = _chunk_sums(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], wa, wb, kq)
    if not ok:
        p_hk = _NEG_ZERO
        p_hh = _NEG_ZERO
        p_kk = _NEG_ZERO
    return ok, jj, h, vq, p_hk, p_hh, p_kk


@device_function
def _v3_store(hw, h16, ok, jj, h, vq, gate, residual_bf16):
    """The updated 8 values of one chunk (h + gate * v), when the chunk is in range."""
    if ok:
        store_u32x4(hw, h16 + 2 * jj,
                    _new_h_word(h[0], gate, bf16x2_lo(vq[0]), residual_bf16),
                    _new_h_word(h[1], gate, bf16x2_hi(vq[0]), residual_bf16),
                    _new_h_word(h[2], gate, bf16x2_lo(vq[1]), residual_bf16),
                    _new_h_word(h[3], gate, bf16x2_hi(vq[1]), residual_bf16))
        store_u32x4(hw, h16 + 2 * jj + 1,
                    _new_h_word(h[4], gate, bf16x2_lo(vq[2]), residual_bf16),
                    _new_h_word(h[5], gate, bf16x2_hi(vq[2]), residual_bf16),
                    _new_h_word(h[6], gate, bf16x2_lo(vq[3]), residual_bf16),
                    _new_h_word(h[7], gate, bf16x2_hi(vq[3]), residual_bf16))


def _make_v3(nch: int, residual_bf16: bool):
    """gate_v3 for NCH = nch chunks a thread (1..V3_MAX_CHUNKS) and one residual."""
    NCH = int(nch)
    RB = bool(residual_bf16)
    assert 1 <= NCH <= V3_MAX_CHUNKS == 8

    def gate_v3(hw, kvw, ww, mask, dot_out, gate_out, hc, dim, tps, has_mask, has_dot, has_gate, eps):
        # same arguments and block mapping as gate_v2
        scratch = cuda.shared.array(MAX_THREADS, np.float32)    # warp_sum's simulator twin only
        partial = cuda.shared.array((MAX_WARPS, 3), np.float32)
        tid = cuda.threadIdx.x
        spb = cuda.blockDim.x // tps
        nsb = hc // spb
        t = cuda.blockIdx.x // nsb
        c = (cuda.blockIdx.x - t * nsb) * spb + tid // tps
        ls = tid % tps
        live = True
        if has_mask != 0:
            live = mask[t] != 0
        if not live and has_dot == 0:
            if ls == 0 and has_gate != 0:
                gate_out[t, c] = np.float32(0.0)
            return              # the whole block returns: no barrier is left waiting
        chunks = dim // 8
        h16 = (t * hc + c) * (dim // 4)
        k16 = (t * (hc + 1) + c) * (dim // 8)
        w16 = c * (dim // 4)
        v16 = (t * (hc + 1) + hc) * (dim // 8)
        s_hk = _NEG_ZERO
        s_hh = _NEG_ZERO
        s_kk = _NEG_ZERO
        ok0, j0, h0, v0, a, b, d = _v3_load(hw, ww, kvw, h16, k16, w16, v16, ls, chunks, RB)
        s_hk += a
        s_hh += b
        s_kk += d
        if NCH > 1:
            ok1, j1, h1, v1, a, b, d = _v3_load(hw, ww, kvw, h16, k16, w16, v16, ls + tps, chunks, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 2:
            ok2, j2, h2, v2, a, b, d = _v3_load(hw, ww, kvw, h16, k16, w16, v16, ls + 2 * tps, chunks, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 3:
            ok3, j3, h3, v3, a, b, d = _v3_load(hw, ww, kvw, h16, k16, w16, v16, ls + 3 * tps, chunks, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 4:
            ok4, j4, h4, v4, a, b, d = _v3_load(hw, ww, kvw, h16, k16, w16, v16, ls + 4 * tps, chunks, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 5:
            ok5, j5, h5, v5, a, b, d = _v3_load(hw, ww, kvw, h16, k16, w16, v16, ls + 5 * tps, chunks, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 6:
            ok6, j6, h6, v6, a, b, d = _v3_load(hw, ww, kvw, h16, k16, w16, v16, ls + 6 * tps, chunks, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 7:
            ok7, j7, h7, v7, a, b, d = _v3_load(hw, ww, kvw, h16, k16, w16, v16, ls + 7 * tps, chunks, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        hk, hh, kk = _block_sums(s_hk, s_hh, s_kk, scratch, partial, tid, tps)
        dot, gate = _gate_scalars(hk, hh, kk, dim, eps, live)
        if ls == 0:
            if has_dot != 0:
                dot_out[t, c] = dot
            if has_gate != 0:
                gate_out[t, c] = gate
        if not live:
            return
        _v3_store(hw, h16, ok0, j0, h0, v0, gate, RB)
        if NCH > 1:
            _v3_store(hw, h16, ok1, j1, h1, v1, gate, RB)
        if NCH > 2:
            _v3_store(hw, h16, ok2, j2, h2, v2, gate, RB)
        if NCH > 3:
            _v3_store(hw, h16, ok3, j3, h3, v3, gate, RB)
        if NCH > 4:
            _v3_store(hw, h16, ok4, j4, h4, v4, gate, RB)
        if NCH > 5:
            _v3_store(hw, h16, ok5, j5, h5, v5, gate, RB)
        if NCH > 6:
            _v3_store(hw, h16, ok6, j6, h6, v6, gate, RB)
        if NCH > 7:
            _v3_store(hw, h16, ok7, j7, h7, v7, gate, RB)

    gate_v3.__name__ = gate_v3.__qualname__ = f"gate_v3_nch{NCH}_{'bf16' if RB else 'fp32'}"
    return cuda.jit(gate_v3)


# ---- the pair: two layers' gates in one launch (one-token decode) ------------------------------
#
# Decode runs the gates of both engram layers back to back on the same highway: layer b's dot of
# stream c reads only stream c's h after layer a's update, so one block can do both for its
# (t, c). The pair kernel is v3 twice in one block: the same chunk-to-thread map (the same tps
# and nch as the gate_v3 launch it replaces), the same per-chunk partial sums, warp sums and
# block sums, the same scalar and update arithmetic, so each layer's dot, gate and the highway
# are bit-identical to two gate_v3 launches in sequence. What changes is the traffic: h is read
# once and written once; both layers' keys, values and weights are loaded up front with h (none
# depends on a gate), so the second layer costs one more block reduction instead of a launch, a
# DRAM round trip for h and a graph node.
#
# Layer a's update is applied in registers as gate_v3 would store it (`_new_h_word`) and layer b
# reads those words through `_h_value`, exactly what it would read back from memory. A masked
# token updates nothing: layer b then sees the original words. Both block reductions use their
# own shared partials, so the second needs no extra barrier.

@device_function
def _pair_load(hw, wwa, wwb, kvwa, kvwb, h16, k16, w16, v16, j, chunks, residual_bf16):
    """Chunk j's loads for both layers and layer a's partial sums -> (in range, clamped index,
    its 8 h words, layer a's value words, layer b's weight words (two uint32x4), key and value
    words, hk, hh, kk of layer a); the partial sums are -0 for a chunk past the end."""
    ok = j < chunks
    jj = min(j, chunks - 1)
    ha = load_u32x4(hw, h16 + 2 * jj)
    hb = load_u32x4(hw, h16 + 2 * jj + 1)
    wa0 = load_u32x4(wwa, w16 + 2 * jj)
    wa1 = load_u32x4(wwa, w16 + 2 * jj + 1)
    wb0 = load_u32x4(wwb, w16 + 2 * jj)
    wb1 = load_u32x4(wwb, w16 + 2 * jj + 1)
    ka = load_u32x4(kvwa, k16 + jj)
    kb = load_u32x4(kvwb, k16 + jj)
    va = load_u32x4(kvwa, v16 + jj)
    vb = load_u32x4(kvwb, v16 + jj)
    x = (ha[0], ha[1], ha[2], ha[3], hb[0], hb[1], hb[2], hb[3])
    p_hk, p_hh, p_kk = _chunk_sums(
        _h_value(x[0], residual_bf16), _h_value(x[1], residual_bf16), _h_value(x[2], residual_bf16),
        _h_value(x[3], residual_bf16), _h_value(x[4], residual_bf16), _h_value(x[5], residual_bf16),
        _h_value(x[6], residual_bf16), _h_value(x[7], residual_bf16), wa0, wa1, ka)
    if not ok:
        p_hk = _NEG_ZERO
        p_hh = _NEG_ZERO
        p_kk = _NEG_ZERO
    return ok, jj, x, va, (wb0, wb1), kb, vb, p_hk, p_hh, p_kk


@device_function
def _pair_word(x, gate, v, live, residual_bf16):
    """One h word after layer a: as gate_v3 stores it for a live token, unchanged for a masked one."""
    y = _new_h_word(_h_value(x, residual_bf16), gate, v, residual_bf16)
    return y if live else x


@device_function
def _pair_mid(x, va, wb, kb, ok, gate, live, residual_bf16):
    """Layer a's update of one chunk (words x, value va, gate `gate`) and layer b's h values and
    partial sums on the result -> (8 h values of layer b, hk, hh, kk; -0 past the end)."""
    y = (_h_value(_pair_word(x[0], gate, bf16x2_lo(va[0]), live, residual_bf16), residual_bf16),
         _h_value(_pair_word(x[1], gate, bf16x2_hi(va[0]), live, residual_bf16), residual_bf16),
         _h_value(_pair_word(x[2], gate, bf16x2_lo(va[1]), live, residual_bf16), residual_bf16),
         _h_value(_pair_word(x[3], gate, bf16x2_hi(va[1]), live, residual_bf16), residual_bf16),
         _h_value(_pair_word(x[4], gate, bf16x2_lo(va[2]), live, residual_bf16), residual_bf16),
         _h_value(_pair_word(x[5], gate, bf16x2_hi(va[2]), live, residual_bf16), residual_bf16),
         _h_value(_pair_word(x[6], gate, bf16x2_lo(va[3]), live, residual_bf16), residual_bf16),
         _h_value(_pair_word(x[7], gate, bf16x2_hi(va[3]), live, residual_bf16), residual_bf16))
    p_hk, p_hh, p_kk = _chunk_sums(y[0], y[1], y[2], y[3], y[4], y[5], y[6], y[7], wb[0], wb[1], kb)
    if not ok:
        p_hk = _NEG_ZERO
        p_hh = _NEG_ZERO
        p_kk = _NEG_ZERO
    return y, p_hk, p_hh, p_kk


PAIR_DOT_A, PAIR_GATE_A, PAIR_DOT_B, PAIR_GATE_B = 1, 2, 4, 8     # the pair kernel's `outs` bits


def _make_pair(nch: int, residual_bf16: bool):
    """gate_v3's pair kernel (two layers in one launch) for NCH = nch chunks a thread and one residual."""
    NCH = int(nch)
    RB = bool(residual_bf16)
    assert 1 <= NCH <= V3_MAX_CHUNKS == 8

    def gate_v3_pair(hw, kvwa, kvwb, wwa, wwb, mask, dot_a, gate_a, dot_b, gate_b, hc, dim, tps, has_mask, outs,
                     eps):
        # gate_v3's arguments and block mapping with a second layer's kv and w; dot_a .. gate_b
        # [T, hc] (or [1, 1] stand-ins), written when their bit of `outs` is set (PAIR_*)
        scratch = cuda.shared.array(MAX_THREADS, np.float32)    # warp_sum's simulator twin only
        partial_a = cuda.shared.array((MAX_WARPS, 3), np.float32)
        partial_b = cuda.shared.array((MAX_WARPS, 3), np.float32)
        tid = cuda.threadIdx.x
        spb = cuda.blockDim.x // tps
        nsb = hc // spb
        t = cuda.blockIdx.x // nsb
        c = (cuda.blockIdx.x - t * nsb) * spb + tid // tps
        ls = tid % tps
        live = True
        if has_mask != 0:
            live = mask[t] != 0
        if not live and (outs & (PAIR_DOT_A | PAIR_DOT_B)) == 0:
            if ls == 0:
                if outs & PAIR_GATE_A:
                    gate_a[t, c] = np.float32(0.0)
                if outs & PAIR_GATE_B:
                    gate_b[t, c] = np.float32(0.0)
            return              # the whole block returns: no barrier is left waiting
        chunks = dim // 8
        h16 = (t * hc + c) * (dim // 4)
        k16 = (t * (hc + 1) + c) * (dim // 8)
        w16 = c * (dim // 4)
        v16 = (t * (hc + 1) + hc) * (dim // 8)
        s_hk = _NEG_ZERO
        s_hh = _NEG_ZERO
        s_kk = _NEG_ZERO
        ok0, j0, x0, va0, wb0, kb0, vb0, a, b, d = _pair_load(
            hw, wwa, wwb, kvwa, kvwb, h16, k16, w16, v16, ls, chunks, RB)
        s_hk += a
        s_hh += b
        s_kk += d
        if NCH > 1:
            ok1, j1, x1, va1, wb1, kb1, vb1, a, b, d = _pair_load(
                hw, wwa, wwb, kvwa, kvwb, h16, k16, w16, v16, ls + tps, chunks, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 2:
            ok2, j2, x2, va2, wb2, kb2, vb2, a, b, d = _pair_load(
                hw, wwa, wwb, kvwa, kvwb, h16, k16, w16, v16, ls + 2 * tps, chunks, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 3:
            ok3, j3, x3, va3, wb3, kb3, vb3, a, b, d = _pair_load(
                hw, wwa, wwb, kvwa, kvwb, h16, k16, w16, v16, ls + 3 * tps, chunks, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 4:
            ok4, j4, x4, va4, wb4, kb4, vb4, a, b, d = _pair_load(
                hw, wwa, wwb, kvwa, kvwb, h16, k16, w16, v16, ls + 4 * tps, chunks, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 5:
            ok5, j5, x5, va5, wb5, kb5, vb5, a, b, d = _pair_load(
                hw, wwa, wwb, kvwa, kvwb, h16, k16, w16, v16, ls + 5 * tps, chunks, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 6:
            ok6, j6, x6, va6, wb6, kb6, vb6, a, b, d = _pair_load(
                hw, wwa, wwb, kvwa, kvwb, h16, k16, w16, v16, ls + 6 * tps, chunks, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 7:
            ok7, j7, x7, va7, wb7, kb7, vb7, a, b, d = _pair_load(
                hw, wwa, wwb, kvwa, kvwb, h16, k16, w16, v16, ls + 7 * tps, chunks, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        hk, hh, kk = _block_sums(s_hk, s_hh, s_kk, scratch, partial_a, tid, tps)
        dot, gate = _gate_scalars(hk, hh, kk, dim, eps, live)
        if ls == 0:
            if outs & PAIR_DOT_A:
                dot_a[t, c] = dot
            if outs & PAIR_GATE_A:
                gate_a[t, c] = gate
        s_hk = _NEG_ZERO
        s_hh = _NEG_ZERO
        s_kk = _NEG_ZERO
        y0, a, b, d = _pair_mid(x0, va0, wb0, kb0, ok0, gate, live, RB)
        s_hk += a
        s_hh += b
        s_kk += d
        if NCH > 1:
            y1, a, b, d = _pair_mid(x1, va1, wb1, kb1, ok1, gate, live, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 2:
            y2, a, b, d = _pair_mid(x2, va2, wb2, kb2, ok2, gate, live, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 3:
            y3, a, b, d = _pair_mid(x3, va3, wb3, kb3, ok3, gate, live, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 4:
            y4, a, b, d = _pair_mid(x4, va4, wb4, kb4, ok4, gate, live, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 5:
            y5, a, b, d = _pair_mid(x5, va5, wb5, kb5, ok5, gate, live, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 6:
            y6, a, b, d = _pair_mid(x6, va6, wb6, kb6, ok6, gate, live, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        if NCH > 7:
            y7, a, b, d = _pair_mid(x7, va7, wb7, kb7, ok7, gate, live, RB)
            s_hk += a
            s_hh += b
            s_kk += d
        hk, hh, kk = _block_sums(s_hk, s_hh, s_kk, scratch, partial_b, tid, tps)
        dot, gate = _gate_scalars(hk, hh, kk, dim, eps, live)
        if ls == 0:
            if outs & PAIR_DOT_B:
                dot_b[t, c] = dot
            if outs & PAIR_GATE_B:
                gate_b[t, c] = gate
        if not live:
            return
        _v3_store(hw, h16, ok0, j0, y0, vb0, gate, RB)
        if NCH > 1:
            _v3_store(hw, h16, ok1, j1, y1, vb1, gate, RB)
        if NCH > 2:
            _v3_store(hw, h16, ok2, j2, y2, vb2, gate, RB)
        if NCH > 3:
            _v3_store(hw, h16, ok3, j3, y3, vb3, gate, RB)
        if NCH > 4:
            _v3_store(hw, h16, ok4, j4, y4, vb4, gate, RB)
        if NCH > 5:
            _v3_store(hw, h16, ok5, j5, y5, vb5, gate, RB)
        if NCH > 6:
            _v3_store(hw, h16, ok6, j6, y6, vb6, gate, RB)
        if NCH > 7:
            _v3_store(hw, h16, ok7, j7, y7, vb7, gate, RB)

    gate_v3_pair.__name__ = gate_v3_pair.__qualname__ = f"gate_v3_pair_nch{NCH}_{'bf16' if RB else 'fp32'}"
    return cuda.jit(gate_v3_pair)


# ---- v4: many blocks a row, for few tokens ---------------------------------------------------
#
# At one token gate_v3 is 4 blocks (one a (t, c) row) on 132 SMs: pure latency. v4 spreads each
# row over S blocks of B threads (one chunk of 8 elements a thread, so a block covers a slice of
# B chunks; S = ceil(chunks / B), dim 5120 -> 20 slices of 32 threads by default) and splits the
# work in roles by block index, so that a block only ever waits for blocks with a LOWER index:
#
#   reducers, blocks [0, R*S) (R = T*hc rows): load their slice of h, w and the key, sum it
#       (`_chunk_sums`, warp sums, warps in order), store the three partial sums, fence, and
#       count in on the row's arrival counter. The block that arrives last sums the S partials
#       in slice order (lane s holds slice s, then a warp sum: the same tree whichever block came
#       last, so the result is bitwise reproducible run to run), computes dot and gate as every
#       version does (`_gate_scalars`) and publishes the gate;
#   updaters, blocks [R*S, 2*R*S): load their slice of h and the value at once (before the gate
#       exists), then one thread waits for the row's gate and the block stores h + gate*v.
#
# No block waits for a block with a higher index, which the GPU dispatches no earlier than it
# (a 1-D grid goes out in index order) and which therefore has started or finished: the waits
# cannot deadlock, however few blocks are resident; and numba's simulator, which runs blocks one
# after another, finds every gate published before its updaters run. The launcher also keeps the
# grid small enough to be resident at once on the device (`V4_THREADS_PER_SM`), a second reason.
#
# Publishing without a reset: each row has 64-bit counters in a per-launch workspace (`sync`,
# zeroed once when the launch is prepared; `v4_timeouts` reads its wait-timeout counts) that only ever grow, by S a launch per role. A
# reducer's ticket (its arrival) old gives the launch's epoch old // S and whether it came last
# (old % S == S - 1); the gate goes out as one 64-bit word, (epoch + 1) << 32 | gate bits, so a
# waiter (whose own ticket on its role's counter gives the same epoch) reads tag and gate in one
# atomic. Nothing has to be reset between launches, so a captured graph replays as is. Partials
# are written with plain stores and a fence and read back with atomics (L2, not a stale L1).
#
# The pair (`gate_v4_pair`): three roles of R*S blocks: reducers of layer a (as above); middles,
# which load h, layer a's value and layer b's weight and key, wait for gate a, apply layer a's
# update in registers (`_pair_word`, what gate_v4 would store) and reduce layer b's slice on the
# result (the last of them publishes gate b); and updaters, which load h and both values, wait
# for both gates and store h after both updates. Every product, sum and rounding is the one two
# gate_v4 launches do, in the same order, so the pair is bit-identical to them.

V4_MAX_THREADS = 512            # threads a block (= chunks a slice)
V4_SYNC = 8                     # int64 words of `sync` a row
(V4_ARRIVE_A, V4_READY_A, V4_TICKET_U, V4_TICKET_M, V4_ARRIVE_B, V4_READY_B, V4_TIMEOUTS) = range(7)
V4_SPIN_LIMIT = 1 << 22         # polls (~seconds) before a wait gives up and counts sync[V4_TIMEOUTS]:
                                # a bug then shows as wrong bits and a count, not as a hung GPU
V4_TAG_MASK = 0x7FFFFFFF        # the epoch tag's bits in a published word (compared for equality)
# The launcher keeps grid * block <= SMs * V4_THREADS_PER_SM[kernel] and grid <= SMs * 16, which an
# SM holds at once with the registers the compile tier reports for sm_90a (gate_v4: 56 fp32 / 54
# bf16, so 1024 threads take 57,344 of 65,536; the pair: 74, allocated as 80, so 768 threads take
# 61,440).
V4_THREADS_PER_SM = {"single": 1024, "pair": 768}
V4_BLOCKS_PER_SM = 16


if SIMULATOR:
    def _v4_wait(sync, i, tag):
        """The word at sync[i] once its tag is `tag`. The simulator runs blocks in index order, so
        the word is there already (a wait for a later block would hang: raise instead)."""
        w = cuda.atomic.add(sync, i, 0)
        if (int(w) >> 32) != int(tag):
            raise RuntimeError(f"gate_v4: a block waited for sync[{i}] tag {tag}, found {int(w) >> 32}: "
                               "only blocks with a lower index may publish what a block waits for")
        return w
else:
    @cuda.jit(device=True)
    def _v4_wait(sync, i, tag):
        """Spin (one thread) until sync[i]'s tag is `tag`; returns the word (tag and gate bits).
        Past V4_SPIN_LIMIT polls (never, unless the kernel is broken) it counts a timeout in the
        row's sync[V4_TIMEOUTS] and returns what it read."""
        w = cuda.atomic.add(sync, i, 0)
        n = 0
        while (w >> 32) != tag:
            w = cuda.atomic.add(sync, i, 0)
            n += 1
            if n > V4_SPIN_LIMIT:
                cuda.atomic.add(sync, i - i % V4_SYNC + V4_TIMEOUTS, 1)
                break
        return w


@device_function
def _v4_ticket_tag(sync, i, nslice):
    """One ticket on sync[i] -> the epoch tag of this launch (the word a waiter waits for)."""
    tk = cuda.atomic.add(sync, i, 1)
    return (tk // nslice + 1) & V4_TAG_MASK


@device_function
def _v4_slice_load(hw, ww, kvw, h16, k16, w16, jj, residual_bf16):
    """A reducer's chunk jj: its 8 h words and partial sums (h*w)*k, h*h, k*k."""
    ha = load_u32x4(hw, h16 + 2 * jj)
    hb = load_u32x4(hw, h16 + 2 * jj + 1)
    wa = load_u32x4(ww, w16 + 2 * jj)
    wb = load_u32x4(ww, w16 + 2 * jj + 1)
    kq = load_u32x4(kvw, k16 + jj)
    return _chunk_sums(
        _h_value(ha[0], residual_bf16), _h_value(ha[1], residual_bf16), _h_value(ha[2], residual_bf16),
        _h_value(ha[3], residual_bf16), _h_value(hb[0], residual_bf16), _h_value(hb[1], residual_bf16),
        _h_value(hb[2], residual_bf16), _h_value(hb[3], residual_bf16), wa, wb, kq)


@device_function
def _v4_arrive(s_hk, s_hh, s_kk, part, pbase, sync, si, nslice, flag, scratch, partial, tid, nthreads):
    """A block's slice sums -> its partials at part[pbase:pbase+3]; count in on sync[si]. Every
    thread calls it; returns (whether this block came last, the launch's epoch tag) to all."""
    hk, hh, kk = _block_sums(s_hk, s_hh, s_kk, scratch, partial, tid, nthreads)
    if tid == 0:
        part[pbase] = f32_as_u32(hk)
        part[pbase + 1] = f32_as_u32(hh)
        part[pbase + 2] = f32_as_u32(kk)
        cuda.threadfence()
        old = cuda.atomic.add(sync, si, 1)
        flag[0] = 1 if old % nslice == nslice - 1 else 0
        flag[3] = np.uint32((old // nslice + 1) & V4_TAG_MASK)
        if old % nslice == nslice - 1:
            cuda.threadfence()          # the acquire side: the other blocks' partials before our reads
    cuda.syncthreads()
    return flag[0] != 0, np.int64(flag[3])


@device_function
def _v4_total(part, base, nslice, tid, scratch):
    """The row's three sums from its nslice partials at part[base + 3s ...] (read as atomics: the
    other blocks wrote them), in a fixed order: lane l adds slices l, l+32, ... in turn, then a
    warp sum. Every thread of the block calls it; warp 0 gets the totals."""
    a = _NEG_ZERO
    b = _NEG_ZERO
    d = _NEG_ZERO
    if tid < 32:
        i = tid
        while i < nslice:
            a += u32_as_f32(cuda.atomic.add(part, base + 3 * i, np.uint32(0)))
            b += u32_as_f32(cuda.atomic.add(part, base + 3 * i + 1, np.uint32(0)))
            d += u32_as_f32(cuda.atomic.add(part, base + 3 * i + 2, np.uint32(0)))
            i += 32
    return warp_sum(a, scratch), warp_sum(b, scratch), warp_sum(d, scratch)


@device_function
def _v4_publish(sync, i, tag, gate):
    """The gate as one word with its epoch tag (the waiters' one atomic read)."""
    cuda.atomic.exch(sync, i, (tag << 32) | np.int64(f32_as_u32(gate)))


@device_function
def _v4_gate_of(word):
    return u32_as_f32(np.uint32(word & 0xFFFFFFFF))


@device_function
def _v4_store(hw, h16, jj, x, v, gate, residual_bf16):
    """One chunk's h + gate*v from its h words x and value words v (gate_v3's update)."""
    store_u32x4(hw, h16 + 2 * jj,
                _new_h_word(_h_value(x[0], residual_bf16), gate, bf16x2_lo(v[0]), residual_bf16),
                _new_h_word(_h_value(x[1], residual_bf16), gate, bf16x2_hi(v[0]), residual_bf16),
                _new_h_word(_h_value(x[2], residual_bf16), gate, bf16x2_lo(v[1]), residual_bf16),
                _new_h_word(_h_value(x[3], residual_bf16), gate, bf16x2_hi(v[1]), residual_bf16))
    store_u32x4(hw, h16 + 2 * jj + 1,
                _new_h_word(_h_value(x[4], residual_bf16), gate, bf16x2_lo(v[2]), residual_bf16),
                _new_h_word(_h_value(x[5], residual_bf16), gate, bf16x2_hi(v[2]), residual_bf16),
                _new_h_word(_h_value(x[6], residual_bf16), gate, bf16x2_lo(v[3]), residual_bf16),
                _new_h_word(_h_value(x[7], residual_bf16), gate, bf16x2_hi(v[3]), residual_bf16))


@device_function
def _v4_words(hw, h16, jj):
    ha = load_u32x4(hw, h16 + 2 * jj)
    hb = load_u32x4(hw, h16 + 2 * jj + 1)
    return (ha[0], ha[1], ha[2], ha[3], hb[0], hb[1], hb[2], hb[3])


@device_function
def _v4_after(x, v, gate, residual_bf16):
    """The 8 h words after one layer's update (what gate_v4 stores), as words."""
    return (_new_h_word(_h_value(x[0], residual_bf16), gate, bf16x2_lo(v[0]), residual_bf16),
            _new_h_word(_h_value(x[1], residual_bf16), gate, bf16x2_hi(v[0]), residual_bf16),
            _new_h_word(_h_value(x[2], residual_bf16), gate, bf16x2_lo(v[1]), residual_bf16),
            _new_h_word(_h_value(x[3], residual_bf16), gate, bf16x2_hi(v[1]), residual_bf16),
            _new_h_word(_h_value(x[4], residual_bf16), gate, bf16x2_lo(v[2]), residual_bf16),
            _new_h_word(_h_value(x[5], residual_bf16), gate, bf16x2_hi(v[2]), residual_bf16),
            _new_h_word(_h_value(x[6], residual_bf16), gate, bf16x2_lo(v[3]), residual_bf16),
            _new_h_word(_h_value(x[7], residual_bf16), gate, bf16x2_hi(v[3]), residual_bf16))


def _make_v4(residual_bf16: bool):
    """gate_v4 for one residual (see the comment above)."""
    RB = bool(residual_bf16)

    def gate_v4(hw, kvw, ww, mask, dot_out, gate_out, part, sync, hc, dim, nslice, has_mask, has_dot, has_gate, eps):
        # hw, kvw, ww as gate_v2's; part [R*S*3 (or more)] u32 partial sums, sync [R*V4_SYNC] int64
        # counters (zero before the first launch, never reset); grid 2*R*S blocks (R = T*hc rows)
        scratch = cuda.shared.array(V4_MAX_THREADS, np.float32)    # warp_sum's simulator twin only
        partial = cuda.shared.array((MAX_WARPS, 3), np.float32)
        flag = cuda.shared.array(4, np.uint32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        nrs = cuda.gridDim.x // 2
        b = cuda.blockIdx.x
        role = b // nrs                 # 0 reducer, 1 updater
        b -= role * nrs
        row = b // nslice               # t * hc + c
        s = b - row * nslice
        t = row // hc
        c = row - t * hc
        live = True
        if has_mask != 0:
            live = mask[t] != 0
        if not live and has_dot == 0:
            if role == 0 and s == 0 and tid == 0 and has_gate != 0:
                gate_out[t, c] = np.float32(0.0)
            return              # every block of the row returns: no counter moves, no one waits
        chunks = dim // 8
        j = s * nthreads + tid
        ok = j < chunks
        jj = min(j, chunks - 1)
        h16 = row * (dim // 4)
        v16 = (t * (hc + 1) + hc) * (dim // 8)
        sb = row * V4_SYNC
        if role == 1:
            x = _v4_words(hw, h16, jj)
            vq = load_u32x4(kvw, v16 + jj)
            if tid == 0:
                tag = _v4_ticket_tag(sync, sb + V4_TICKET_U, nslice)
                if live:
                    flag[1] = np.uint32(_v4_wait(sync, sb + V4_READY_A, tag) & 0xFFFFFFFF)
            cuda.syncthreads()
            if live and ok:
                _v4_store(hw, h16, jj, x, vq, u32_as_f32(flag[1]), RB)
            return
        k16 = (t * (hc + 1) + c) * (dim // 8)
        w16 = c * (dim // 4)
        a, bb, d = _v4_slice_load(hw, ww, kvw, h16, k16, w16, jj, RB)
        if not ok:
            a = _NEG_ZERO
            bb = _NEG_ZERO
            d = _NEG_ZERO
        last, tag = _v4_arrive(a, bb, d, part, (row * nslice + s) * 3, sync, sb + V4_ARRIVE_A, nslice, flag,
                               scratch, partial, tid, nthreads)
        if not last:
            return
        hk, hh, kk = _v4_total(part, row * nslice * 3, nslice, tid, scratch)
        if tid == 0:
            dot, gate = _gate_scalars(hk, hh, kk, dim, eps, live)
            if has_dot != 0:
                dot_out[t, c] = dot
            if has_gate != 0:
                gate_out[t, c] = gate
            _v4_publish(sync, sb + V4_READY_A, tag, gate)

    gate_v4.__name__ = gate_v4.__qualname__ = f"gate_v4_{'bf16' if RB else 'fp32'}"
    return cuda.jit(gate_v4)


def _make_v4_pair(residual_bf16: bool):
    """gate_v4's two-layer kernel for one residual (see the comment above `_make_v4`)."""
    RB = bool(residual_bf16)

    def gate_v4_pair(hw, kvwa, kvwb, wwa, wwb, mask, dot_a, gate_a, dot_b, gate_b, part, sync, hc, dim, nslice,
                     has_mask, outs, eps):
        # gate_v4's arguments with a second layer's kv and w (gate_v3_pair's outputs and `outs`
        # bits); part [2*R*S*3] (layer a's partials, then layer b's); grid 3*R*S blocks
        scratch = cuda.shared.array(V4_MAX_THREADS, np.float32)    # warp_sum's simulator twin only
        partial = cuda.shared.array((MAX_WARPS, 3), np.float32)
        flag = cuda.shared.array(4, np.uint32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        nrs = cuda.gridDim.x // 3
        b = cuda.blockIdx.x
        role = b // nrs                 # 0 reducer of layer a, 1 middle (layer a's update, layer b's sums), 2 updater
        b -= role * nrs
        row = b // nslice
        s = b - row * nslice
        t = row // hc
        c = row - t * hc
        live = True
        if has_mask != 0:
            live = mask[t] != 0
        if not live and (outs & (PAIR_DOT_A | PAIR_DOT_B)) == 0:
            if role == 0 and s == 0 and tid == 0:
                if outs & PAIR_GATE_A:
                    gate_a[t, c] = np.float32(0.0)
                if outs & PAIR_GATE_B:
                    gate_b[t, c] = np.float32(0.0)
            return
        chunks = dim // 8
        j = s * nthreads + tid
        ok = j < chunks
        jj = min(j, chunks - 1)
        h16 = row * (dim // 4)
        k16 = (t * (hc + 1) + c) * (dim // 8)
        w16 = c * (dim // 4)
        v16 = (t * (hc + 1) + hc) * (dim // 8)
        sb = row * V4_SYNC
        if role == 2:
            x = _v4_words(hw, h16, jj)
            va = load_u32x4(kvwa, v16 + jj)
            vb = load_u32x4(kvwb, v16 + jj)
            if tid == 0:
                tag = _v4_ticket_tag(sync, sb + V4_TICKET_U, nslice)
                if live:
                    flag[1] = np.uint32(_v4_wait(sync, sb + V4_READY_A, tag) & 0xFFFFFFFF)
                    flag[2] = np.uint32(_v4_wait(sync, sb + V4_READY_B, tag) & 0xFFFFFFFF)
            cuda.syncthreads()
            if live and ok:
                y = _v4_after(x, va, u32_as_f32(flag[1]), RB)
                _v4_store(hw, h16, jj, y, vb, u32_as_f32(flag[2]), RB)
            return
        if role == 1:
            x = _v4_words(hw, h16, jj)
            va = load_u32x4(kvwa, v16 + jj)
            wb0 = load_u32x4(wwb, w16 + 2 * jj)
            wb1 = load_u32x4(wwb, w16 + 2 * jj + 1)
            kb = load_u32x4(kvwb, k16 + jj)
            if tid == 0:
                tag = _v4_ticket_tag(sync, sb + V4_TICKET_M, nslice)
                flag[1] = np.uint32(0)
                if live:
                    flag[1] = np.uint32(_v4_wait(sync, sb + V4_READY_A, tag) & 0xFFFFFFFF)
            cuda.syncthreads()
            ga = u32_as_f32(flag[1])
            _y, a, bb, d = _pair_mid(x, va, (wb0, wb1), kb, ok, ga, live, RB)
            last, tag = _v4_arrive(a, bb, d, part, ((nrs + row * nslice + s) * 3), sync, sb + V4_ARRIVE_B, nslice,
                                   flag, scratch, partial, tid, nthreads)
            if not last:
                return
            hk, hh, kk = _v4_total(part, (nrs + row * nslice) * 3, nslice, tid, scratch)
            if tid == 0:
                dot, gate = _gate_scalars(hk, hh, kk, dim, eps, live)
                if outs & PAIR_DOT_B:
                    dot_b[t, c] = dot
                if outs & PAIR_GATE_B:
                    gate_b[t, c] = gate
                _v4_publish(sync, sb + V4_READY_B, tag, gate)
            return
        a, bb, d = _v4_slice_load(hw, wwa, kvwa, h16, k16, w16, jj, RB)
        if not ok:
            a = _NEG_ZERO
            bb = _NEG_ZERO
            d = _NEG_ZERO
        last, tag = _v4_arrive(a, bb, d, part, (row * nslice + s) * 3, sync, sb + V4_ARRIVE_A, nslice, flag,
                               scratch, partial, tid, nthreads)
        if not last:
            return
        hk, hh, kk = _v4_total(part, row * nslice * 3, nslice, tid, scratch)
        if tid == 0:
            dot, gate = _gate_scalars(hk, hh, kk, dim, eps, live)
            if outs & PAIR_DOT_A:
                dot_a[t, c] = dot
            if outs & PAIR_GATE_A:
                gate_a[t, c] = gate
            _v4_publish(sync, sb + V4_READY_A, tag, gate)

    gate_v4_pair.__name__ = gate_v4_pair.__qualname__ = f"gate_v4_pair_{'bf16' if RB else 'fp32'}"
    return cuda.jit(gate_v4_pair)


_KERNELS: dict = {}


def gate_v2(residual_bf16: bool = False):
    """The v2 kernel for one residual (built once, then cached)."""
    key = (2, bool(residual_bf16))
    if key not in _KERNELS:
        _KERNELS[key] = _make_v2(bool(residual_bf16))
    return _KERNELS[key]


def gate_v3(nch: int, residual_bf16: bool = False):
    """The v3 kernel for `nch` chunks per thread and one residual (built once, then cached)."""
    if not 1 <= nch <= V3_MAX_CHUNKS:
        raise ValueError(f"v3 handles 1..{V3_MAX_CHUNKS} chunks per thread, got {nch}")
    key = (3, int(nch), bool(residual_bf16))
    if key not in _KERNELS:
        _KERNELS[key] = _make_v3(int(nch), bool(residual_bf16))
    return _KERNELS[key]


def gate_v3_pair(nch: int, residual_bf16: bool = False):
    """gate_v3's two-layer kernel for `nch` chunks per thread and one residual (built once, then cached)."""
    if not 1 <= nch <= V3_MAX_CHUNKS:
        raise ValueError(f"v3 handles 1..{V3_MAX_CHUNKS} chunks per thread, got {nch}")
    key = ("pair", int(nch), bool(residual_bf16))
    if key not in _KERNELS:
        _KERNELS[key] = _make_pair(int(nch), bool(residual_bf16))
    return _KERNELS[key]


def gate_v4(residual_bf16: bool = False):
    """The v4 kernel for one residual (built once, then cached)."""
    key = (4, bool(residual_bf16))
    if key not in _KERNELS:
        _KERNELS[key] = _make_v4(bool(residual_bf16))
    return _KERNELS[key]


def gate_v4_pair(residual_bf16: bool = False):
    """gate_v4's two-layer kernel for one residual (built once, then cached)."""
    key = ("pair4", bool(residual_bf16))
    if key not in _KERNELS:
        _KERNELS[key] = _make_v4_pair(bool(residual_bf16))
    return _KERNELS[key]


# ---- launch configuration ---------------------------------------------------------------------

def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def launch_config(T: int, hc: int, dim: int, version: int, layout: str | None = None,
                  tps: int | None = None) -> dict:
    """Grid, block, threads per stream (tps) and chunks per thread (nch) of one launch.

    A stream's dim/8 chunks of 8 elements are spread over tps threads (a multiple of 32), each
    taking nch = ceil(chunks / tps) of them; tps is the smallest multiple of 32 that covers the
    chunks in that many steps, so few threads idle (dim 5120: 640 chunks = 5 x 128, 3 x 224,
    2 x 320).
    token layout: one block per token, all hc streams (block tps*hc <= 512 threads); the value
        row of a token is read once, by one block.
    stream layout: one block per (t, c), numbered token-major so a token's blocks run together
        and its value row is an L2 hit after the first read; tps <= 256, or <= 512 when there
        are fewer than 512 blocks (small T: shorter per-block latency).
    Default layout: stream (H200, T=4096, dim 5120, hc 4: v2 stream 251 us, v2 token 268 us,
    v3 stream 296 us, v3 token 307 us; bench/results/h200.json). v3 defaults to stream: its
    registers grow with nch (~30 a chunk: `make compile-report`), and at nch = 5 a 512-thread
    token block would fill an SM alone, with no second block to overlap its barrier.
    `tps` overrides the choice (for tuning on the GPU).
    """
    chunks = dim // 8
    if version == 1:
        return {"version": 1, "grid": -(-(T * hc) // V1_THREADS), "block": V1_THREADS}
    if layout is None:
        layout = "stream"
    spb = hc if layout == "token" else 1
    if tps is None:
        if layout == "token":
            cap = MAX_THREADS // hc
        else:
            cap = 512 if T * hc < 512 else 256
        cap = max(32, cap - cap % 32)
        nch = -(-chunks // cap)
        tps = _round_up(-(-chunks // nch), 32)
    elif not (isinstance(tps, (int, np.integer)) and tps % 32 == 0 and 32 <= tps and tps * spb <= MAX_THREADS):
        raise ValueError(f"tps must be a multiple of 32 with tps * {spb} streams per block <= {MAX_THREADS}, "
                         f"got {tps!r}")
    tps = int(tps)
    return {"version": version, "layout": layout, "grid": T * (hc // spb), "block": tps * spb, "tps": tps,
            "nch": -(-chunks // tps)}


def _v3_applies(T: int, hc: int, dim: int, layout: str | None, tps: int | None = None) -> bool:
    return launch_config(T, hc, dim, 3, layout, tps)["nch"] <= V3_MAX_CHUNKS


def geometry_v4(T: int, hc: int, dim: int, layout: str | None = None, tps: int | None = None) -> dict:
    """v4's launch configuration (one layer; the pair's grid is 3/2 of it): blocks of tps threads,
    one chunk of 8 a thread, S = ceil(chunks / tps) slices a row, grid 2 * T * hc * S. `layout`
    does not apply (v4 has one block map) and is ignored; tps None: the smallest multiple of 32
    that keeps S <= 32 (dim 5120: 32 threads, 20 slices; dim 4096: 32, 16)."""
    chunks = dim // 8
    if tps is None:
        tps = max(32, _round_up(-(-chunks // 32), 32))
        if tps > V4_MAX_THREADS:
            raise ValueError(f"gate_v4 covers at most {32 * V4_MAX_THREADS} chunks of 8 a row (32 slices of "
                             f"{V4_MAX_THREADS} threads); dim {dim} has {chunks}: use gate_v2")
    elif not (isinstance(tps, (int, np.integer)) and tps % 32 == 0 and 32 <= tps <= V4_MAX_THREADS):
        raise ValueError(f"gate_v4's tps (threads a block, chunks a slice) must be a multiple of 32 in "
                         f"32..{V4_MAX_THREADS}, got {tps!r}")
    tps = int(tps)
    S = -(-chunks // tps)
    return {"version": 4, "layout": "slices", "grid": 2 * T * hc * S, "block": tps, "tps": tps, "nch": 1,
            "slices": S}


def _sm_count() -> int:
    if SIMULATOR:
        return 132                  # the H200's, so that the simulator refuses what the GPU would
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def v4_resident(grid: int, block: int, n_sm: int | None = None, pair: bool = False) -> bool:
    """Whether a v4 grid (of the pair kernel if `pair`) fits on the device at once (see the
    comment above `_make_v4`)."""
    n_sm = _sm_count() if n_sm is None else n_sm
    per_sm = V4_THREADS_PER_SM["pair" if pair else "single"]
    return grid * block <= n_sm * per_sm and grid <= n_sm * V4_BLOCKS_PER_SM


def v4_applies(T: int, hc: int, dim: int, tps: int | None = None, *, pair: bool = False,
               n_sm: int | None = None) -> bool:
    """Whether gate_v4 (or its pair) takes this shape: dim small enough and the grid resident."""
    try:
        cfg = geometry_v4(max(T, 1), hc, dim, None, tps)
    except ValueError:
        return False
    grid = cfg["grid"] * 3 // 2 if pair else cfg["grid"]
    return v4_resident(grid, cfg["block"], n_sm, pair)


def _v4_workspace(T: int, hc: int, S: int, layers: int):
    """(part, sync): partial sums [layers*R*S*3] u32 and the counters [R*V4_SYNC] int64, zeroed
    (synchronously, so this must not run under stream capture: the launchers run it before)."""
    rows = max(T, 1) * hc
    part = cuda.device_array(layers * rows * S * 3, dtype=np.uint32)
    sync = cuda.to_device(np.zeros(rows * V4_SYNC, np.int64))
    return part, sync


def v4_timeouts(launch) -> int:
    """Waits that gave up (V4_SPIN_LIMIT) in every run so far of a prepared gate_v4 launch or
    pair: 0 unless the kernel is broken (its results are then wrong too)."""
    sync = next(a for a in launch.args if getattr(a, "dtype", None) == np.int64)
    return int(sync.copy_to_host().reshape(-1, V4_SYNC)[:, V4_TIMEOUTS].sum())


def _check_v4_grid(name, grid, block, T, hc, dim, pair=False):
    if not v4_resident(grid, block, pair=pair):
        per_sm = V4_THREADS_PER_SM["pair" if pair else "single"]
        raise ValueError(f"{name} at T={T}, hc={hc}, dim={dim} needs {grid} blocks of {block} threads, more than "
                         f"the device holds at once ({_sm_count()} SMs x {V4_BLOCKS_PER_SM} blocks / {per_sm} "
                         "threads): it is meant for a few tokens; use gate_v3 or gate_v2")


# ---- prepared launches (arguments are checked by launch.prepare_gate) -------------------------

_DUMMIES: dict = {}


def dummy(kind: str):
    """1-element stand-ins for absent optional arrays (the kernels take one signature); made
    with device_array, so no copy is queued (safe under stream capture after the first call)."""
    if kind not in _DUMMIES:
        _DUMMIES[kind] = (cuda.device_array(1, dtype=np.uint8) if kind == "mask"
                          else cuda.device_array((1, 1), dtype=np.float32))
    return _DUMMIES[kind]


def geometry_v3(T: int, hc: int, dim: int, layout: str | None = None, tps: int | None = None) -> dict:
    """v3's launch configuration; v3 holds at most V3_MAX_CHUNKS chunks a thread in registers."""
    cfg = launch_config(T, hc, dim, 3, layout, tps)
    if cfg["nch"] > V3_MAX_CHUNKS:
        raise ValueError(f"gate_v3 keeps at most {V3_MAX_CHUNKS} chunks of 8 per thread; dim {dim} "
                         f"with layout {layout!r} and tps {tps!r} needs more: use gate_v2, "
                         f"layout='stream' or a larger tps")
    return cfg


def prepare(rec, highway, kv, w, *, mask=None, dot_out=None, gate_out=None, residual_bf16=False, eps=NORM_EPS,
            layout=None, tps=None, stream=0):
    """The stage's one launcher: a PreparedLaunch of kernel record `rec` (arguments checked by
    `launch.prepare_gate`; mask/dot_out/gate_out may be None). Argument forms:
        naive   (highway, kv, w, mask, dot_out, gate_out, has_mask, residual_bf16, has_dot, has_gate, eps)
        words   (highway, kv and w as flat uint32 views, mask, dot_out, gate_out, hc, dim, tps,
                 has_mask, has_dot, has_gate, eps): 16-byte aligned data; the kernel is
                 `rec.kernel_for(residual_bf16, nch)`
        v4      the words form with the launch's own workspace (part, sync) after gate_out and the
                 slice count in place of tps; the block size is the tps of `geometry_v4`"""
    name = rec.name
    T, hc, dim = (int(s) for s in highway.shape)
    if rec.args != "naive":
        for what, arr in (("highway", highway), ("kv", kv), ("w", w)):
            if data_address(arr) % rec.align:
                raise ValueError(f"{what}'s data must be {rec.align}-byte aligned for {name} (a sliced view?); "
                                 "use version='gate_v1' or an aligned copy")
    cfg = rec.geometry(max(T, 1), hc, dim, layout, tps)
    if T == 0:
        return NoLaunch(name)
    flags = (int(mask is not None), int(dot_out is not None), int(gate_out is not None))
    mask = mask if mask is not None else dummy("mask")
    dot_out = dot_out if dot_out is not None else dummy("out")
    gate_out = gate_out if gate_out is not None else dummy("out")
    eps32 = np.float32(eps)
    if rec.args == "naive":
        return PreparedLaunch(name, rec.kernel_for(), cfg["grid"], cfg["block"], stream,
                              (highway, kv, w, mask, dot_out, gate_out, flags[0], int(residual_bf16), flags[1],
                               flags[2], eps32))
    hw = highway.reshape(T * hc * dim).view(np.uint32)
    kvw = kv.reshape(T * (hc + 1) * dim).view(np.uint32)
    ww = w.reshape(hc * dim).view(np.uint32)
    if rec.args == "v4":
        _check_v4_grid(name, cfg["grid"], cfg["block"], T, hc, dim)
        part, sync = _v4_workspace(T, hc, cfg["slices"], 1)
        return PreparedLaunch(name, rec.kernel_for(bool(residual_bf16), 1), cfg["grid"], cfg["block"], stream,
                              (hw, kvw, ww, mask, dot_out, gate_out, part, sync, hc, dim, cfg["slices"], flags[0],
                               flags[1], flags[2], eps32))
    if rec.args != "words":
        raise ValueError(f"gate record {name} has an unknown argument form {rec.args!r}")
    return PreparedLaunch(name, rec.kernel_for(bool(residual_bf16), cfg["nch"]), cfg["grid"], cfg["block"], stream,
                          (hw, kvw, ww, mask, dot_out, gate_out, hc, dim, cfg["tps"], flags[0], flags[1], flags[2],
                           eps32))


# The pair keeps both layers' inputs in registers, so a block of it holds more registers than a
# gate_v3 block: 78 / 118 / 154 a thread at nch = 1 / 2 / 3 with the fp32 residual, 86 / 128 / 168
# with bf16 (compile tier, sm_90a), up to 255 past that; a block may hold 65,536. Larger blocks
# fail to launch on the GPU (the token layout at dim 5120 and hc 4: nch 5 on 512 threads did).
PAIR_MAX_BLOCK = {1: 736, 2: 512, 3: 384}
PAIR_MAX_BLOCK_PAST = 256           # nch >= 4: 255 registers a thread, 8 warps


def pair_fits(cfg: dict) -> bool:
    """Whether the pair kernel can launch with gate_v3's geometry `cfg` (`geometry_v3`)."""
    return cfg["block"] <= PAIR_MAX_BLOCK.get(cfg["nch"], PAIR_MAX_BLOCK_PAST)


def prepare_pair(rec, highway, kv_a, w_a, kv_b, w_b, *, mask=None, dot_a=None, gate_a=None, dot_b=None,
                 gate_b=None, residual_bf16=False, eps=NORM_EPS, layout=None, tps=None, stream=0):
    """Two layers' gates in one launch (arguments checked by `launch.prepare_gate_pair`): record
    `rec` must be gate_v3 (the pair is its kernel run twice in a block) or gate_v4 (its three-role
    pair kernel); the launch's name is "<record>[2 layers]". Layer a's gate runs first, layer b's
    on its result, as two launches of the record with the same layout and tps would (bit for bit)."""
    if rec.name not in ("gate_v3", "gate_v4"):
        raise ValueError(f"the two-layer gate is gate_v3's or gate_v4's kernel; {rec.name} has no pair form")
    T, hc, dim = (int(s) for s in highway.shape)
    for what, arr in (("highway", highway), ("kv_a", kv_a), ("w_a", w_a), ("kv_b", kv_b), ("w_b", w_b)):
        if data_address(arr) % rec.align:
            raise ValueError(f"{what}'s data must be {rec.align}-byte aligned for the two-layer {rec.name} "
                             "(a sliced view?); run the layers' gates one by one (gate_v1) or use aligned copies")
    cfg = rec.geometry(max(T, 1), hc, dim, layout, tps)
    if rec.name == "gate_v4":
        return _prepare_pair_v4(rec, cfg, highway, kv_a, w_a, kv_b, w_b, mask, dot_a, gate_a, dot_b, gate_b,
                                residual_bf16, eps, stream)
    if not pair_fits(cfg):
        raise ValueError(f"the two-layer gate cannot hold {cfg['nch']} chunks a thread on {cfg['block']}-thread "
                         f"blocks ({cfg['layout']} layout, dim {dim}, hc {hc}): more registers than a block may "
                         f"hold (at most {PAIR_MAX_BLOCK.get(cfg['nch'], PAIR_MAX_BLOCK_PAST)} threads at that "
                         "nch); use layout='stream', another tps, or the layers' gates one by one (prepare_gate)")
    name = f"{rec.name}[2 layers]"
    if T == 0:
        return NoLaunch(name)
    outs = 0
    for bit, arr in ((PAIR_DOT_A, dot_a), (PAIR_GATE_A, gate_a), (PAIR_DOT_B, dot_b), (PAIR_GATE_B, gate_b)):
        if arr is not None:
            outs |= bit
    dot_a, gate_a, dot_b, gate_b = (a if a is not None else dummy("out") for a in (dot_a, gate_a, dot_b, gate_b))
    hw = highway.reshape(T * hc * dim).view(np.uint32)
    kvwa = kv_a.reshape(T * (hc + 1) * dim).view(np.uint32)
    kvwb = kv_b.reshape(T * (hc + 1) * dim).view(np.uint32)
    wwa = w_a.reshape(hc * dim).view(np.uint32)
    wwb = w_b.reshape(hc * dim).view(np.uint32)
    return PreparedLaunch(name, gate_v3_pair(cfg["nch"], bool(residual_bf16)), cfg["grid"], cfg["block"], stream,
                          (hw, kvwa, kvwb, wwa, wwb, mask if mask is not None else dummy("mask"), dot_a, gate_a,
                           dot_b, gate_b, hc, dim, cfg["tps"], int(mask is not None), outs, np.float32(eps)))


def _pair_outs(dot_a, gate_a, dot_b, gate_b):
    outs = 0
    for bit, arr in ((PAIR_DOT_A, dot_a), (PAIR_GATE_A, gate_a), (PAIR_DOT_B, dot_b), (PAIR_GATE_B, gate_b)):
        if arr is not None:
            outs |= bit
    return outs, [a if a is not None else dummy("out") for a in (dot_a, gate_a, dot_b, gate_b)]


def _prepare_pair_v4(rec, cfg, highway, kv_a, w_a, kv_b, w_b, mask, dot_a, gate_a, dot_b, gate_b, residual_bf16,
                     eps, stream):
    """gate_v4's pair: 3 * T * hc * S blocks (reducers of layer a, middles, updaters), with its
    own workspace; "gate_v4[2 layers]", bit-identical to two gate_v4 launches of the same tps."""
    T, hc, dim = (int(s) for s in highway.shape)
    name = f"{rec.name}[2 layers]"
    grid = cfg["grid"] * 3 // 2
    _check_v4_grid(name, grid, cfg["block"], T, hc, dim, pair=True)
    if T == 0:
        return NoLaunch(name)
    outs, (dot_a, gate_a, dot_b, gate_b) = _pair_outs(dot_a, gate_a, dot_b, gate_b)
    part, sync = _v4_workspace(T, hc, cfg["slices"], 2)
    hw = highway.reshape(T * hc * dim).view(np.uint32)
    kvwa = kv_a.reshape(T * (hc + 1) * dim).view(np.uint32)
    kvwb = kv_b.reshape(T * (hc + 1) * dim).view(np.uint32)
    wwa = w_a.reshape(hc * dim).view(np.uint32)
    wwb = w_b.reshape(hc * dim).view(np.uint32)
    return PreparedLaunch(name, gate_v4_pair(bool(residual_bf16)), grid, cfg["block"], stream,
                          (hw, kvwa, kvwb, wwa, wwb, mask if mask is not None else dummy("mask"), dot_a, gate_a,
                           dot_b, gate_b, part, sync, hc, dim, cfg["slices"], int(mask is not None), outs,
                           np.float32(eps)))


# ---- compile-only targets (sm_90) ---------------------------------------------------------------

_F32_2D = types.float32[:, ::1]
V1_ARGS = (types.float32[:, :, ::1], types.uint16[:, ::1], _F32_2D, types.uint8[::1], _F32_2D, _F32_2D,
           types.int64, types.int64, types.int64, types.int64, types.float32)
FAST_ARGS = (types.uint32[::1], types.uint32[::1], types.uint32[::1], types.uint8[::1], _F32_2D, _F32_2D,
             types.int64, types.int64, types.int64,
             types.int64, types.int64, types.int64, types.float32)
PAIR_ARGS = (types.uint32[::1],) * 5 + (types.uint8[::1],) + (_F32_2D,) * 4 + (types.int64,) * 5 + (types.float32,)
V4_ARGS = FAST_ARGS[:6] + (types.uint32[::1], types.int64[::1]) + FAST_ARGS[6:]
V4_PAIR_ARGS = PAIR_ARGS[:10] + (types.uint32[::1], types.int64[::1]) + PAIR_ARGS[10:]


def v3_target_nchs() -> list[int]:
    """The nch values the launcher picks for the released and tiny shapes."""
    seen = set()
    for T in (1, 7, 128, 4096):
        for hc in range(1, MAX_HC + 1):
            for dim in (64, 128, 5120):
                for layout in LAYOUTS:
                    nch = launch_config(T, hc, dim, 3, layout)["nch"]
                    if nch <= V3_MAX_CHUNKS:
                        seen.add(nch)
    return sorted(seen)


def residual_name(rb: bool) -> str:
    return "bf16" if rb else "fp32"
