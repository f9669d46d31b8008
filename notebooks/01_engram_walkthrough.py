# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The Engram module of DeepSeek-V4.1-Flash, one stage at a time
#
# Engram is a *conditional memory*: before two of the transformer's blocks (layers 1 and 14 in the
# release), every position looks up rows of a huge table by hashing the last few tokens, projects
# them into a key per hyper-connection stream plus one shared value, and adds the value to each
# stream scaled by a gate that says how well the stream's state agrees with the key.
#
# ```
# token ids -> hash (CPU) -> row ids [T, layers, C]
#           -> rows: Q2_K blocks [T*C, 84] -> dequant -> bf16 rows [T*C, 256]
#           -> projection: kv = bf16(x @ wkv^T)        [T, (hc+1)*dim]
#           -> gate: highway[t, c] += sigmoid(signed sqrt(dot)) * value[t]   [T, hc, dim] fp32
# ```
#
# This notebook walks the tiny model shipped in `data/` through every stage. Its *configuration*
# is the reference's own test configuration (engram layers 1 and 4, n-grams up to 4, 2 hash heads
# per order, so C = 6 hash columns; dim 64, hc 4 streams, 256 values a row); its *weights* are
# synthetic: random draws shaped like trained weights, not DeepSeek's. Every figure below is of
# that synthetic model. Each stage is computed twice: by the numpy reference
# (`engram_numba.stages.<stage>.reference`, written to be read) and by the `@cuda.jit` kernel.
# Without a GPU the kernels run in numba's CUDA simulator, which executes every GPU thread as a
# Python thread: it is exact but slow, so the kernel cells use one token at a time. The released
# shapes are in the comments (dim 5120, C = 24, K = 6144, N = 25600). `docs/math.md` states the
# math of every stage, `docs/formats.md` the file formats and `docs/numerics.md` what is exact
# and what carries error bars.

# %%
import time

import matplotlib.pyplot as plt
import numpy as np

import engram_numba as en
from engram_numba.bf16 import as_bfloat16, bf16_ulp_distance
from engram_numba.stages.hash import reference as hash_ref
from engram_numba.stages.proj import launch as proj_launch
from engram_numba.stages.proj import reference as proj_ref
from engram_numba.stages.rows import launch as rows_launch
from engram_numba.stages.rows import q2k
from engram_numba.stages.rows import reference as rows_ref
from numba import cuda  # after engram_numba, which picks the simulator when there is no GPU

np.set_printoptions(linewidth=110)
TINY_TOKENS, TINY_MASK = en.TINY_TOKENS, en.TINY_MASK    # the tiny test sequence; position 9 dead
model = en.load_gguf(en.tiny_model_path())               # the synthetic tiny model in data/
cfg, tables = model.config, model.hash_tables
print("@cuda.jit kernels run in numba's CUDA simulator:", en.SIMULATOR)
print(cfg)
print(f"hash columns C = {cfg.n_hash_cols}, projection K = C*256 = {cfg.proj_in}, "
      f"N = dim*(hc+1) = {cfg.proj_out}")
print("table rows per layer:", dict(zip(cfg.layer_ids, tables.table_rows.tolist())))

# %% [markdown]
# ## (a) The hash: n-gram windows and dead tokens
#
# Each position p hashes its *window*: the current token and the `max_ngram_size - 1 = 3`
# tokens before it, `tok[s] = token at p - s`. Blocking is sticky: once the window reaches before
# the start of the sequence or a **dead** (masked) token, e.g. an image position, that slot and
# every older one take the pad id (2). So an n-gram never crosses a dead token, and a dead current
# token pads every slot.
#
# The window is folded with XOR of per-shift multiplier products; after step i the fold covers
# the (i+1)-gram, and each of its 2 heads reduces it modulo its own prime and adds the column's
# offset into the layer's table:
# ```
# rolling = tok[0]*m[0]
# for i in 1..3:   rolling ^= tok[i]*m[i];   row_id[(i-1)*heads + h] = rolling % P[i-1][h] + O[col]
# ```
# `en.EngramHasher` is the `@njit` version (it keeps the sequence's history, so decode steps look
# back into the prefill); `engram_numba.stages.hash.reference.hash_reference` is the plain-Python
# one it is tested against. The tiny sequence's position 13 must hash to the layer-4 ids
# `[14, 186, 216, 375, 492, 542]`, the published test vector (docs/math.md, section 3.5 "Test
# vectors"). The golden run masks position 9.

