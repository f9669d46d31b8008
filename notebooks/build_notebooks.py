"""Write the teaching notebooks of engram_numba, with their outputs stripped.

    python notebooks/build_notebooks.py            # rewrite notebooks/*.ipynb
    python notebooks/build_notebooks.py --out DIR  # write them somewhere else (the test does this)

The notebooks are generated, not hand-edited: change the cells here and rerun, so the committed
.ipynb files stay reviewable (no outputs, no execution counts, fixed cell ids) and
tests/test_notebooks.py can check that they are exactly what this script writes. CI executes them
with `pytest --nbmake notebooks/` under numba's CUDA simulator, so every cell that launches a
@cuda.jit kernel keeps to the tiny model's smallest shapes (one or two tokens).
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat import v4

HERE = Path(__file__).resolve().parent

KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


class Book:
    """Cells of one notebook, in order, with deterministic ids (nbformat draws random ones)."""

    def __init__(self, stem: str):
        self.stem = stem
        self.cells = []

    def _id(self) -> str:
        return f"{self.stem.split('_')[0]}-{len(self.cells):02d}"

    def md(self, text: str) -> None:
        self.cells.append(v4.new_markdown_cell(textwrap.dedent(text).strip("\n"), id=self._id()))

    def code(self, text: str) -> None:
        self.cells.append(v4.new_code_cell(textwrap.dedent(text).strip("\n"), id=self._id()))

    def notebook(self):
        nb = v4.new_notebook(cells=self.cells)
        nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}}
        nbformat.validate(nb)
        return nb


SETUP = """
import time

import matplotlib.pyplot as plt
import numpy as np

import engram_numba
from engram_numba.fixtures import TINY_MASK, TINY_TOKENS, tiny_model_path
from engram_numba.model_file import load_gguf

np.set_printoptions(linewidth=110)
model = load_gguf(tiny_model_path())
cfg, tables = model.config, model.hash_tables
print("@cuda.jit kernels run in numba's CUDA simulator:", engram_numba.SIMULATOR)
print(cfg)
print(f"hash columns C = {cfg.n_hash_cols}, projection K = C*256 = {cfg.proj_in}, "
      f"N = dim*(hc+1) = {cfg.proj_out}")
print("table rows per layer:", dict(zip(cfg.layer_ids, tables.table_rows.tolist())))
"""


# 01 -------------------------------------------------------------------------------------------

def walkthrough() -> Book:
    b = Book("01_engram_walkthrough")
    b.md("""
    # The Engram module of DeepSeek-V4.1-Flash, one stage at a time

    Engram is a *conditional memory*: before two of the transformer's blocks (layers 1 and 14 in the
    release), every position looks up rows of a huge table by hashing the last few tokens, projects
    them into a key per hyper-connection stream plus one shared value, and adds the value to each
    stream scaled by a gate that says how well the stream's state agrees with the key.

    ```
    token ids -> hash (CPU) -> row ids [T, layers, C]
              -> rows: Q2_K blocks [T*C, 84] -> dequant -> bf16 rows [T*C, 256]
              -> projection: kv = bf16(x @ wkv^T)        [T, (hc+1)*dim]
              -> gate: highway[t, c] += sigmoid(signed sqrt(dot)) * value[t]   [T, hc, dim] fp32
    ```

    This notebook walks the tiny model shipped in `data/` (the reference's own test configuration:
    engram layers 1 and 4, n-grams up to 4, 2 hash heads per order, so C = 6 hash columns; dim 64,
    hc 4 streams, 256 values a row) through every stage, each computed twice: by the numpy reference
    (`engram_numba.reference`, written to be read) and by the `@cuda.jit` kernel. Without a GPU the
    kernels run in numba's CUDA simulator, which executes every GPU thread as a Python thread: it
    is exact but slow, so the kernel cells use one token at a time. The released shapes are in
    the comments (dim 5120, C = 24, K = 6144, N = 25600).
    """)
    b.code(SETUP + """
from numba import cuda

from engram_numba import compare, q2k, reference
from engram_numba.bf16 import as_bfloat16, bf16_ulp_distance
from engram_numba.hash import EngramHasher
from engram_numba.kernels import dequant, projection
from engram_numba.pipeline import Pipeline
""")

    b.md("""
    ## (a) The hash: n-gram windows and dead tokens

    Each position p hashes its *window*: the current token and the `max_ngram_size - 1 = 3`
    tokens before it, `tok[s] = token at p - s`. Blocking is sticky: once the window reaches before
    the start of the sequence or a **dead** (masked) token, e.g. an image position, that slot and
    every older one take the pad id (2). So an n-gram never crosses a dead token, and a dead current
    token pads every slot.

    The window is folded with XOR of per-shift multiplier products; after step i the fold covers
    the (i+1)-gram, and each of its 2 heads reduces it modulo its own prime and adds the column's
    offset into the layer's table:
    ```
    rolling = tok[0]*m[0]
    for i in 1..3:   rolling ^= tok[i]*m[i];   row_id[(i-1)*heads + h] = rolling % P[i-1][h] + O[col]
    ```
    `EngramHasher` is the `@njit` version (it keeps the sequence's history, so decode steps look
    back into the prefill); `reference.hash_reference` is the plain-Python one it is tested against.
    The tiny sequence's position 13 must hash to the layer-4 ids `[14, 186, 216, 375, 492, 542]`
    (SPEC section 2). The golden run masks position 9.
    """)
    b.code("""
ids_plain = EngramHasher(tables).hash(TINY_TOKENS)                    # [T, L, C] int64, no mask
ids_masked = EngramHasher(tables).hash(TINY_TOKENS, TINY_MASK)        # position 9 dead
ids_ref = reference.hash_reference(tables, TINY_TOKENS, TINY_MASK)    # the readable version
assert np.array_equal(ids_masked, ids_ref)

li4 = cfg.layer_index(4)                  # layer id 4 is the second engram layer
spec_vector = [14, 186, 216, 375, 492, 542]
print("tokens   ", TINY_TOKENS.tolist())
print("live     ", TINY_MASK.astype(int).tolist())
print("ids shape", ids_masked.shape, "= [T, engram layers, hash columns]")
print("L4 row ids at position 13, no mask:", ids_plain[13, li4].tolist())
print("L4 row ids at position 13, masked: ", ids_masked[13, li4].tolist())
assert ids_plain[13, li4].tolist() == spec_vector == ids_masked[13, li4].tolist()
changed = np.flatnonzero((ids_plain != ids_masked).any(axis=(1, 2)))
print("positions whose ids the dead token changes:", changed.tolist())

