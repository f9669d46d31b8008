"""Analysis of captured runs: `diff` (stage-by-stage distances), `stats` (gate statistics,
row-id reuse), `plots` (heatmaps, histograms, gate curves). Plots import stats, never the
reverse."""
