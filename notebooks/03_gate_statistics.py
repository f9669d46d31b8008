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
# # Gate statistics over a long token stream
#
# How does the gate behave per layer and per hyper-connection stream over thousands of tokens,
# and how hard are the tiny model's small tables used? This notebook runs the `cpu` backend (the
# `@njit` stages, bit-identical to the numpy reference) on a 4,000-token stream. The `cuda`
# backend computes the same captures on a GPU (`en.Pipeline(model, "cuda")`); in numba's
# simulator it would take hours at this length, so it is not used here.
#
# Everything here is of the tiny model in `data/`: the reference's test configuration with
# *synthetic* weights (random draws shaped like trained weights), a synthetic token stream and a
# synthetic highway. The figures show how the mechanism behaves, not what DeepSeek's trained
# model does.
#
# The stream has structure, as text does: a small set of recurring phrases (so the same n-grams
# come back many times, and hash to the same rows every time), random filler between them, and a
# few dead spans (masked positions, as an image would be).

# %%
import time

import matplotlib.pyplot as plt
import numpy as np

import engram_numba as en

np.set_printoptions(linewidth=110)
model = en.load_gguf(en.tiny_model_path())               # the synthetic tiny model in data/
cfg, tables = model.config, model.hash_tables
print(cfg)
print(f"hash columns C = {cfg.n_hash_cols}, projection K = C*256 = {cfg.proj_in}, "
      f"N = dim*(hc+1) = {cfg.proj_out}")
print("table rows per layer:", dict(zip(cfg.layer_ids, tables.table_rows.tolist())))


# %%
def make_stream(n_tokens, seed=11, vocab=64):
    """Token ids [n] and a live mask [n]: recurring phrases (Zipf-like frequencies), random filler,
    and a dead span now and then."""
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

# %% [markdown]
# One run, every engram layer. We keep only the points the statistics read (`tokens.*`,
# `L{id}.hash.ids`, `L{id}.gate.dot`, `L{id}.gate.gate`) through `names_filter` (names or glob
# patterns), which keeps the capture small. The highway entering each layer is the pipeline's
# synthetic, fixed-seed N(0, 1) array: without the transformer blocks there is no real residual
# stream, so what the gate sees of `h` here is noise, except that layer 4's input is layer 1's
# output, which has layer 1's value added.

# %%
pipe = en.Pipeline(model, "cpu")
keep = ["tokens.*", "L*.hash.ids", "L*.gate.dot", "L*.gate.gate"]
t0 = time.perf_counter()
cap = pipe.run(tokens, token_mask=mask, names_filter=keep)
print(f"cpu backend, {tokens.size} tokens, {cfg.n_layers} layers: {time.perf_counter() - t0:.1f} s")
print(sorted(cap))
print("highway:", cap.meta["highway"])

# %% [markdown]
# ## The gate per layer and stream
#
# `en.gate_stats` summarises every (layer, stream) over live tokens only: dead tokens have a
# gate of exactly 0 by definition, which is not a measurement, so they are counted apart (and a
# dead token with a non-zero gate would be flagged as a backend bug). `clamp%` is the share of
# tokens whose |dot| fell inside the 1e-6 clamp.

# %%
st = en.gate_stats(cap)
st

# %% [markdown]
# A window of the stream as a heatmap: streams down, tokens across, one panel per layer, with a
# dead span hatched. Tokens inside a recurring phrase read the same rows each time the phrase
# comes back, yet their gates differ from one occurrence to the next, because the gate also
# depends on the stream's state `h`.

# %%
dead_start = int(np.flatnonzero(~mask)[0])
a, z = max(0, dead_start - 24), max(0, dead_start - 24) + 48            # a 48-token window
fig = en.gate_heatmap(cap, window=(a, z))       # the title says: synthetic model, synthetic highway
plt.show()
fig = en.gate_heatmap(cap, rolling=32, stride=8)   # the whole run, smoothed: a long capture's overview
plt.show()

# %%
fig = en.gate_histogram(cap, bins=40)
plt.show()

# %% [markdown]
# Two humps with a hole at 0.5, in every stream: that is the signed square root at work. The dot
# itself is spread around 0 like a bell (mean |dot| ~0.8 in the table), but `g = sign(dot) *
# sqrt(|dot|)` pulls small dots away from 0 (a dot of 0.01 becomes g = 0.1), so the density of
# g vanishes at 0 (it is 2|g| times the dot's density at g^2) and the gate rarely sits near 0.5.
# Each token-stream is pushed towards "mostly take the value" or "mostly leave it"; the humps sit
# near sigmoid(+-1) ~ 0.27 / 0.73, where |dot| ~ 1.

# %% [markdown]
# Every gate lies on the curve `sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))` (a check of the
# backend as much as a picture; docs/math.md, section 6). The second plot uses a symmetric-log
# axis, linear inside |dot| < 1e-6, so the clamp region appears at its true place.