# Prefill in chunks, then one decode step: the same ids as one call.
h = EngramHasher(tables)
parts = [h.hash(TINY_TOKENS[:5], TINY_MASK[:5]), h.hash(TINY_TOKENS[5:13], TINY_MASK[5:13]),
         h.hash(TINY_TOKENS[13:], TINY_MASK[13:])]
assert np.array_equal(np.concatenate(parts), ids_masked)
print("chunked prefill + decode step == one call: True")
""")
    b.md("""
    The dead token at position 9 changes exactly positions 9..12: position 9 itself (every slot
    padded) and the three positions whose 4-token windows reach back to it. Position 13's window
    (10..13) ends after the dead token, so it keeps the SPEC vector. The figure draws the windows
    of four positions: the start of the sequence, the dead token itself, a window cut by the dead
    token, and position 13. Hatched red cells are padded slots; the brackets under each window are
    the 2-, 3- and 4-gram that the hash columns of each order see.
    """)
    b.code("""
import matplotlib.patches as mpatches

from engram_numba.stats import ngram_windows

M, T = cfg.max_ngram_size, TINY_TOKENS.size
windows = ngram_windows(TINY_TOKENS, TINY_MASK, M, pad_id=tables.pad_id,
                        token_map=tables.token_map)          # [T, M]: column s = token s places back
show = {2: "sequence start: slot 3 is before position 0",
        9: "dead current token: every slot is pad",
        11: "window reaches the dead token: slots 2, 3 padded",
        13: "SPEC test vector"}
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
ax.set_title("Engram hash windows: slot s holds the token s places back; blocked slots (hatched) take "
             f"the pad id {tables.pad_id}; dashed = before the sequence start", fontsize=10)
plt.show()
""")
    b.md("""
    The fold itself at position 13 of layer 4, in Python integers. The multipliers are odd 64-bit
    numbers drawn from a generator seeded by the layer *id*, the primes are consecutive primes
    above the `engram_vocab_size` (64 in the tiny model, 16,000,000 in the release), and the
    offsets are their prefix sums, so each column owns a disjoint slice of the table.
    """)
    b.code("""
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
""")

    b.md("""
    ## (b) A Q2_K block becomes 256 values

    Each table row is one 84-byte Q2_K super-block holding 256 values in 16 sub-blocks of 16:

    | bytes | field | meaning |
    |---|---|---|
    | 0-15 | `scales` | one byte per sub-block: low nibble = scale code, high nibble = min code |
    | 16-79 | `qs` | 2-bit quants, four to a byte |
    | 80-81 | `d` | fp16 super-scale of the scale codes |
    | 82-83 | `dmin` | fp16 super-scale of the min codes |

    Value e (0..255): `n = e//128, w = e%128, j = w//32, h = (w%32)//16, l = w%16`;
    `sc = scales[8n + 2j + h]`, `q = (qs[32n + 16h + l] >> 2j) & 3`, and
    `y = d*(sc & 15)*q - dmin*(sc >> 4)` in fp32, then rounded to bf16 (nearest even) for the
    projection. Each sub-block therefore has only 4 possible values, an evenly spaced ladder.
    We take the row that position 13 reads for layer 4's first hash column.
    """)
    b.code("""
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
""")
    b.code("""
def decode_by_hand(block, e):
    \"\"\"Value e of one Q2_K block, step by step, in the reference's fp32 order.\"\"\"
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
""")
    b.md("""
    The whole row: each sub-block's 16 values sit on its own 4-rung ladder
    `scale*q - offset, q = 0..3` (faint lines). Two bits a value plus the per-sub-block codes and
    the two fp16 super-scales make 84 bytes = 2.625 bits a value.
    """)
    b.code("""
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
ax.set_title(f"layer-4 row {row_id}: 16 sub-blocks, 4 levels each (lines: scale*q - offset)", fontsize=10)
ax.grid(True, alpha=0.3)
plt.show()
""")
    b.md("""
    Now the `@cuda.jit` dequant kernel on this one block. `kernels/dequant.py` keeps every version
    (llm.c style, v1 = one thread per value, the teaching baseline; later versions decode a row
    with 8 lanes and wide loads). Each must give the reference's bf16 words bit for bit: the only
    rounding is the final fp32 -> bf16, and the kernels do the fp32 math in the same order with
    no FMA contraction.
    """)
    b.code("""
want = reference.rows_reference(block[None, :])          # [1, 256] bf16 words (uint16)
d_block = cuda.to_device(block[None, :])                 # [1, 84] uint8 on the device
for v in sorted(dequant.VERSIONS["dequant"]):
    got_v = dequant.dequant_q2k(d_block, version=v).copy_to_host()
    print(f"dequant kernel v{v}: bit-identical to the reference: {np.array_equal(got_v, want)}")
got = dequant.dequant_q2k(d_block).copy_to_host()      # the launcher's default version
assert np.array_equal(got, want)

print()
print("  e   fp32 value   reference bf16      kernel bf16")
for e in list(by_hand) + [1, 2, 3]:
    print(f"{e:>3}  {values[e]:+.6f}   0x{want[0, e]:04x} {float(as_bfloat16(want)[0, e]):+.5f}   "
          f"0x{got[0, e]:04x} {float(as_bfloat16(got)[0, e]):+.5f}")
""")
    b.md("""
    In the engine the table lives on the GPU and the kernel *gathers* rows by id
    (`gather_dequant_q2k`), so the 84-byte blocks never cross PCIe. Position 13's six layer-4 rows:
    """)
    b.code("""
row_ids = ids_masked[13, li4]                                     # [C] int64
rows_gpu = dequant.gather_dequant_q2k(cuda.to_device(np.ascontiguousarray(table4)), row_ids).copy_to_host()
rows_ref = reference.rows_reference(reference.gather_reference(table4, row_ids))   # [C, 256] bf16
print("gathered rows", rows_gpu.shape, "bit-identical:", np.array_equal(rows_gpu, rows_ref))
assert np.array_equal(rows_gpu, rows_ref)
""")

    b.md("""
    ## (c) The projection: kv = [hc keys | one shared value]

    A token's C rows are concatenated into x [K = C*256] (element `col*256 + d` is value d of its
    column-col row) and multiplied by `wkv` [N, K] with fp32 accumulation, then rounded once to
    bf16: `kv = bf16(x @ wkv^T)` [N = dim*(hc+1)]. The first hc*dim outputs are one key per
    hyper-connection stream, the last dim the value shared by all streams. The tiny model: K = 1536,
    N = 320 = 4 keys of 64 + a value of 64 (released: K = 6144, N = 25600, keys of 5120).
    """)
    b.code("""