# %%
ids_plain = en.EngramHasher(tables).hash(TINY_TOKENS)                 # [T, L, C] int64, no mask
ids_masked = en.EngramHasher(tables).hash(TINY_TOKENS, TINY_MASK)     # position 9 dead
ids_ref = hash_ref.hash_reference(tables, TINY_TOKENS, TINY_MASK)     # the readable version
assert np.array_equal(ids_masked, ids_ref)

li4 = cfg.layer_index(4)                  # layer id 4 is the second engram layer
test_vector = [14, 186, 216, 375, 492, 542]
print("tokens   ", TINY_TOKENS.tolist())
print("live     ", TINY_MASK.astype(int).tolist())
print("ids shape", ids_masked.shape, "= [T, engram layers, hash columns]")
print("L4 row ids at position 13, no mask:", ids_plain[13, li4].tolist())
print("L4 row ids at position 13, masked: ", ids_masked[13, li4].tolist())
assert ids_plain[13, li4].tolist() == test_vector == ids_masked[13, li4].tolist()
changed = np.flatnonzero((ids_plain != ids_masked).any(axis=(1, 2)))
print("positions whose ids the dead token changes:", changed.tolist())

# Prefill in chunks, then one decode step: the same ids as one call.
h = en.EngramHasher(tables)
parts = [h.hash(TINY_TOKENS[:5], TINY_MASK[:5]), h.hash(TINY_TOKENS[5:13], TINY_MASK[5:13]),
         h.hash(TINY_TOKENS[13:], TINY_MASK[13:])]
assert np.array_equal(np.concatenate(parts), ids_masked)
print("chunked prefill + decode step == one call: True")

# %% [markdown]
# The dead token at position 9 changes exactly positions 9..12: position 9 itself (every slot
# padded) and the three positions whose 4-token windows reach back to it. Position 13's window
# (10..13) ends after the dead token, so it keeps the test vector. The figure draws the windows
# of four positions: the start of the sequence, the dead token itself, a window cut by the dead
# token, and position 13. Hatched red cells are padded slots; the brackets under each window are
# the 2-, 3- and 4-gram that the hash columns of each order see.

# %%
import matplotlib.patches as mpatches

M, T = cfg.max_ngram_size, TINY_TOKENS.size
windows = en.ngram_windows(TINY_TOKENS, TINY_MASK, M, pad_id=tables.pad_id,
                           token_map=tables.token_map)       # [T, M]: column s = token s places back
show = {2: "sequence start: slot 3 is before position 0",
        9: "dead current token: every slot is pad",
        11: "window reaches the dead token: slots 2, 3 padded",
        13: "the published test vector"}
order_colour = {2: "tab:green", 3: "tab:orange", 4: "tab:purple"}

fig, ax = plt.subplots(figsize=(13, 6.4))

def box(x, y, text, face, hatch=None, dashed=False):
    ax.add_patch(mpatches.Rectangle((x - 0.44, y - 0.33), 0.88, 0.66, facecolor=face, edgecolor="black",
                                    hatch=hatch, linewidth=1.0, linestyle="--" if dashed else "-"))
    ax.text(x, y, text, ha="center", va="center", fontsize=9)

for t in range(T):                                               # the sequence itself
    live = bool(TINY_MASK[t])
    box(t, 0, str(TINY_TOKENS[t]), "#dbe9f6" if live else "#cfcfcf", None if live else "///")
    ax.text(t, 0.5, str(t), ha="center", fontsize=8, color="grey")
