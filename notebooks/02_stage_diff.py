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
# # Stage-by-stage differences: backends, residual precision, and the Q2_K round trip
#
# Every Engram stage exists in three backends with one signature: `reference` (numpy, fixed
# summation order), `cpu` (`@njit`) and `cuda` (`@cuda.jit`, here in numba's simulator).
# `en.Pipeline` captures each stage boundary under a stable name and `en.diff` measures two
# runs point by point. This notebook asks four questions on the tiny model in `data/` (the
# reference's test configuration with synthetic weights: random draws shaped like trained
# weights, so every number and figure here is of that synthetic model, not of DeepSeek's):
#
# 1. how far apart are the three backends, stage by stage?
# 2. what does DeepSeek's bf16 residual change against the engine's fp32 highway?
# 3. how large are the projection's summation-order differences, in bf16 ulps?
# 4. what does the Q2_K quantisation of the tables cost at the gate?
#
# docs/numerics.md says which stages are exact and how `diff` reports distances.

# %%
import time

import matplotlib.pyplot as plt
import numpy as np

import engram_numba as en
from engram_numba.bf16 import bf16_ulp_distance, f32_to_bf16
from engram_numba.stages.rows import q2k

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
# ## 1. reference vs cpu vs cuda
#
# The `cpu` backend accumulates in the reference's order (numba compiles without fast-math), so
# it should agree with the reference *bit for bit* at every point. The whole 14-token sequence,
# position 9 dead:

# %%
cap_ref = en.Pipeline(model, "reference").run(TINY_TOKENS, token_mask=TINY_MASK)
cap_cpu = en.Pipeline(model, "cpu").run(TINY_TOKENS, token_mask=TINY_MASK)
report_cpu = en.diff(cap_ref, cap_cpu)
print("cpu == reference at every point:", report_cpu.all_equal)
report_cpu

# %% [markdown]
# The `cuda` backend, in the simulator, is exact but slow (every GPU thread is a Python thread),
# so it runs a two-token chunk: positions 12 and 13, continuing a hasher that has seen positions
# 0..11 (the hash history is all a prefill leaves behind). All three backends run the same
# chunk. In the simulator the projection and gate launchers default to their naive kernels (one
# thread per output, plain loops in the reference's order: the cheapest thing to simulate) and
# every rows kernel is bit-exact, so the cuda pipeline should match the reference bit for bit
# here; on a GPU the defaults are the fast kernels.

# %%
def chunk_hasher():
    h = en.EngramHasher(tables)
    h.hash(TINY_TOKENS[:12], TINY_MASK[:12])
    return h

chunk = TINY_TOKENS[12:14]                                  # [2]
caps = {}
for backend in ("reference", "cpu", "cuda"):
    t0 = time.perf_counter()
    caps[backend] = en.Pipeline(model, backend).run(chunk, hasher=chunk_hasher())
    print(f"{backend:>9}: {time.perf_counter() - t0:6.2f} s")
print("cuda kernels:", caps["cuda"].meta["cuda_kernels"])
print("cpu == reference on the chunk: ", en.diff(caps["reference"], caps["cpu"]).all_equal)
print("cuda == reference on the chunk:", en.diff(caps["reference"], caps["cuda"]).all_equal)
en.diff(caps["reference"], caps["cuda"])

# %% [markdown]
# The fast kernels are what a GPU runs, so measure them too, stage by stage, on the chunk. With
# `run(inputs_from=ref)` every stage gets the *reference's* input to it (the rows stage the
# reference's row ids, the projection its bf16 rows, the gate its key, value and `highway.in`)
# instead of the previous stage's output of this run, so every row of the table below is that
# one kernel's own distance, not an accumulation. `versions` names the records: `gemv_v2`
# for the projection (x staged in shared memory, 16-byte weight loads, a warp-shuffle reduction
# per output), `gate_v2` and `gate_v3` for the gate (16-byte loads, the three sums reduced by warp
# shuffles and shared memory). Some seconds each in the simulator.

# %%
ref = caps["reference"]                   # the reference's run of the chunk (positions 12 and 13)
fast = {}                                 # gate version -> the isolated capture (both with gemv_v2)
t0 = time.perf_counter()
for version in ("gate_v2", "gate_v3"):
    pipe = en.Pipeline(model, "cuda", versions={"proj": "gemv_v2", "gate": version})
    fast[version] = pipe.run(inputs_from=ref, hasher=chunk_hasher(), progress=False,
                             names_filter=["L*.proj.kv", "L*.gate.dot", "L*.gate.gate", "L*.highway.out"])