# %%
fig = en.gate_vs_dot(cap)                       # one panel per layer and stream
plt.show()
fig = en.gate_vs_dot(cap, xscale="symlog")
plt.show()

# %% [markdown]
# How much of the gate is decided by the *context* (the rows read, hence the key and the value)
# and how much by the stream state? Tokens with equal row ids in every column read identical
# rows and so get identical keys. Take the tokens whose context recurs at least 5 times, split
# their gate variance into a between-context and a within-context part, and compare the
# between-context share with what shuffling the gates across those tokens gives (the share that
# groups of these sizes explain by chance). Layer 1's input highway is random, independent of
# the tokens, and the normalised dot of a random direction with a fixed key does not depend on
# the key, so there the context should explain no more than chance. Layer 4 reads layer 1's
# *output*, `h + gate * value`, and layer 1's value is itself a function of the context.

# %%
def between_share(gate, group):
    """Share of the variance of gate [n, hc] explained by group [n] (0..k-1) means, per stream."""
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

# %% [markdown]
# Layer 1 sits at chance; layer 4 clearly above it. The state entering layer 4 already holds
# layer 1's value for the same context, so the state "knows" the context and its dot with
# layer 4's key is no longer independent of it: a first glimpse of how stacked Engram layers
# (and, in the real model, the blocks between them) make the gate context-dependent. To check
# that this is the mechanism, run again with layer 4 fed its own independent random highway
# instead of layer 1's output (a dict `{layer_id: highway}`):

# %%
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

# %% [markdown]
# ## Row-id reuse and hash collisions
#
# Each hash column reduces its n-gram modulo a prime, so it has only that many rows: 67 to 89
# for layer 1, 97 to 113 for layer 4 (about 16 million per column in the release). A stream
# with many distinct n-grams must make several of them share a row, a *collision*: the model
# cannot tell those contexts apart in that column. Using several heads per order with different
# primes is what keeps two contexts from colliding everywhere at once.
#
# `en.row_id_reuse` rebuilds every position's n-gram window from the tokens and the mask
# (exactly as the hasher does, given the hash tables) and counts, per column: tokens, distinct
# contexts, distinct row ids, and collisions (contexts that lost their own row).

# %%
reuse = en.row_id_reuse(cap, tables=tables)
print(reuse)

# %%
fig = en.row_id_reuse_plot(reuse)
fig.suptitle("row-id reuse per hash column (synthetic tiny model's tables, synthetic stream)", fontsize=10)
plt.show()

# %% [markdown]
# Each column collides heavily, so what does a context keep? It reads one row per head, and
# the *pair* of rows from the two heads of its order is what the projection sees. If the heads
# hash independently, the pair behaves like one table of P0 x P1 rows, and n contexts thrown
# at random into N cells fill about N(1 - exp(-n/N)) of them.

# %%
for lid in cfg.layer_ids:
    li = cfg.layer_index(lid)
    ids = cap[f"L{lid}.hash.ids"][live]                                  # [live T, C]
    windows = en.ngram_windows(cap["tokens.ids"], cap["tokens.mask"], cfg.max_ngram_size,
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

# %% [markdown]
# Reading the figures:
#
# * **Columns.** Every column uses all of its rows (distinct ids = its prime), and each holds far
#   more distinct contexts than rows, so most contexts share their row with others: the
#   orange bars stop at the prime, the blue ones do not. How much of this is the tiny model's
#   doing depends on what you count over. The release has ~16 million rows a column, so within
#   one document (a few thousand distinct n-grams) a column collides rarely. Over a corpus it
#   does not: the distinct n-grams of a training corpus far outnumber 16 million, so every row
#   of a column is shared by many contexts, just as here, and a single column alone cannot tell
#   them apart.
# * **Heads.** The two heads of an order hash independently: the number of distinct row pairs
#   matches the random-throw prediction. A context keeps a pair of its own unless it meets a
#   birthday collision in a P0 x P1 table, which is why Engram uses several heads per order
#   rather than one bigger table per order.
# * **Orders.** Higher orders see more distinct contexts (the recurring phrases keep them from
#   growing without bound), so they collide more in the same few rows.
# * **Reuse.** `max reuse` mixes two causes: repetition in the text (the recurring phrases, one
#   context read many times, which the hash keeps together by design) and collisions (many
#   contexts in one row). `contexts` against `tokens` measures the first, `ids` against
#   `contexts` the second.
# * **Gate.** With a random highway the gate is bimodal around 0.5 in every stream (the signed
#   square root empties the middle) and lies exactly on its curve; the clamp region is never
#   hit (`clamp%` 0). The streams of one layer behave alike, since only their own q/k weights
#   tell them apart. The context explains no more of layer 1's gate than chance (a random
#   state does not know the key), but clearly more of layer 4's, whose state carries layer
#   1's value for that context.