ax.text(-2.2, 0, "token ids", ha="right", va="center", fontsize=9)
ax.text(-2.2, 0.5, "position", ha="right", va="center", fontsize=8, color="grey")
dead = np.flatnonzero(~TINY_MASK)
for t in dead:
    ax.axvline(t, color="#c0392b", linewidth=0.8, linestyle=":", zorder=0)
    ax.text(t, 0.85, "dead", ha="center", fontsize=8, color="#c0392b")

for r, (p, note) in enumerate(show.items()):
    y = -1.9 * (r + 1)
    blocked = False
    for s in range(M):                                           # slot s sits at position p - s
        x = p - s
        blocked = blocked or x < 0 or not TINY_MASK[x]
        box(x, y, "pad" if blocked else str(windows[p, s]),
            "#f6d5d1" if blocked else "#eaf5e4", "///" if blocked else None, dashed=x < 0)
        ax.text(x, y + 0.45, f"s={s}", ha="center", fontsize=6, color="grey")
    for n in range(2, M + 1):                                    # the n-gram of each order
        yb = y - 0.45 - 0.17 * (n - 2)
        x0, x1 = p - (n - 1) - 0.4, p + 0.4
        ax.plot([x0, x0, x1, x1], [yb + 0.07, yb, yb, yb + 0.07], color=order_colour[n], linewidth=1.4)
        ax.text(x0 - 0.1, yb, f"{n}-gram", ha="right", va="center", fontsize=7, color=order_colour[n])
    ax.text(-2.2, y, f"window of p={p}", ha="right", va="center", fontsize=9)
    ax.text(T + 0.1, y + 0.15, f"L4 row ids {ids_masked[p, li4].tolist()}", fontsize=9, va="center")
    ax.text(T + 0.1, y - 0.3, note, fontsize=8, color="dimgrey", va="center")
ax.set_xlim(-5.6, T + 8.3)
ax.set_ylim(-1.9 * len(show) - 1.1, 1.2)
ax.axis("off")
ax.set_title("Engram hash windows (the synthetic tiny model's hash tables): slot s holds the token s places "
             f"back;\nblocked slots (hatched) take the pad id {tables.pad_id}; dashed = before the sequence start",
             fontsize=10)
plt.show()

# %% [markdown]
# The fold itself at position 13 of layer 4, in Python integers. The multipliers are odd 64-bit
# numbers drawn from a generator seeded by the layer *id*, the primes are consecutive primes
# above the `engram_vocab_size` (64 in the tiny model, 16,000,000 in the release), and the
# offsets are their prefix sums, so each column owns a disjoint slice of the table
# (docs/math.md, section 3.3).

# %%
p = 13
tok = [int(v) for v in windows[p]]                       # tok[0] is the current token
m = [int(v) for v in tables.multipliers[li4]]
print(f"position {p}: tok = {tok}, multipliers = {m}")
rolling = tok[0] * m[0]
for i in range(1, M):
    rolling ^= tok[i] * m[i]
    for hd in range(tables.n_heads):
        col = (i - 1) * tables.n_heads + hd
        prime, off = int(tables.primes[li4, i - 1, hd]), int(tables.offsets[li4, col])
        print(f"  {i + 1}-gram head {hd} (col {col}): rolling = {rolling:>20d}  mod {prime:>3d} = "
              f"{rolling % prime:>3d}  + offset {off:>3d} = row {rolling % prime + off:>3d}")

# %% [markdown]
# ## (b) A Q2_K block becomes 256 values
#
# Each table row is one 84-byte Q2_K super-block holding 256 values in 16 sub-blocks of 16
# (docs/math.md, section 4.1):
#
# | bytes | field | meaning |
# |---|---|---|
# | 0-15 | `scales` | one byte per sub-block: low nibble = scale code, high nibble = min code |
# | 16-79 | `qs` | 2-bit quants, four to a byte |
# | 80-81 | `d` | fp16 super-scale of the scale codes |
# | 82-83 | `dmin` | fp16 super-scale of the min codes |
#
# Value e (0..255): `n = e//128, w = e%128, j = w//32, h = (w%32)//16, l = w%16`;
# `sc = scales[8n + 2j + h]`, `q = (qs[32n + 16h + l] >> 2j) & 3`, and
# `y = d*(sc & 15)*q - dmin*(sc >> 4)` in fp32, then rounded to bf16 (nearest even) for the
# projection. Each sub-block therefore has only 4 possible values, an evenly spaced ladder.
# We take the row that position 13 reads for layer 4's first hash column.