print(f"fast kernels on the chunk, stages isolated: {time.perf_counter() - t0:.1f} s")
for version in fast:
    print(en.diff(ref, fast[version], label_a="reference", label_b=f"gemv_v2 + {version}"))
    print()

# %% [markdown]
# Each fast kernel's own distance: kv within a bf16 ulp of the reference (usually exactly on
# it), the dot within a few fp32 ulps where it is well away from zero, the gate (a float64
# sigmoid rounded once) by at most an ulp or so, and `highway.out` only where the gate moved.
# Read the dot's ulp column with care: the dot is a normalised sum, and a dot near zero is a sum
# that cancels. Cancellation makes ulp distances *larger*, not smaller: the small result carries
# the absolute error of its large terms, which is many of its own (small) ulps, so there the
# max abs and rel L2 columns are the meaningful ones (docs/numerics.md, "Ulp distances and
# cancellation"). In a real pipeline these add up from stage to stage and layer to layer, which
# is what the `diff` of two whole runs on a GPU shows. The error along the stages:

# %%
report_fast = en.diff(ref, fast["gate_v3"], label_a="reference", label_b="gemv_v2 + gate_v3")
fig, axes = plt.subplots(2, 2, figsize=(13, 5.6), layout="constrained", sharex="col", height_ratios=(2, 1))
report_fast.plot(ax=axes[:, 0])
report_fast.plot(ax=axes[:, 1], metric="max_ulp")
axes[0, 1].set_ylabel("max ulp (bf16 for kv, fp32 after)")
fig.suptitle("fast kernels against the reference, stages isolated, two tokens of the synthetic tiny model", fontsize=11)
plt.show()

# %% [markdown]
# ## 2. fp32 highway (engine) vs bf16 residual (DeepSeek's reference)
#
# Engines keep the highway in fp32 and update it in place. DeepSeek's reference keeps it in bf16:
# h is rounded to bf16 before the gate reads it, and `h + gate*value` is rounded back to bf16
# (docs/numerics.md, "fp32 versus bf16 residual"). The gate itself moves a little (its dot sees
# the rounded h); the highway moves by about one bf16 rounding per update. Dead tokens are not
# written in either mode.

# %%
cap_bf16 = en.Pipeline(model, "reference", residual="bf16").run(TINY_TOKENS, token_mask=TINY_MASK)
report_res = en.diff(cap_ref, cap_bf16, label_a="fp32 residual", label_b="bf16 residual")
for lid in cfg.layer_ids:
    dg = np.abs(cap_ref[f"L{lid}.gate.gate"] - cap_bf16[f"L{lid}.gate.gate"])
    print(f"L{lid}: max |gate difference| {dg.max():.2e}")
report_res

# %% [markdown]
# The per-element highway difference in **bf16 ulps**, two ways. Left: the signed difference
# (fp32 result minus bf16 result) divided by the bf16 ulp at the bf16 result's magnitude; the
# two roundings of the bf16 path (h on the way in, the sum on the way out) give a spread of
# about +-1 ulp. Right: if the engine rounded its fp32 highway to bf16 at the end, how many
# bf16 ulps from DeepSeek's value would it be? Mostly 0 or 1, with a thin tail that needs a
# log axis: where `h + gate*value` nearly cancels, the result is much smaller than h, and an
# error of one ulp *of h* (made by rounding h on the way in) is many ulps *of the result*; a
# result that cancels to almost zero can even come out with the other sign in one mode, and
# counting ulps across zero adds up every tiny ulp in between. Not every large distance is a
# rounding of the update itself, though: the gate reads the rounded h too. Where a dot sits near
# 0, rounding h can push it across zero, and the steep signed square root then moves the gate
# by up to about 0.01, which times a value of order 1 moves the result by more than an ulp of h
# (the printed line names the largest distance of each layer, with its dot and gate in both
# modes). Layer 4 also starts from inputs that already differ.

