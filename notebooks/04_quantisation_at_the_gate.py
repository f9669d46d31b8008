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
# # What does quantisation cost at the gate?
#
# DeepSeek released the Engram tables as FP8 (e4m3 values with one e8m0 power-of-two scale per 32
# values); the GGUF files that engines run re-quantise them, to Q2_K in the smallest file. The
# question users ask first: how far does that move the gate? This notebook runs the same tokens
# through the same float weights stored three ways (the tiny synthetic model in `data/`, built by
# `engram-numba make-fixture` from one set of float weights):
#
# | file | tables | projection `wkv` |
# |---|---|---|
# | `data/tiny_v41_ds4.gguf` | FP8 rows (ds4's schema B) | F16 |
# | `data/tiny_v41_q8_0.gguf` | Q8_0 | Q8_0 |
# | `data/tiny_v41.gguf` | Q2_K | Q2_K |
#
# and diffs them stage by stage: rows, kv, the gate's dot, the gate, the highway. The model and
# the highway are synthetic (random weights shaped like trained ones, a random N(0, 1) highway), so
# the figures below say how the *encodings* differ, not what the real model does; on a real model
# run the same cells with `en.load_model` on the real files (docs/formats.md) and a highway
# captured from the real model (docs/research.md). The command line does the same:
# `engram-numba diff --model-a data/tiny_v41_ds4.gguf --model-b data/tiny_v41.gguf`.

# %%
import matplotlib.pyplot as plt
import numpy as np

import engram_numba as en
from engram_numba.fixtures import tiny_model_path

data = tiny_model_path().parent      # the package's data/ folder, wherever this notebook is run from
paths = {"fp8": data / "tiny_v41_ds4.gguf", "q8_0": data / "tiny_v41_q8_0.gguf", "q2k": data / "tiny_v41.gguf"}
models = {name: en.load_model(path) for name, path in paths.items()}
for name, m in models.items():
    print(f"{name:5s} {m.format:40s} wkv: {m.layers[1].wkv_encoding}")

# %% [markdown]
# The same 400 random tokens (one masked) through each model, `cpu` backend (bit-identical to the
# numpy reference). The three files share the identity token map of the tiny model, so the hash
# picks the same row ids in all three: every difference below is the encodings' (of the tables and
# of `wkv`, which each file stores its own way too).

# %%
rng = np.random.default_rng(4)
tokens = rng.integers(0, 64, 400)
mask = np.ones(tokens.size, dtype=bool)
mask[37] = False
caps = {name: en.Pipeline(m, "cpu").run(tokens, token_mask=mask) for name, m in models.items()}
assert all(np.array_equal(caps["fp8"]["L1.hash.ids"], c["L1.hash.ids"]) for c in caps.values())

# %% [markdown]
# ## Error along the stages
#
# Relative L2 distance from the FP8 run at each point, per layer, and how many live (token,
# stream) dots changed sign. A sign flip puts the gate on the other side of 0.5: the one error that
# changes *what* the layer does rather than how much.