# %%
table4 = model.layers[4].table                   # [630, 84] uint8, a view of the memory-mapped GGUF
row_id = int(ids_masked[13, li4, 0])
block = np.array(table4[row_id])                 # [84] uint8
scales, qs = block[0:16], block[16:80]
d, dmin = block[80:82].view(np.float16)[0], block[82:84].view(np.float16)[0]
print(f"layer-4 table row {row_id}: {block.size} bytes")
print("scales  bytes 0-15 :", " ".join(f"{v:02x}" for v in scales))
print("  low nibble  (scale code):", (scales & 15).tolist())
print("  high nibble (min code)  :", (scales >> 4).tolist())
print("qs      bytes 16-79: four 2-bit codes a byte")
for r in range(4):
    print("   ", " ".join(f"{v:02x}" for v in qs[16 * r:16 * r + 16]))
print(f"d       bytes 80-81: {block[80]:02x} {block[81]:02x} -> fp16 {float(d):.6g}")
print(f"dmin    bytes 82-83: {block[82]:02x} {block[83]:02x} -> fp16 {float(dmin):.6g}")


# %%
def decode_by_hand(block, e):
    """Value e of one Q2_K block, step by step, in the reference's fp32 order."""
    n, w = e // 128, e % 128
    j, h, l = w // 32, (w % 32) // 16, w % 16
    sc_index, qs_index = 8 * n + 2 * j + h, 32 * n + 16 * h + l
    sc = int(block[sc_index])
    q = (int(block[16 + qs_index]) >> (2 * j)) & 3
    d = np.float32(block[80:82].view(np.float16)[0])
    dmin = np.float32(block[82:84].view(np.float16)[0])
    scale = d * np.float32(sc & 15)
    offset = dmin * np.float32(sc >> 4)
    y = scale * np.float32(q) - offset
    print(f"e={e:>3}: n={n} w={w:>3} j={j} h={h} l={l:>2} | sc=scales[{sc_index:>2}]=0x{sc:02x} "
          f"(scale {sc & 15:>2}, min {sc >> 4:>2}) | q=(qs[{qs_index:>2}] >> {2 * j}) & 3 = {q} | "
          f"y = {float(d):.4g}*{sc & 15}*{q} - {float(dmin):.4g}*{sc >> 4} = {y:+.6f}")
    return y

by_hand = {e: decode_by_hand(block, e) for e in (0, 37, 130, 200, 255)}
values = q2k.dequantize(block[None, :])[0]              # [256] fp32, the reference decoder
assert all(values[e].view(np.uint32) == np.float32(y).view(np.uint32) for e, y in by_hand.items())
print("by hand == q2k.dequantize, bit for bit")

# %% [markdown]
# The whole row: each sub-block's 16 values sit on its own 4-rung ladder
# `scale*q - offset, q = 0..3` (faint lines). Two bits a value plus the per-sub-block codes and
# the two fp16 super-scales make 84 bytes = 2.625 bits a value.

# %%
fig, ax = plt.subplots(figsize=(12, 3.6))
for sub in range(16):                                # sub-block = 8n + 2j + h covers 16 values
    n, j, h = sub // 8, (sub % 8) // 2, sub % 2
    e0 = 128 * n + 32 * j + 16 * h
    sc = int(scales[sub])
    scale, offset = np.float32(d) * (sc & 15), np.float32(dmin) * (sc >> 4)
    colour = plt.cm.tab20(sub)
    for q in range(4):
        ax.hlines(scale * q - offset, e0 - 0.5, e0 + 15.5, color=colour, alpha=0.35, linewidth=0.8)
    ax.plot(np.arange(e0, e0 + 16), values[e0:e0 + 16], "o", ms=3, color=colour)