# %%
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
    w = np.unravel_index(np.argmax(dist), dist.shape)            # (token, stream, d) of the largest
    h_in = cap_ref[f"L{lid}.highway.in"][live][w]
    dots = [c[f"L{lid}.gate.dot"][live][w[:2]] for c in (cap_ref, cap_bf16)]
    gates = [c[f"L{lid}.gate.gate"][live][w[:2]] for c in (cap_ref, cap_bf16)]
    print(f"L{lid}: {dist.size} elements; 0 ulp {np.mean(dist == 0):.1%}, 1 ulp {np.mean(dist == 1):.1%}, "
          f">= 2 ulp {np.mean(dist >= 2):.1%}; the largest, {dist.max()} ulp: h = {h_in:+.4f} -> "
          f"fp32 {h32[w]:+.3e} / bf16 {h16[w]:+.3e} (absolute difference {abs(h32[w] - h16[w]):.1e}, "
          f"one bf16 ulp of h is {bf16_ulp_at(h_in):.1e}); dot {dots[0]:+.2e} / {dots[1]:+.2e}, "
          f"gate {gates[0]:.4f} / {gates[1]:.4f}")
a.set_xlabel("(fp32 - bf16) / bf16 ulp of the result (clipped to +-3)")
a.set_ylabel("elements")
a.set_title("highway.out, fp32 vs bf16 residual", fontsize=10)
a.legend(fontsize=8)
b.set_xticks(range(len(labels)), labels, rotation=40, fontsize=8)
b.set_xlabel("bf16 ulps between bf16(fp32 highway) and the bf16 highway")
b.set_yscale("log")
b.set_ylim(bottom=0.5)      # bars from below 1, not from the smallest count
b.set_title("after rounding the engine's highway to bf16 (log counts)", fontsize=10)
b.legend()
fig.suptitle("fp32 vs bf16 residual on the synthetic tiny model (synthetic highway)", fontsize=11)
plt.show()

# %% [markdown]
# ## 3. The projection's summation order, in bf16 ulps
#
# Every bf16 x bf16 product is exact in fp32, so the only rounding in `kv = bf16(x @ wkv^T)` is
# in the fp32 sums (and the final rounding to bf16). Different summation orders therefore give
# kv values at most a few bf16 ulps apart, usually 0 (docs/numerics.md, "Summation orders").
# Two comparisons:
# * the reference (sequential fp32 sum over k = 0..K-1) against
#   `stages.proj.reference.projection_exact` (float64 sums, rounded once): how far the fixed fp32
#   order is from the order-free answer, over the whole sequence;
# * the reference against the fast CUDA kernel `gemv_v2` (the isolated chunk above).

# %%
from engram_numba.stages.proj import reference as proj_ref

fig, axes = plt.subplots(1, 2, figsize=(12, 3.6), layout="constrained")
T = TINY_TOKENS.size
for i, lid in enumerate(cfg.layer_ids):
    wkv = model.layers[lid].wkv_bf16()                                   # [N, K] bf16 words
    x = cap_ref[f"L{lid}.rows.bf16"].reshape(T, cfg.proj_in)             # [T, K]
    exact = proj_ref.projection_exact(x, wkv)                            # [T, N]
    pairs = ((axes[0], bf16_ulp_distance(cap_ref[f"L{lid}.proj.kv"], exact)),
             (axes[1], bf16_ulp_distance(ref[f"L{lid}.proj.kv"], fast["gate_v3"][f"L{lid}.proj.kv"])))
    for ax, dist in pairs:
        counts = np.bincount(dist.ravel(), minlength=3)
        ax.bar(np.arange(counts.size) + (i - 0.5) * 0.38, counts, width=0.38, label=f"L{lid} ({dist.size} values)")
    print(f"L{lid}: reference vs exact max {pairs[0][1].max()} ulp ({np.count_nonzero(pairs[0][1])} differ); "
          f"reference vs gemv_v2 max {pairs[1][1].max()} ulp ({np.count_nonzero(pairs[1][1])} differ)")
axes[0].set_title("proj.kv: reference fp32 order vs float64-exact", fontsize=10)
axes[1].set_title("proj.kv: reference vs CUDA gemv_v2 (two tokens, isolated)", fontsize=10)
for ax in axes:
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.5)  # bars from below 1, not from the smallest count
    ax.set_xlabel("bf16 ulps apart")
    ax.legend(fontsize=8)
axes[0].set_ylabel("kv values")
fig.suptitle("projection summation order on the synthetic tiny model", fontsize=11)
plt.show()