x = reference.flatten_rows(rows_ref, 1)              # [1, K] bf16 words: one token
wkv = model.layers[4].wkv_bf16()                     # [N, K] bf16 words (decoded once from Q2_K)
kv_ref = reference.projection_reference(x, wkv)      # [1, N], fp32 sums in k order 0..K-1
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
plt.show()
""")
    b.md("""
    The CUDA projection of the same token. `kernels/projection.py` keeps numbered versions: GEMVs
    for a few tokens (one pass over the weight serves them all: decode is bound by reading the
    weight) and GEMMs for many. `projection.pick_version(T)` is the launcher's choice: on a GPU
    the fast versions; in the simulator the naive ones (`gemv_v1`: one thread per output, a plain
    loop over k), because barriers, warp shuffles and the tensor-core twin are what the
    simulator is slowest at. The naive kernels add in the reference's order and match it bit for
    bit; the fast ones split each sum across lanes, so they may land 1 bf16 ulp away where a sum
    sits near a rounding boundary. We run the launcher's choice and `gemv_v2`, a fast version
    (x staged in shared memory, weight rows streamed with 16-byte loads, one warp-shuffle
    reduction per output), which takes a few seconds here.
    """)
    b.code("""
x_dev, wkv_dev = cuda.to_device(x), cuda.to_device(wkv)
print("versions:", list(projection.VERSIONS), "| the launcher's choice at T = 1 here:", projection.pick_version(1))
kv_exact = reference.projection_exact(x, wkv)       # float64 sums, rounded once
print(f"reference vs float64-exact: max {bf16_ulp_distance(kv_ref, kv_exact).max()} bf16 ulp")
kv_gpu = {}
for version in dict.fromkeys([projection.pick_version(1), "gemv_v2"]):
    t0 = time.perf_counter()
    kv_gpu[version] = projection.project(x_dev, wkv_dev, version=version).copy_to_host()   # [1, N]
    ulps = bf16_ulp_distance(kv_ref, kv_gpu[version])
    print(f"{version:>8}: {time.perf_counter() - t0:5.1f} s; vs reference max {ulps.max()} bf16 ulp, "
          f"{np.count_nonzero(ulps)} of {ulps.size} outputs differ")
key, value = reference.split_kv(kv_gpu["gemv_v2"], hc)     # [1, hc, dim], [1, dim]
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
ax.set_title("layer 4, position 13: kv from the reference and the CUDA kernels", fontsize=10)
ax.legend(fontsize=8, loc="lower right")
plt.show()
""")

    b.md("""
    ## (d) The gate: sigmoid of a signed square root, with a clamp

    For token t and stream c (over d in 0..dim-1, in fp32), with `w = q_weight[c] * k_weight[c]`:
    ```
    dot  = sum(h*w*k) * rsqrt(mean(h*h) + eps) * rsqrt(mean(k*k) + eps) / sqrt(dim)
    gate = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot))        (0 for a dead token)
    highway[t, c] = h + gate * value[t]
    ```
    dot is a cosine-like agreement between the stream and its key (scaled by w). The signed square
    root flattens large |dot| and is infinitely steep at 0; the clamp `max(|dot|, 1e-6)` caps that
    slope, so in `|dot| < 1e-6` the gate sits at sigmoid(+-1e-3) = 0.50025 / 0.49975. The dots
    are those of the reference run of the whole tiny sequence (14 tokens x 4 streams x 2 layers).
    """)
    b.code("""
from engram_numba.config import GATE_CLAMP

cap_ref = Pipeline(model, backends="reference").run(TINY_TOKENS, token_mask=TINY_MASK)

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
a.set_title("the gate over the tiny run", fontsize=10)

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
""")

    b.md("""
    ## (e) One full step through `Pipeline`: reference against CUDA

    `Pipeline` runs hash -> rows -> proj -> gate for every engram layer with a backend per stage,
    and captures every stage boundary under a stable name (`L4.rows.bf16`, `L4.proj.kv`, ...);
    `compare.diff` then compares two runs point by point. Here both pipelines take one decode
    step, position 13 (token 8), after a prefill of positions 0..12 that only feeds the hash
    history. The highway is a fixed-seed N(0, 1) [T, hc, dim] array (this toolkit has no
    transformer blocks); layer 4's `highway.in` is layer 1's `highway.out`.

    The CUDA backend runs through `gpu.EngramV41`: the tables uploaded once, rows gathered and
    dequantised on the device, then the projection and gate kernels, each launcher taking its
    default version. In the simulator those are the naive kernels, which keep the reference's
    summation order, so expect the two runs to agree bit for bit; on a GPU the fast versions
    run, and the diff shows ulp-sized differences from `proj.kv` on (notebook 02 measures the
    fast kernels in the simulator).
    """)
    b.code("""
def prefilled_hasher():
    h = EngramHasher(tables)
    h.hash(TINY_TOKENS[:13], TINY_MASK[:13])            # positions 0..12, position 9 dead
    return h

step = TINY_TOKENS[13:14]                               # [1]: one decode step
cap_step_ref = Pipeline(model, backends="reference").run(step, hasher=prefilled_hasher())
t0 = time.perf_counter()
cap_step_gpu = Pipeline(model, backends="cuda").run(step, hasher=prefilled_hasher())
print(f"cuda step: {time.perf_counter() - t0:.1f} s")
assert cap_step_gpu["L4.hash.ids"][0].tolist() == spec_vector
for lid in cfg.layer_ids:
    print(f"L{lid} gate per stream  reference {cap_step_ref[f'L{lid}.gate.gate'][0]}  "
          f"cuda {cap_step_gpu[f'L{lid}.gate.gate'][0]}")
report = compare.diff(cap_step_ref, cap_step_gpu)
report
""")
    b.md("""
    Integer points (token ids, row ids, raw Q2_K bytes) must be equal, and the dequantised rows too
    (bit-exact decode). From the projection on, the columns say how far apart two runs are in
    units that mean something: bf16 ulps for kv, fp32 ulps for the dot, the gate and the highway.
    The plot draws the relative L2 error along the stages; exact points sit on the floor (1e-12),
    which is where all of them are when the naive kernels ran.
    """)
    b.code("""