ax.set_xlabel("value index e")
ax.set_ylabel("dequantised value")
ax.set_title(f"synthetic tiny model, layer-4 row {row_id}: 16 sub-blocks, 4 levels each "
             "(lines: scale*q - offset)", fontsize=10)
ax.grid(True, alpha=0.3)
plt.show()

# %% [markdown]
# Now the `@cuda.jit` rows kernels on this one block. `engram_numba/stages/rows/cuda_q2k.py` keeps
# every version (llm.c style): the records `q2k_v1` .. `q2k_v4` (`en.kernels.names("rows")`),
# where `q2k_v1` is one thread per value, the teaching baseline, and later versions decode a row
# with 8 lanes and wide loads. `stages.rows.launch.decode_rows` decodes raw rows in order. Each
# version must give the reference's bf16 words bit for bit: the only rounding is the final
# fp32 -> bf16, and the kernels do the fp32 math in the same order with no FMA contraction.

# %%
want = rows_ref.rows_reference(block[None, :], "q2k")    # [1, 256] bf16 words (uint16)
d_block = cuda.to_device(block[None, :])                 # [1, 84] uint8 on the device
for name in en.kernels.names("rows", "q2k"):
    got_v = rows_launch.decode_rows(d_block, version=name).copy_to_host()
    print(f"rows kernel {name}: bit-identical to the reference: {np.array_equal(got_v, want)}")
got = rows_launch.decode_rows(d_block).copy_to_host()    # the launcher's default version
assert np.array_equal(got, want)

print()
print("  e   fp32 value   reference bf16      kernel bf16")
for e in list(by_hand) + [1, 2, 3]:
    print(f"{e:>3}  {values[e]:+.6f}   0x{want[0, e]:04x} {float(as_bfloat16(want)[0, e]):+.5f}   "
          f"0x{got[0, e]:04x} {float(as_bfloat16(got)[0, e]):+.5f}")

# %% [markdown]
# In the engine the table lives on the GPU and the kernel *gathers* rows by id
# (`stages.rows.launch.gather_rows`), so the 84-byte blocks never cross PCIe. Position 13's six
# layer-4 rows:

# %%
row_ids = ids_masked[13, li4]                                     # [C] int64
rows_gpu = rows_launch.gather_rows(cuda.to_device(np.ascontiguousarray(table4)), row_ids).copy_to_host()
rows_expected = rows_ref.rows_reference(rows_ref.gather_reference(table4, row_ids), "q2k")   # [C, 256] bf16
print("gathered rows", rows_gpu.shape, "bit-identical:", np.array_equal(rows_gpu, rows_expected))
assert np.array_equal(rows_gpu, rows_expected)

# %% [markdown]
# ## (c) The projection: kv = [hc keys | one shared value]
#
# A token's C rows are concatenated into x [K = C*256] (element `col*256 + d` is value d of its
# column-col row) and multiplied by `wkv` [N, K] with fp32 accumulation, then rounded once to
# bf16: `kv = bf16(x @ wkv^T)` [N = dim*(hc+1)]. The first hc*dim outputs are one key per
# hyper-connection stream, the last dim the value shared by all streams. The tiny model: K = 1536,
# N = 320 = 4 keys of 64 + a value of 64 (released: K = 6144, N = 25600, keys of 5120).

# %%
x = rows_ref.flatten_rows(rows_expected, 1)               # [1, K] bf16 words: one token
wkv = model.layers[4].wkv_bf16()                     # [N, K] bf16 words (decoded once from Q2_K)
kv_ref = proj_ref.projection_reference(x, wkv)       # [1, N], fp32 sums in k order 0..K-1
print("x", x.shape, " wkv", wkv.shape, " kv", kv_ref.shape)

dim, hc = cfg.dim, cfg.hc
fig, axes = plt.subplots(2, 1, figsize=(12, 2.8), layout="constrained")
segments = [(f"col {c}: {c // tables.n_heads + 2}-gram h{c % tables.n_heads}", c * 256, 256)
            for c in range(cfg.n_hash_cols)]