# %% [markdown]
# ## 4. What the Q2_K round trip costs at the gate
#
# The published GGUF stores the tables as Q2_K: 2.625 bits a value. To see what that costs, we
# need the rows *before* quantisation. The tiny model's tables were made by
# `engram_numba.fixtures.build_tiny_layers` as `q2k.quantize` of
# `fixtures.tiny_float_weights(...)` (synthetic heavy-tailed rows with per-row scales, drawn to
# look like trained embeddings), which gives us those original float rows; we check they
# quantise to exactly the bytes in the file, so "exact" below really is the tiny model without
# its Q2_K rounding. (The released checkpoint's own tables are FP8 e4m3 with per-32 scales: a
# Q2_K GGUF is a re-quantisation of those; docs/numerics.md, "Q2_K is a re-quantisation".)

# %%
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

# %% [markdown]
# A hook on `L{id}.rows.bf16` replaces the decoded Q2_K rows with the original rows rounded to
# bf16 (a hook on `L{id}.hash.ids` fires first and tells it which rows). Everything after the
# rows (projection, gate) then runs on exact rows. To measure each layer on its own, each layer
# gets the same fixed highway in both runs (a dict `{layer_id: highway}`); otherwise layer 4
# would also see layer 1's changes. 1,000 random tokens, `cpu` backend (bit-identical to the
# reference, and fast).

# %%
rng = np.random.default_rng(2026)
tokens = rng.integers(0, tables.token_map.size, size=1000)           # [T]
pipe = en.Pipeline(model, "cpu")
highway = {lid: pipe.default_highway(tokens.size, seed=li) for li, lid in enumerate(cfg.layer_ids)}
exact_rows = {lid: f32_to_bf16(originals[lid]) for lid in cfg.layer_ids}   # [rows, 256] bf16 words

def exact_rows_hooks(lid):
    seen = {}
    def ids_hook(ids, name):              # [T, C] row ids of this layer: observe
        seen["ids"] = ids
    def rows_hook(rows, name):            # [T*C, 256] Q2_K rows -> the unquantised rows, same ids
        return exact_rows[lid][seen["ids"].reshape(-1)]
    return {f"L{lid}.hash.ids": ids_hook, f"L{lid}.rows.bf16": rows_hook}

keep = ["tokens.*", "L*.hash.ids", "L*.rows.bf16", "L*.proj.kv", "L*.highway.in", "L*.gate.dot",
        "L*.gate.gate", "L*.highway.out"]
t0 = time.perf_counter()
cap_q2k = pipe.run(tokens, highway=highway, names_filter=keep)
hooks = {}
for lid in cfg.layer_ids:
    hooks.update(exact_rows_hooks(lid))
with pipe.hooks(hooks):
    cap_exact = pipe.run(tokens, highway=highway, names_filter=keep)
print(f"two runs of {tokens.size} tokens: {time.perf_counter() - t0:.1f} s")
report_q = en.diff(cap_exact, cap_q2k, label_a="exact rows", label_b="Q2_K rows")
report_q

# %% [markdown]
# Reading the table: the error enters at the rows (Q2_K's ~29 % relative RMS error on these
# heavy-tailed rows) and passes through the projection at the same relative size: the
# projection is linear and the quantisation errors of different values are independent, so kv
# carries the same fraction of error as its input. The dot (a normalised inner product with
# the key) inherits it too. The gate then squashes it: its relative L2 change is about half
# that of the dot. The gate differences, as a distribution:

# %%
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
    axes[2].plot(d_exact, d_q2k - d_exact, ".", ms=2, alpha=0.4, label=f"L{lid}")
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
fig.suptitle("what the Q2_K table costs at the gate, synthetic tiny model (same highway per layer in "
             "both runs)", fontsize=11)
plt.show()

# %% [markdown]
# The two off-diagonal clouds in the middle panel are the tokens whose dot changed sign. The
# signed square root is infinitely steep at 0 (only the 1e-6 clamp bounds it), so a dot near 0
# that the quantisation error pushes across zero moves the gate from one side of 0.5 to the
# other: those few sign flips make most of the large gate differences, while elsewhere the
# flattening of `sqrt` keeps the gate error well below the dot error. The error along the
# stages, per layer (both layers see the same kind of rows, so they look alike):

# %%
top, bottom = report_q.plot()
top.set_title(top.get_title() + "\nsynthetic tiny model, 1,000 random tokens", fontsize=9)
plt.show()