report.plot()
plt.show()
""")
    return b


# 02 -------------------------------------------------------------------------------------------

def stage_diff() -> Book:
    b = Book("02_stage_diff")
    b.md("""
    # Stage-by-stage differences: backends, residual precision, and the Q2_K round trip

    Every Engram stage exists in three backends with one signature: `reference` (numpy, fixed
    summation order), `cpu` (`@njit`) and `cuda` (`@cuda.jit`, here in numba's simulator).
    `Pipeline` captures each stage boundary under a stable name and `compare.diff` measures two
    runs point by point. This notebook asks four questions on the tiny model:

    1. how far apart are the three backends, stage by stage?
    2. what does DeepSeek's bf16 residual change against the engine's fp32 highway?
    3. how large are the projection's summation-order differences, in bf16 ulps?
    4. what does the Q2_K quantisation of the tables cost at the gate?
    """)
    b.code(SETUP + """
from engram_numba import compare, q2k, reference
from engram_numba.bf16 import bf16_to_f32, bf16_ulp_distance, f32_to_bf16
from engram_numba.hash import EngramHasher
from engram_numba.pipeline import Pipeline
""")
    b.md("""
    ## 1. reference vs cpu vs cuda

    The `cpu` backend accumulates in the reference's order (numba compiles without fast-math), so
    it should agree with the reference *bit for bit* at every point. The whole 14-token sequence,
    position 9 dead:
    """)
    b.code("""
cap_ref = Pipeline(model, backends="reference").run(TINY_TOKENS, token_mask=TINY_MASK)
cap_cpu = Pipeline(model, backends="cpu").run(TINY_TOKENS, token_mask=TINY_MASK)
report_cpu = compare.diff(cap_ref, cap_cpu)
print("cpu == reference at every point:", report_cpu.all_equal)
report_cpu
""")
    b.md("""
    The `cuda` backend, in the simulator, is exact but slow (every GPU thread is a Python thread),
    so it runs a two-token chunk: positions 12 and 13, continuing a hasher that has seen positions
    0..11 (the hash history is all a prefill leaves behind). All three backends run the same
    chunk. In the simulator every launcher defaults to its naive kernel (one thread per output,
    plain loops in the reference's order: the cheapest thing to simulate), so the cuda pipeline
    should match the reference bit for bit here; on a GPU the defaults are the fast kernels.
    """)
    b.code("""
def chunk_hasher():
    h = EngramHasher(tables)
    h.hash(TINY_TOKENS[:12], TINY_MASK[:12])
    return h

chunk = TINY_TOKENS[12:14]                                  # [2]
caps = {}
for backend in ("reference", "cpu", "cuda"):
    t0 = time.perf_counter()
    caps[backend] = Pipeline(model, backends=backend).run(chunk, hasher=chunk_hasher())
    print(f"{backend:>9}: {time.perf_counter() - t0:6.2f} s")
print("cpu == reference on the chunk: ", compare.diff(caps["reference"], caps["cpu"]).all_equal)
print("cuda == reference on the chunk:", compare.diff(caps["reference"], caps["cuda"]).all_equal)
compare.diff(caps["reference"], caps["cuda"])
""")
    b.md("""
    The fast kernels are what a GPU runs, so measure them too, stage by stage, on the same chunk:
    each kernel gets the *reference's* input to its stage (rows for the projection; kv and
    `highway.in` for the gate), so every row of the table below is that one kernel's own
    distance, not an accumulation. `gemv_v2` for the projection (x staged in shared memory,
    16-byte weight loads, a warp-shuffle reduction per output), gate v2 and v3 (16-byte loads,
    the three sums reduced by warp shuffles and shared memory). A few seconds each in the
    simulator.
    """)
    b.code("""
from numba import cuda

from engram_numba.kernels import gate as gate_kernels
from engram_numba.kernels import projection

ref = caps["reference"]
T2 = chunk.size
fast = {2: {}, 3: {}}                  # gate version -> {point: array}; both hold gemv_v2's kv
t0 = time.perf_counter()
for lid in cfg.layer_ids:
    layer = model.layers[lid]
    x = ref[f"L{lid}.rows.bf16"].reshape(T2, cfg.proj_in)                # [T, K] bf16 words
    kv = projection.project(cuda.to_device(x), cuda.to_device(layer.wkv_bf16()), version="gemv_v2")
    w = cuda.to_device((layer.q_weight * layer.k_weight).astype(np.float32))   # [hc, dim]
    for v in fast:
        d_highway = cuda.to_device(ref[f"L{lid}.highway.in"])              # [T, hc, dim], updated in place
        dot, gate = (cuda.device_array((T2, cfg.hc), np.float32) for _ in range(2))
        gate_kernels.engram_v41_gate(d_highway, cuda.to_device(ref[f"L{lid}.proj.kv"]), w,
                                     dot_out=dot, gate_out=gate, version=v)
        fast[v].update({f"L{lid}.proj.kv": kv.copy_to_host(), f"L{lid}.gate.dot": dot.copy_to_host(),
                        f"L{lid}.gate.gate": gate.copy_to_host(), f"L{lid}.highway.out": d_highway.copy_to_host()})
print(f"fast kernels on the chunk: {time.perf_counter() - t0:.1f} s")
for v in fast:
    print(compare.diff(ref, fast[v], names=list(fast[v]), label_a="reference", label_b=f"gemv_v2 + gate v{v}"))
    print()
""")
    b.md("""
    Each fast kernel's own distance: kv within a bf16 ulp of the reference (usually exactly on
    it), the dot within a few fp32 ulps (it is a normalised sum, and a dot near zero is a sum
    that cancels, so its ulps are small), the gate, a float64 sigmoid rounded once, by at most
    an ulp or so, and `highway.out` only where the gate moved. In a real pipeline these add up
    from stage to stage and layer to layer, which is what the `diff` of two whole runs on a GPU
    shows. The error along the stages:
    """)
    b.code("""
report_fast = compare.diff(ref, fast[3], names=list(fast[3]), label_a="reference", label_b="gemv_v2 + gate v3")
fig, axes = plt.subplots(1, 2, figsize=(13, 3.8), layout="constrained")
report_fast.plot(ax=axes[0])
report_fast.plot(ax=axes[1], metric="max_ulp")
axes[1].set_ylabel("max ulp (bf16 for kv, fp32 after)")
plt.show()
""")

    b.md("""
    ## 2. fp32 highway (engine) vs bf16 residual (DeepSeek's reference)

    Engines keep the highway in fp32 and update it in place. DeepSeek's reference keeps it in bf16:
    h is rounded to bf16 before the gate reads it, and `h + gate*value` is rounded back to bf16.
    The gate itself moves a little (its dot sees the rounded h); the highway moves by about one
    bf16 rounding per update. Dead tokens are not written in either mode.
    """)
    b.code("""
cap_bf16 = Pipeline(model, backends="reference", residual="bf16").run(TINY_TOKENS, token_mask=TINY_MASK)
report_res = compare.diff(cap_ref, cap_bf16, label_a="fp32 residual", label_b="bf16 residual")
for lid in cfg.layer_ids:
    dg = np.abs(cap_ref[f"L{lid}.gate.gate"] - cap_bf16[f"L{lid}.gate.gate"])
    print(f"L{lid}: max |gate difference| {dg.max():.2e}")