for a, segs, width, title in (
        (axes[0], segments, cfg.proj_in, f"projection input x [K = {cfg.proj_in}]: one row per hash column"),
        (axes[1], [(f"key, stream {c}", c * dim, dim) for c in range(hc)] + [("value (shared)", hc * dim, dim)],
         cfg.proj_out, f"projection output kv [N = {cfg.proj_out}] = [hc keys | value]")):
    for i, (label, start, size) in enumerate(segs):
        a.barh(0, size, left=start, color=plt.cm.Pastel1(i % 9), edgecolor="black")
        a.text(start + size / 2, 0, label, ha="center", va="center", fontsize=8)
    a.set_xlim(0, width)
    a.set_yticks([])
    a.set_title(title, fontsize=10, loc="left")
axes[1].set_xlabel("element index")
fig.suptitle("the shapes of the synthetic tiny model (released: K = 6144, N = 25600)", fontsize=10)
plt.show()

# %% [markdown]
# The CUDA projection of the same token. `engram_numba/stages/proj/cuda_gemv.py` and
# `cuda_gemm.py` keep numbered versions: GEMVs for a few tokens (one pass over the weight serves
# them all: decode is bound by reading the weight) and GEMMs for many.
# `stages.proj.launch.pick(T, K, N)` is the launcher's choice: on a GPU the fast versions
# (`gemv_v3` at T = 1, `gemv_v4` up to 32 tokens, `gemm_v3` beyond); in the simulator the naive
# ones (`gemv_v1`: one thread per output, a plain loop over k), because barriers, warp shuffles
# and the tensor cores are what the simulator is slowest at. The naive kernels add in the
# reference's order and match it bit for bit; the fast ones split each sum across lanes, so they
# may land 1 bf16 ulp away where a sum sits near a rounding boundary (docs/numerics.md,
# "Projection"). We run the launcher's choice and `gemv_v2`, a fast version (x staged in shared
# memory, weight rows streamed with 16-byte loads, one warp-shuffle reduction per output), which
# takes a few seconds here (`gemv_v3`, the GPU's choice at T = 1, takes about half a minute in the
# simulator).

# %%
x_dev, wkv_dev = cuda.to_device(x), cuda.to_device(wkv)
choice = proj_launch.pick(1, cfg.proj_in, cfg.proj_out).name
print("versions:", en.kernels.names("proj"), "| the launcher's choice at T = 1 here:", choice)
kv_exact = proj_ref.projection_exact(x, wkv)         # float64 sums, rounded once
print(f"reference vs float64-exact: max {bf16_ulp_distance(kv_ref, kv_exact).max()} bf16 ulp")
kv_gpu = {}
for version in dict.fromkeys([choice, "gemv_v2"]):
    t0 = time.perf_counter()
    kv_gpu[version] = proj_launch.project(x_dev, wkv_dev, version=version).copy_to_host()   # [1, N]
    ulps = bf16_ulp_distance(kv_ref, kv_gpu[version])
    print(f"{version:>8}: {time.perf_counter() - t0:5.1f} s; vs reference max {ulps.max()} bf16 ulp, "
          f"{np.count_nonzero(ulps)} of {ulps.size} outputs differ")
key, value = proj_ref.split_kv(kv_gpu["gemv_v2"], hc)     # [1, hc, dim], [1, dim]
print("key", key.shape, " value", value.shape)

fig, ax = plt.subplots(figsize=(12, 3.4))
kv_f = as_bfloat16(kv_ref)[0].astype(np.float32)
ax.plot(kv_f, color="black", linewidth=0.8, label="reference")
for (version, kv_v), marker in zip(kv_gpu.items(), ("o", ".")):
    ax.plot(as_bfloat16(kv_v)[0].astype(np.float32), marker, ms=4 if marker == "o" else 3, mfc="none"
            if marker == "o" else None, label=f"CUDA {version}")