# %%
for other in ("q8_0", "q2k"):
    print(en.gate_cost(caps["fp8"], caps[other], label_a="fp8", label_b=other))
    print()

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), layout="constrained", sharey=True)
for ax, lid in zip(axes, (1, 4)):
    for other, colour in (("q8_0", "C0"), ("q2k", "C3")):
        cost = en.gate_cost(caps["fp8"], caps[other])[lid]
        ax.plot(list(cost.rel_l2), list(cost.rel_l2.values()), marker="o", color=colour,
                label=f"{other} vs fp8 ({cost.sign_flips} of {cost.live} dots flip)")
    ax.set_yscale("log")
    ax.set_title(f"L{lid}", loc="left", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
axes[0].set_ylabel("relative L2 from the FP8 run")
fig.suptitle("error growth along the stages (synthetic model, synthetic highway)", fontsize=10)
plt.show()

# %% [markdown]
# The error of the rows carries into kv almost unchanged (the projection is linear), and the dot
# inherits it; the gate's signed square root then *flattens* large dots and *amplifies* small
# ones, so the gate error is smaller than the dot error overall, except at the tokens whose dot
# sits near zero, where a small error flips the sign.

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
live = mask
for other, colour in (("q8_0", "C0"), ("q2k", "C3")):
    d_fp8 = caps["fp8"]["L1.gate.dot"][live].ravel()
    d_other = caps[other]["L1.gate.dot"][live].ravel()
    g_fp8 = caps["fp8"]["L1.gate.gate"][live].ravel()
    g_other = caps[other]["L1.gate.gate"][live].ravel()
    flip = np.sign(d_fp8) != np.sign(d_other)
    axes[0].scatter(d_fp8, d_other - d_fp8, s=4, alpha=0.5, color=colour, label=f"{other}")
    axes[0].scatter(d_fp8[flip], (d_other - d_fp8)[flip], s=30, facecolors="none", edgecolors=colour)
    axes[1].scatter(g_fp8, g_other, s=4, alpha=0.5, color=colour, label=f"{other}: {int(flip.sum())} sign flips (ringed)")
axes[0].axhline(0, color="grey", linewidth=0.6)
axes[0].set_xlabel("dot, FP8 tables")
axes[0].set_ylabel("dot error against FP8")
axes[1].plot([0, 1], [0, 1], color="black", linewidth=0.6)
axes[1].set_xlabel("gate, FP8 tables")
axes[1].set_ylabel("gate, other encoding")
for a in axes:
    a.legend(fontsize=8)
    a.grid(True, alpha=0.3)
fig.suptitle("layer 1: dot errors and gates per (token, stream) (synthetic model, synthetic highway)", fontsize=10)
plt.show()

# %% [markdown]
# ## How far each encoding is from the float weights
#
# FP8 is itself a rounding of the trained weights. The fixture keeps the float weights it was built
# from (`engram_numba.fixtures.tiny_float_weights`), so each encoding's rows can be compared with the
# exact values: most of the Q8_0-vs-FP8 distance above is FP8's own rounding, while Q2_K is an order
# of magnitude further from both.

# %%
from engram_numba.fixtures import tiny_config, tiny_float_weights, tiny_hash_tables  # noqa: E402
from engram_numba.stages.rows.reference import decode_reference  # noqa: E402

exact = tiny_float_weights(tiny_config(), tiny_hash_tables())[1]["table_rows"]          # [rows, 256]
ids = caps["fp8"]["L1.hash.ids"].ravel()
for name, m in models.items():
    raw = m.rows(1).read(ids)
    got = decode_reference(raw, m.layers[1].table_encoding)
    want = exact[ids]
    print(f"{name:5s} rows vs the float weights: relative L2 {np.linalg.norm(got - want) / np.linalg.norm(want):.4f}")

# %% [markdown]
# ## DeepSeek's FP8 arithmetic at the projection
#
# DeepSeek's FP8 checkpoint stores `wkv` as e4m3 codes with one e8m0 scale per 32 x 32 tile, and
# DeepSeek computes the projection in FP8: each token's 32-wide blocks of x are quantised to e4m3
# with a power-of-two scale (`act_quant`), each block's products are summed and promoted to fp32
# with both scales, and kv is rounded to bf16 once (docs/math.md). The other backends project the
# same weights exactly. The `deepseek_fp8` projection backend runs DeepSeek's arithmetic (the @njit
# twin of the numpy reference; on a GPU, `versions={"proj": "gemm_fp8_v3"}` runs it on the FP8
# tensor cores), so the two can be diffed at every capture point. It needs an FP8 wkv: the tiny
# Hugging Face fixture has one (FP8 tables too).

# %%
hf = en.load_model(data / "tiny_v41_hf")
print(hf.format, "| wkv:", hf.layers[1].wkv_encoding, hf.layers[1].wkv_raw.shape, "scales", hf.layers[1].wkv_scales.shape)
exact_run = en.Pipeline(hf, "cpu").run(tokens, token_mask=mask)
fp8_run = en.Pipeline(hf, "deepseek_fp8").run(tokens, token_mask=mask)
print(en.diff(exact_run, fp8_run, names=["*proj.kv", "*gate.dot", "*highway.out"], label_a="exact", label_b="deepseek_fp8"))

# %% [markdown]
# Equal, or nearly: the rows x are FP8 table values (e4m3 times a power of two per 32 values), so
# `act_quant` represents them exactly, and what is left of DeepSeek's arithmetic is the fp32
# summation grouped by 32-wide blocks. At the released shape the same holds up to a few outputs
# (docs/numerics.md: relative L2 2e-5, 0.01% of kv off by a bf16 ulp or more). It stops holding when
# x is not FP8: below, each stage is fed the Q2_K model's captured inputs (`inputs_from`), so the
# projection multiplies Q2_K rows, which `act_quant` must round. Stage-isolated, the gate takes the
# captured key and value, so every difference is the projection's own.

# %%
exact_iso = en.Pipeline(hf, "cpu").run(inputs_from=caps["q2k"])
fp8_iso = en.Pipeline(hf, "deepseek_fp8").run(inputs_from=caps["q2k"])
print(en.diff(exact_iso, fp8_iso, names=["*rows.bf16", "*proj.kv"], label_a="exact", label_b="deepseek_fp8"))

fig, ax = plt.subplots(figsize=(6, 3.2))
for lid in hf.config.layer_ids:
    a = exact_iso[f"L{lid}.proj.kv"].astype(np.uint32) << 16      # bf16 words -> fp32 values
    b = fp8_iso[f"L{lid}.proj.kv"].astype(np.uint32) << 16
    a, b = a.view(np.float32).ravel(), b.view(np.float32).ravel()
    rel = np.abs(b - a) / np.maximum(np.abs(a), np.float32(1e-30))
    ax.hist(np.log10(rel[rel > 0]), bins=60, histtype="step", label=f"layer {lid}: {np.mean(rel > 0):.0%} of kv differ")
ax.set_xlabel("log10 relative error of kv (DeepSeek's FP8 arithmetic vs exact), Q2_K rows as x")
ax.set_ylabel("outputs")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# On a GPU the tensor cores add their own rounding: `gemm_fp8_v2..v4` sit at relative L2 ~4.5e-4
# from this CPU twin at the released shape, with ~3% of kv differing (their accumulation order
# inside a K step is not specified; docs/numerics.md gives the bound and the measurements). That is
# twenty times the distance between DeepSeek's arithmetic and the exact projection on FP8 rows, so
# for a study of the gate on the FP8 checkpoint, the exact backends and the CPU twin agree far
# better with each other than either does with the FP8 tensor-core GEMM.