report_res
""")
    b.md("""
    The per-element highway difference in **bf16 ulps**, two ways. Left: the signed difference
    (fp32 result minus bf16 result) divided by the bf16 ulp at the bf16 result's magnitude; the
    two roundings of the bf16 path (h on the way in, the sum on the way out) give a spread of
    about +-1 ulp. Right: if the engine rounded its fp32 highway to bf16 at the end, how many
    bf16 ulps from DeepSeek's value would it be? Mostly 0 or 1, with a thin tail that needs a
    log axis: where `h + gate*value` nearly cancels, the result is much smaller than h, and an
    error of one ulp *of h* (made by rounding h on the way in) is many ulps *of the result*; a
    result that cancels to almost zero can even come out with the other sign in one mode, and
    counting ulps across zero adds up every tiny ulp in between. (In layer 1 every absolute
    difference stays below one bf16 ulp of the larger of |h| and |result|; layer 4 starts from
    inputs and gates that already differ, so it drifts further.)
    """)
    b.code("""
def bf16_ulp_at(v):
    # the spacing of bf16 numbers at |v| (8 significand bits)
    _, ex = np.frexp(np.abs(v).astype(np.float64))
    return np.ldexp(1.0, ex - 8)

edges = np.array([0, 1, 2, 3, 5, 9, 17, 33, 65, 129, 257, 513, 1025, 2 ** 31])    # ulp-distance bins
labels = ["0", "1", "2", "3-4", "5-8", "9-16", "17-32", "33-64", "65-128", "129-256", "257-512",
          "513-1024", ">1024"]
fig, (a, b) = plt.subplots(1, 2, figsize=(13, 3.8), layout="constrained")
live = cap_ref["tokens.mask"]
for i, lid in enumerate(cfg.layer_ids):
    h32 = cap_ref[f"L{lid}.highway.out"][live]               # [live T, hc, dim] fp32
    h16 = cap_bf16[f"L{lid}.highway.out"][live]              # bf16-exact values in fp32
    signed = ((h32.astype(np.float64) - h16) / bf16_ulp_at(h16)).ravel()
    a.hist(np.clip(signed, -3, 3), bins=np.linspace(-3, 3, 49), histtype="step", linewidth=1.5,
           label=f"L{lid}: {np.mean(np.abs(signed) <= 1):.1%} within +-1 ulp")
    dist = bf16_ulp_distance(f32_to_bf16(h32), f32_to_bf16(h16))     # [live T, hc, dim] int
    counts = np.histogram(dist, bins=edges)[0]
    b.bar(np.arange(len(labels)) + (i - 0.5) * 0.38, counts, width=0.38, label=f"L{lid}")
    w = np.unravel_index(np.argmax(dist), dist.shape)
    h_in = cap_ref[f"L{lid}.highway.in"][live][w]
    print(f"L{lid}: {dist.size} elements; 0 ulp {np.mean(dist == 0):.1%}, 1 ulp {np.mean(dist == 1):.1%}, "
          f">= 2 ulp {np.mean(dist >= 2):.1%}; the largest, {dist.max()} ulp: h = {h_in:+.4f} -> "
          f"fp32 {h32[w]:+.3e} / bf16 {h16[w]:+.3e} (absolute difference {abs(h32[w] - h16[w]):.1e}, "
          f"one bf16 ulp of h is {bf16_ulp_at(h_in):.1e})")
a.set_xlabel("(fp32 - bf16) / bf16 ulp of the result (clipped to +-3)")
a.set_ylabel("elements")
a.set_title("highway.out, fp32 vs bf16 residual", fontsize=10)
a.legend(fontsize=8)
b.set_xticks(range(len(labels)), labels, rotation=40, fontsize=8)
b.set_xlabel("bf16 ulps between bf16(fp32 highway) and the bf16 highway")
b.set_yscale("log")
b.set_title("after rounding the engine's highway to bf16 (log counts)", fontsize=10)
b.legend()
plt.show()
""")

    b.md("""
    ## 3. The projection's summation order, in bf16 ulps

    Every bf16 x bf16 product is exact in fp32, so the only rounding in `kv = bf16(x @ wkv^T)` is
    in the fp32 sums (and the final rounding to bf16). Different summation orders therefore give
    kv values at most a few bf16 ulps apart, usually 0. Two comparisons:
    * the reference (sequential fp32 sum over k = 0..K-1) against `reference.projection_exact`
      (float64 sums, rounded once): how far the fixed fp32 order is from the order-free answer, over
      the whole sequence;
    * the reference against the fast CUDA kernel `gemv_v2` (the 2-token chunk above).
    """)
    b.code("""
fig, axes = plt.subplots(1, 2, figsize=(12, 3.6), layout="constrained")
T = TINY_TOKENS.size
for i, lid in enumerate(cfg.layer_ids):
    wkv = model.layers[lid].wkv_bf16()                                   # [N, K] bf16 words
    x = cap_ref[f"L{lid}.rows.bf16"].reshape(T, cfg.proj_in)             # [T, K]
    exact = reference.projection_exact(x, wkv)                           # [T, N]
    pairs = ((axes[0], bf16_ulp_distance(cap_ref[f"L{lid}.proj.kv"], exact)),
             (axes[1], bf16_ulp_distance(ref[f"L{lid}.proj.kv"], fast[3][f"L{lid}.proj.kv"])))
    for ax, dist in pairs:
        counts = np.bincount(dist.ravel(), minlength=3)
        ax.bar(np.arange(counts.size) + (i - 0.5) * 0.38, counts, width=0.38, label=f"L{lid} ({dist.size} values)")
    print(f"L{lid}: reference vs exact max {pairs[0][1].max()} ulp ({np.count_nonzero(pairs[0][1])} differ); "
          f"reference vs gemv_v2 max {pairs[1][1].max()} ulp ({np.count_nonzero(pairs[1][1])} differ)")
axes[0].set_title("proj.kv: reference fp32 order vs float64-exact", fontsize=10)
axes[1].set_title("proj.kv: reference vs CUDA gemv_v2 (2-token chunk)", fontsize=10)
for ax in axes:
    ax.set_yscale("log")
    ax.set_xlabel("bf16 ulps apart")
    ax.legend(fontsize=8)
axes[0].set_ylabel("kv values")
plt.show()
""")

    b.md("""
    ## 4. What the Q2_K round trip costs at the gate

    The published GGUF stores the tables as Q2_K: 2.625 bits a value. To see what that costs, we
    need the rows *before* quantisation. The tiny model's tables were made by
    `fixtures.build_tiny_layers` as `q2k.quantize` of `fixtures.tiny_float_weights(...)` (heavy-tailed
    rows with per-row scales, like trained embeddings), which gives us those original float rows; we
    check they quantise to exactly the bytes in the file, so "exact" below really is the tiny model
    without its Q2_K rounding.
    (The released checkpoint's own tables are FP8 e4m3 with per-32 scales: a Q2_K GGUF is a
    re-quantisation of those.)
    """)
    b.code("""