for c in range(hc + 1):
    ax.axvspan(c * dim, (c + 1) * dim, color=plt.cm.Pastel1(c), alpha=0.35, zorder=0)
    ax.text((c + 0.5) * dim, kv_f.max() * 1.05, f"key {c}" if c < hc else "value", ha="center", fontsize=8)
ax.set_xlabel("kv element")
ax.set_title("synthetic tiny model, layer 4, position 13: kv from the reference and the CUDA kernels",
             fontsize=10)
ax.legend(fontsize=8, loc="lower right")
plt.show()

# %% [markdown]
# ## (d) The gate: sigmoid of a signed square root, with a clamp
#
# For token t and stream c (over d in 0..dim-1, in fp32), with `w = q_weight[c] * k_weight[c]`
# (docs/math.md, section 6):
# ```
# dot  = sum(h*w*k) * rsqrt(mean(h*h) + eps) * rsqrt(mean(k*k) + eps) / sqrt(dim)
# gate = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot))        (0 for a dead token)
# highway[t, c] = h + gate * value[t]
# ```
# dot is a cosine-like agreement between the stream and its key (scaled by w). The signed square
# root flattens large |dot| and is infinitely steep at 0; the clamp `max(|dot|, 1e-6)` caps that
# slope, so in `|dot| < 1e-6` the gate sits at sigmoid(+-1e-3) = 0.50025 / 0.49975. The dots
# are those of the reference run of the whole tiny sequence (14 tokens x 4 streams x 2 layers).

# %%
from engram_numba.config import GATE_CLAMP

cap_ref = en.Pipeline(model, "reference").run(TINY_TOKENS, token_mask=TINY_MASK)

def gate_curve(x, clamp=GATE_CLAMP):
    # the gate as a function of dot, in float64 (for drawing)
    return 1.0 / (1.0 + np.exp(-np.copysign(np.sqrt(np.maximum(np.abs(x), clamp)), x)))

def gate_fp32(dot):
    # the gate exactly as every backend computes it: the signed sqrt in fp32, then the sigmoid
    # in float64 rounded once to fp32 (the correctly rounded sigmoid, so backends agree)
    g = np.copysign(np.sqrt(np.maximum(np.abs(dot), np.float32(GATE_CLAMP))), dot)
    return (1.0 / (1.0 + np.exp(-g.astype(np.float64)))).astype(np.float32)

live = cap_ref["tokens.mask"]
for lid in cfg.layer_ids:                                # every captured gate lies on the curve
    dot, gate = cap_ref[f"L{lid}.gate.dot"], cap_ref[f"L{lid}.gate.gate"]      # [T, hc] fp32
    assert np.array_equal(gate[live], gate_fp32(dot[live]))
    assert (gate[~live] == 0).all()                      # the dead token: gate 0 by definition
print("every live gate == sigmoid(signed sqrt(dot)) bit for bit; the dead token's gates are 0")

fig, (a, b) = plt.subplots(1, 2, figsize=(12, 3.8), layout="constrained")
dots = np.concatenate([cap_ref[f"L{lid}.gate.dot"][live].ravel() for lid in cfg.layer_ids])
span = max(3.0, float(np.abs(dots).max()) * 1.1)
xs = np.linspace(-span, span, 2001)
a.plot(xs, gate_curve(xs), color="black", linewidth=1.0, label="sigmoid(sign(dot) sqrt|dot|)")
a.plot(xs, 1 / (1 + np.exp(-xs)), color="grey", linestyle="--", linewidth=0.8, label="plain sigmoid(dot)")
for lid in cfg.layer_ids:
    a.plot(cap_ref[f"L{lid}.gate.dot"][live].ravel(), cap_ref[f"L{lid}.gate.gate"][live].ravel(), "o", ms=4,
           alpha=0.7, label=f"L{lid}: the tiny run's tokens x streams")
a.set_xlabel("dot")
a.set_ylabel("gate")
a.legend(fontsize=8)
a.grid(True, alpha=0.3)
a.set_title("the gate over the tiny run (synthetic tiny model)", fontsize=10)

zs = np.linspace(-4e-6, 4e-6, 4001)
b.plot(zs, gate_curve(zs, clamp=0.0), color="grey", linestyle="--", linewidth=0.8, label="no clamp")
b.plot(zs, gate_curve(zs), color="black", linewidth=1.2, label="clamp |dot| >= 1e-6")
b.axvspan(-GATE_CLAMP, GATE_CLAMP, color="tab:red", alpha=0.15, label="clamp region")
b.axhline(1 / (1 + np.exp(-1e-3)), color="tab:red", linewidth=0.6, linestyle=":")
b.set_xlabel("dot")
b.legend(fontsize=8, loc="upper left")
b.grid(True, alpha=0.3)
b.set_title("zoom on |dot| < 4e-6: the clamp holds the gate at 0.5 +- 2.5e-4", fontsize=10)
plt.show()

# %% [markdown]
# ## (e) One full step through `Pipeline`: reference against CUDA
#
# `en.Pipeline` runs hash -> rows -> proj -> gate for every engram layer with a backend per
# stage, and captures every stage boundary under a stable name (`L4.rows.raw`, `L4.rows.bf16`,
# `L4.proj.kv`, ...); `en.diff` then compares two runs point by point. Here both pipelines take
# one decode step, position 13 (token 8), after a prefill of positions 0..12 that only feeds the
# hash history. The highway is the pipeline's synthetic, fixed-seed N(0, 1) [T, hc, dim] array
# (this toolkit has no transformer blocks); layer 4's `highway.in` is layer 1's `highway.out`.
#
# The `cuda` backend runs through `en.EngramV41`: the tables uploaded once, rows gathered and
# decoded on the device, then the projection and gate kernels, each launcher taking its default
# version (the capture's `meta["cuda_kernels"]` names them). Every rows kernel is bit-exact; in
# the simulator the projection and gate launchers take their naive kernels, which keep the
# reference's summation order, so expect the two runs to agree bit for bit. On a GPU the fast
# versions run, and the diff shows ulp-sized differences from `proj.kv` on (notebook 02
# measures the fast kernels in the simulator). To pick versions by name, pass record names per stage, e.g.
# `en.Pipeline(model, "cuda", versions={"proj": "gemv_v3", "gate": "gate_v2"})`.

# %%
def prefilled_hasher():
    h = en.EngramHasher(tables)
    h.hash(TINY_TOKENS[:13], TINY_MASK[:13])            # positions 0..12, position 9 dead
    return h

step = TINY_TOKENS[13:14]                               # [1]: one decode step
cap_step_ref = en.Pipeline(model, "reference").run(step, hasher=prefilled_hasher())
t0 = time.perf_counter()
cap_step_gpu = en.Pipeline(model, "cuda").run(step, hasher=prefilled_hasher())
print(f"cuda step: {time.perf_counter() - t0:.1f} s; kernels: {cap_step_gpu.meta['cuda_kernels']}")
assert cap_step_gpu["L4.hash.ids"][0].tolist() == test_vector
for lid in cfg.layer_ids:
    print(f"L{lid} gate per stream  reference {cap_step_ref[f'L{lid}.gate.gate'][0]}  "
          f"cuda {cap_step_gpu[f'L{lid}.gate.gate'][0]}")
report = en.diff(cap_step_ref, cap_step_gpu)
report

# %% [markdown]
# Integer points (token ids, row ids, raw Q2_K bytes) must be equal, and the decoded rows too
# (bit-exact decode). From the projection on, the columns say how far apart two runs are in
# units that mean something: bf16 ulps for kv, fp32 ulps for the dot, the gate and the highway
# (docs/numerics.md, "How `diff` reports distances"). The plot draws the relative L2 error along
# the stages (top) and the share of elements that differ (bottom); a point equal in both runs is a
# hollow marker on the top panel's axis, which is where all of them are when the naive kernels ran.

# %%
top, bottom = report.plot()
top.set_title(top.get_title() + "\nsynthetic tiny model, one decode step", fontsize=9)
plt.show()