from engram_numba import fixtures

weights = fixtures.tiny_float_weights(fixtures.tiny_config(), fixtures.tiny_hash_tables())
originals = {}
for li, lid in enumerate(cfg.layer_ids):
    n_rows = int(tables.table_rows[li])
    originals[lid] = weights[lid]["table_rows"]                          # [rows, 256] fp32
    assert np.array_equal(q2k.quantize(originals[lid]), model.layers[lid].table)   # the file's bytes
    dq = q2k.dequantize(model.layers[lid].table)
    rel = np.linalg.norm(dq - originals[lid]) / np.linalg.norm(originals[lid])
    print(f"L{lid}: {n_rows} original rows recovered; Q2_K relative RMS error of the table {rel:.3f}")
""")
    b.md("""
    A hook on `L{id}.rows.bf16` replaces the dequantised Q2_K rows with the original rows rounded
    to bf16 (a hook on `L{id}.hash.ids` fires first and tells it which rows). Everything after
    the rows (projection, gate) then runs on exact rows. To measure each layer on its own, each
    layer gets the same fixed highway in both runs (a dict `{layer_id: highway}`); otherwise layer
    4 would also see layer 1's changes. 1,000 random tokens, `cpu` backend (bit-identical to the
    reference, and fast).
    """)
    b.code("""
rng = np.random.default_rng(2026)
tokens = rng.integers(0, tables.token_map.size, size=1000)           # [T]
pipe = Pipeline(model, backends="cpu")
highway = {lid: pipe.default_highway(tokens.size, seed=li) for li, lid in enumerate(cfg.layer_ids)}
exact_rows = {lid: f32_to_bf16(originals[lid]) for lid in cfg.layer_ids}   # [rows, 256] bf16 words

def exact_rows_hooks(lid):
    seen = {}
    def ids_hook(ids, name):              # [T, C] row ids of this layer: observe
        seen["ids"] = ids
    def rows_hook(rows, name):            # [T*C, 256] Q2_K rows -> the unquantised rows, same ids
        return exact_rows[lid][seen["ids"].reshape(-1)]
    return {f"L{lid}.hash.ids": ids_hook, f"L{lid}.rows.bf16": rows_hook}

names = lambda n: n.split(".", 1)[-1] in ("ids", "mask", "rows.bf16", "proj.kv", "gate.dot", "gate.gate",
                                          "highway.out", "highway.in", "hash.ids")
t0 = time.perf_counter()
cap_q2k = pipe.run(tokens, highway=highway, names_filter=names)
hooks = {}
for lid in cfg.layer_ids:
    hooks.update(exact_rows_hooks(lid))
with pipe.hooks(hooks):
    cap_exact = pipe.run(tokens, highway=highway, names_filter=names)
print(f"two runs of {tokens.size} tokens: {time.perf_counter() - t0:.1f} s")
report_q = compare.diff(cap_exact, cap_q2k, label_a="exact rows", label_b="Q2_K rows")
report_q
""")
    b.md("""
    Reading the table: the error enters at the rows (Q2_K's ~29 % relative RMS error on these
    heavy-tailed rows) and passes through the projection at the same relative size: the
    projection is linear and the quantisation errors of different values are independent, so kv
    carries the same fraction of error as its input. The dot (a normalised inner product with
    the key) inherits it too. The gate then squashes it: its relative L2 change is about half
    that of the dot. The gate differences, as a distribution:
    """)
    b.code("""
fig, axes = plt.subplots(1, 3, figsize=(14, 3.8), layout="constrained")
for lid in cfg.layer_ids:
    g_exact = cap_exact[f"L{lid}.gate.gate"].ravel()
    g_q2k = cap_q2k[f"L{lid}.gate.gate"].ravel()
    dg = g_q2k.astype(np.float64) - g_exact
    q = np.quantile(np.abs(dg), [0.5, 0.95, 1.0])
    print(f"L{lid}: gate  mean {g_exact.mean():.3f} (exact) / {g_q2k.mean():.3f} (Q2_K);  |difference| "
          f"median {q[0]:.4f}, 95% {q[1]:.4f}, max {q[2]:.4f};  mean difference {dg.mean():+.5f}")
    d_exact, d_q2k = cap_exact[f"L{lid}.gate.dot"].ravel(), cap_q2k[f"L{lid}.gate.dot"].ravel()
    flip = np.sign(d_exact) != np.sign(d_q2k)
    print(f"     the dot changed sign for {flip.mean():.1%} of tokens x streams; they are "
          f"{np.mean(flip[np.abs(dg) > 0.1]):.0%} of the gate changes above 0.1")
    axes[0].hist(dg, bins=60, histtype="step", linewidth=1.4, label=f"L{lid}")
    axes[1].plot(g_exact, g_q2k, ".", ms=2, alpha=0.4, label=f"L{lid}")
    d_exact = cap_exact[f"L{lid}.gate.dot"].ravel()
    axes[2].plot(d_exact, cap_q2k[f"L{lid}.gate.dot"].ravel() - d_exact, ".", ms=2, alpha=0.4, label=f"L{lid}")
axes[0].set_xlabel("gate(Q2_K rows) - gate(exact rows)")
axes[0].set_ylabel("tokens x streams")
axes[0].legend()
axes[1].plot([0, 1], [0, 1], color="black", linewidth=0.6)
axes[1].set_xlabel("gate, exact rows")
axes[1].set_ylabel("gate, Q2_K rows")
axes[1].legend()
axes[2].set_xlabel("dot, exact rows")
axes[2].set_ylabel("dot difference (Q2_K - exact)")
axes[2].legend()
for ax in axes:
    ax.grid(True, alpha=0.3)
fig.suptitle("what the Q2_K table costs at the gate (same highway per layer in both runs)", fontsize=11)
plt.show()
""")
    b.md("""
    The two off-diagonal clouds in the middle panel are the tokens whose dot changed sign. The
    signed square root is infinitely steep at 0 (only the 1e-6 clamp bounds it), so a dot near 0
    that the quantisation error pushes across zero moves the gate from one side of 0.5 to the
    other: those few sign flips make most of the large gate differences, while elsewhere the
    flattening of `sqrt` keeps the gate error well below the dot error. The error along the
    stages, per layer (both layers see the same kind of rows, so they look alike):
    """)
    b.code("""
report_q.plot()
plt.show()
""")
    return b


# 03 -------------------------------------------------------------------------------------------

def gate_statistics() -> Book:
    b = Book("03_gate_statistics")
    b.md("""
    # Gate statistics over a long token stream

    How does the gate behave per layer and per hyper-connection stream over thousands of tokens,
    and how hard are the tiny model's small tables used? This notebook runs the `cpu` backend (the
    `@njit` stages, bit-identical to the numpy reference) on a 4,000-token stream. The `cuda`
    backend computes the same captures on a GPU (`Pipeline(model, backends="cuda")`); in numba's
    simulator it would take hours at this length, so it is not used here.

    The stream has structure, as text does: a small set of recurring phrases (so the same n-grams
    come back many times, and hash to the same rows every time), random filler between them, and a
    few dead spans (masked positions, as an image would be).
    """)
    b.code(SETUP + """
from engram_numba import plots, stats
from engram_numba.pipeline import Pipeline
""")
    b.code("""
def make_stream(n_tokens, seed=11, vocab=64):
    \"\"\"Token ids [n] and a live mask [n]: recurring phrases (Zipf-like frequencies), random filler,
    and a dead span now and then.\"\"\"
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, vocab, size=int(rng.integers(3, 9))) for _ in range(20)]
    weight = 1.0 / np.arange(1, len(phrases) + 1)
    weight /= weight.sum()
    ids, live = [], []
    while len(ids) < n_tokens:
        r = rng.random()
        if r < 0.55:
            piece, ok = phrases[rng.choice(len(phrases), p=weight)], True
        elif r < 0.98:
            piece, ok = rng.integers(0, vocab, size=int(rng.integers(1, 7))), True
        else:
            piece, ok = rng.integers(0, vocab, size=int(rng.integers(4, 13))), False
        ids.extend(int(v) for v in piece)
        live.extend([ok] * len(piece))
    return np.array(ids[:n_tokens], dtype=np.int64), np.array(live[:n_tokens], dtype=bool)

tokens, mask = make_stream(4000)
n_spans = int(np.count_nonzero(np.diff(np.concatenate([[1], mask.astype(np.int8)])) == -1))
print(f"{tokens.size} tokens, {int((~mask).sum())} dead in {n_spans} spans; first tokens {tokens[:24].tolist()}")
""")
    b.md("""
    One run, every engram layer. We keep only the points the statistics read (`tokens.*`,
    `L{id}.hash.ids`, `L{id}.gate.dot`, `L{id}.gate.gate`) through `names_filter`, which keeps
    the capture small. The highway entering each layer is a fixed-seed N(0, 1) array: without the
    transformer blocks there is no real residual stream, so what the gate sees of `h` here is
    noise, except that layer 4's input is layer 1's output, which has layer 1's value added.
    """)
    b.code("""
pipe = Pipeline(model, backends="cpu")
keep = ["tokens.ids", "tokens.mask"] + [f"L{lid}.{p}" for lid in cfg.layer_ids
                                       for p in ("hash.ids", "gate.dot", "gate.gate")]
t0 = time.perf_counter()
cap = pipe.run(tokens, token_mask=mask, names_filter=keep)
print(f"cpu backend, {tokens.size} tokens, {cfg.n_layers} layers: {time.perf_counter() - t0:.1f} s")
print(sorted(cap))
""")
    b.md("""
    ## The gate per layer and stream

    `stats.gate_stats` summarises every (layer, stream) over live tokens only: dead tokens have a
    gate of exactly 0 by definition, which is not a measurement, so they are counted apart (and a
    dead token with a non-zero gate would be flagged as a backend bug). `clamp%` is the share of
    tokens whose |dot| fell inside the 1e-6 clamp.
    """)
    b.code("""
st = stats.gate_stats(cap)
st
""")
    b.md("""
    A window of the stream as a heatmap: streams down, tokens across, one panel per layer, with a
    dead span hatched. Tokens inside a recurring phrase read the same rows each time the phrase
    comes back, yet their gates differ from one occurrence to the next, because the gate also
    depends on the stream's state `h`.
    """)
    b.code("""
dead_start = int(np.flatnonzero(~mask)[0])
a, z = max(0, dead_start - 24), max(0, dead_start - 24) + 48            # a 48-token window
window = {"tokens.ids": cap["tokens.ids"][a:z], "tokens.mask": cap["tokens.mask"][a:z]}
for lid in cfg.layer_ids:
    for p in ("gate.gate", "gate.dot"):
        window[f"L{lid}.{p}"] = cap[f"L{lid}.{p}"][a:z]
fig = plots.gate_heatmap(window)
fig.suptitle(f"tokens {a}..{z - 1} (labels: token ids)", fontsize=10)
plt.show()
""")
    b.code("""
fig = plots.gate_histogram(cap, bins=40)
plt.show()
""")
    b.md("""
    Two humps with a hole at 0.5, in every stream: that is the signed square root at work. The dot
    itself is spread around 0 like a bell (mean |dot| ~0.8 in the table), but `g = sign(dot) *
    sqrt(|dot|)` pulls small dots away from 0 (a dot of 0.01 becomes g = 0.1), so the density of
    g vanishes at 0 (it is 2|g| times the dot's density at g^2) and the gate rarely sits near 0.5.
    Each token-stream is pushed towards "mostly take the value" or "mostly leave it"; the humps sit
    near sigmoid(+-1) ~ 0.27 / 0.73, where |dot| ~ 1.
    """)
    b.md("""
    Every gate lies on the curve `sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))` (a check of the
    backend as much as a picture). The second plot uses a symmetric-log axis, linear inside
    |dot| < 1e-6, so the clamp region appears at its true place.
    """)
    b.code("""
fig = plots.gate_vs_dot(cap)
plt.show()
fig = plots.gate_vs_dot(cap, xscale="symlog")
plt.show()
""")
    b.md("""
    How much of the gate is decided by the *context* (the rows read, hence the key and the value)
    and how much by the stream state? Tokens with equal row ids in every column read identical
    rows and so get identical keys. Take the tokens whose context recurs at least 5 times, split
    their gate variance into a between-context and a within-context part, and compare the
    between-context share with what shuffling the gates across those tokens gives (the share that
    groups of these sizes explain by chance). Layer 1's input highway is random, independent of
    the tokens, and the normalised dot of a random direction with a fixed key does not depend on
    the key, so there the context should explain no more than chance. Layer 4 reads layer 1's
    *output*, `h + gate * value`, and layer 1's value is itself a function of the context.
    """)
    b.code("""
def between_share(gate, group):
    \"\"\"Share of the variance of gate [n, hc] explained by group [n] (0..k-1) means, per stream.\"\"\"
    counts = np.bincount(group)
    means = np.stack([np.bincount(group, weights=gate[:, c]) for c in range(gate.shape[1])], axis=1)
    means /= np.maximum(counts, 1)[:, None]
    return ((means[group] - gate.mean(axis=0)) ** 2).mean(axis=0) / gate.var(axis=0)

rng = np.random.default_rng(0)
live = cap["tokens.mask"]
for lid in cfg.layer_ids:
    ids = cap[f"L{lid}.hash.ids"][live]                                  # [live T, C]
    gate = cap[f"L{lid}.gate.gate"][live].astype(np.float64)             # [live T, hc]
    _, group, counts = np.unique(ids, axis=0, return_inverse=True, return_counts=True)
    group = group.ravel()
    recurring = counts[group] >= 5
    _, grp = np.unique(group[recurring], return_inverse=True)
    g = gate[recurring]
    share = between_share(g, grp)
    chance = np.mean([between_share(g[rng.permutation(len(g))], grp) for _ in range(50)], axis=0)
    print(f"L{lid}: {counts.size} distinct contexts over {int(live.sum())} live tokens; "
          f"{int((counts >= 5).sum())} recur >= 5 times ({int(recurring.sum())} tokens)")
    print(f"     between-context share of gate variance per stream: {np.round(share, 3)}; "
          f"by chance (shuffled): {np.round(chance, 3)}")
""")
    b.md("""
    Layer 1 sits at chance; layer 4 clearly above it. The state entering layer 4 already holds
    layer 1's value for the same context, so the state "knows" the context and its dot with
    layer 4's key is no longer independent of it: a first glimpse of how stacked Engram layers
    (and, in the real model, the blocks between them) make the gate context-dependent. To check
    that this is the mechanism, run again with layer 4 fed its own independent random highway
    instead of layer 1's output (a dict `{layer_id: highway}`):
    """)
    b.code("""
own = {lid: pipe.default_highway(tokens.size, seed=100 + i) for i, lid in enumerate(cfg.layer_ids)}
cap_own = pipe.run(tokens, token_mask=mask, highway=own, names_filter=keep)
ids = cap_own["L4.hash.ids"][live]
_, group, counts = np.unique(ids, axis=0, return_inverse=True, return_counts=True)
group = group.ravel()
recurring = counts[group] >= 5
_, grp = np.unique(group[recurring], return_inverse=True)
g = cap_own["L4.gate.gate"][live][recurring].astype(np.float64)
chance = np.mean([between_share(g[rng.permutation(len(g))], grp) for _ in range(50)], axis=0)
print(f"L4 with an independent random highway: between-context share {np.round(between_share(g, grp), 3)}; "
      f"by chance {np.round(chance, 3)}")
""")
    b.md("""
    ## Row-id reuse and hash collisions

    Each hash column reduces its n-gram modulo a prime, so it has only that many rows: 67 to 79
    for layer 1, 97 to 113 for layer 4 (about 16 million per column in the release). A stream
    with many distinct n-grams must make several of them share a row, a *collision*: the model
    cannot tell those contexts apart in that column. Using several heads per order with different
    primes is what keeps two contexts from colliding everywhere at once.

    `stats.row_id_reuse` rebuilds every position's n-gram window from the tokens and the mask
    (exactly as the hasher does, given the hash tables) and counts, per column: tokens, distinct
    contexts, distinct row ids, and collisions (contexts that lost their own row).
    """)
    b.code("""
reuse = stats.row_id_reuse(cap, tables=tables)
print(reuse)
""")
    b.code("""
fig = plots.row_id_reuse_plot(reuse)
plt.show()
""")
    b.md("""
    Each column collides heavily, so what does a context keep? It reads one row per head, and
    the *pair* of rows from the two heads of its order is what the projection sees. If the heads
    hash independently, the pair behaves like one table of P0 x P1 rows, and n contexts thrown
    at random into N cells fill about N(1 - exp(-n/N)) of them.
    """)
    b.code("""
for lid in cfg.layer_ids:
    li = cfg.layer_index(lid)
    ids = cap[f"L{lid}.hash.ids"][live]                                  # [live T, C]
    windows = stats.ngram_windows(cap["tokens.ids"], cap["tokens.mask"], cfg.max_ngram_size,
                                  pad_id=tables.pad_id, token_map=tables.token_map)[live]   # [live T, M]
    for order in range(2, cfg.max_ngram_size + 1):
        heads = [c for c in range(cfg.n_hash_cols) if c // tables.n_heads + 2 == order]
        _, first = np.unique(windows[:, :order], axis=0, return_index=True)   # one token per context
        n_ctx = first.size
        pairs = np.unique(ids[first][:, heads], axis=0).shape[0]
        primes = [int(p) for p in tables.primes[li, order - 2]]
        cells = int(np.prod(primes))
        expect = cells * (1 - np.exp(-n_ctx / cells))
        print(f"L{lid} {order}-gram: {n_ctx:>4} contexts; rows per head {primes}; distinct row pairs "
              f"{pairs:>4} (independent heads predict {expect:6.0f} of {cells} cells)")
""")
    b.md("""
    Reading the figures:

    * **Columns.** Every column uses all of its rows (distinct ids = its prime), and each holds far
      more distinct contexts than rows, so most contexts share their row with others: the
      orange bars stop at the prime, the blue ones do not. This is the tiny model's doing; the
      release has ~16 million rows a column, and a column collides rarely.
    * **Heads.** The two heads of an order hash independently: the number of distinct row pairs
      matches the random-throw prediction. A context keeps a pair of its own unless it meets a
      birthday collision in a P0 x P1 table, which is why Engram uses several heads per order
      rather than one bigger table per order.
    * **Orders.** Higher orders see more distinct contexts (the recurring phrases keep them from
      growing without bound), so they collide more in the same few rows.
    * **Reuse.** `max reuse` mixes two causes: repetition in the text (the recurring phrases, one
      context read many times, which the hash keeps together by design) and collisions (many
      contexts in one row). `contexts` against `tokens` measures the first, `ids` against
      `contexts` the second.
    * **Gate.** With a random highway the gate is bimodal around 0.5 in every stream (the signed
      square root empties the middle) and lies exactly on its curve; the clamp region is never
      hit (`clamp%` 0). The streams of one layer behave alike, since only their own q/k weights
      tell them apart. The context explains no more of layer 1's gate than chance (a random
      state does not know the key), but clearly more of layer 4's, whose state carries layer
      1's value for that context.
    """)
    return b


BOOKS = {
    "01_engram_walkthrough": walkthrough,
    "02_stage_diff": stage_diff,
    "03_gate_statistics": gate_statistics,
}


def build(out_dir: Path = HERE) -> list[Path]:
    """Write every notebook into out_dir; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for stem, make in BOOKS.items():
        path = out_dir / f"{stem}.ipynb"
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            nbformat.write(make().notebook(), f)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=HERE, help="folder to write the notebooks into")
    args = ap.parse_args(argv)
    for path in build(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
