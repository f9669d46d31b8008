"""Reading a `StreamingGateStats.save` file back: every header field and array shape checked
before anything of the header's sizes is allocated, the model identity checked against the
file's own hash constants and token map."""
from __future__ import annotations

import numpy as np

from ..formats.errors import EngramFileError
from ..identity import constants_digest, identity_mismatch, token_map_digest
from .context_table import pack_width
from .reducers import FINE_BINS

STATE_VERSION = 1


class StatisticsFileError(EngramFileError, ValueError):
    """A file `StreamingGateStats.load` cannot take: not a statistics file, an older one, or one
    whose header and arrays disagree (the message names the entry)."""


_EXACT_FIELDS = ("g1", "g2", "d1", "d2", "dabs")
_MAX_EXACT_DIGITS = 400         # exact sums x 2^298 of up to 2^63 values stay far below this


def load_state(cls, path):
    """A `cls` (StreamingGateStats) read from `path`; a `StatisticsFileError` for anything else."""
    from ..formats.gguf import check_regular_file
    from ..formats.jsonsafe import field, load_json
    from ..formats.npz import member_header, open_npz, read_member
    from .._argcheck import need_path
    E = StatisticsFileError
    need_path(path)
    try:
        check_regular_file(path, "statistics file")
    except EngramFileError as exc:
        raise E(str(exc)) from None
    zf, members = open_npz(path, E)
    with zf:
        if "__state__" not in members:
            what = " (a capture: Capture.load reads it)" if "__meta__" in members else ""
            raise E(f"{path} is not a statistics file saved by StreamingGateStats.save (no __state__ entry){what}")
        state = read_member(zf, members["__state__"], path, E)
        if state.shape != () or state.dtype.kind != "U":
            raise E(f"{path}: __state__ is {state.dtype}{list(state.shape)}, not one JSON string")
        head = load_json(str(state), f"{path}: __state__", E, what="state")
        if not isinstance(head, dict):
            raise E(f"{path}: __state__ is a JSON {type(head).__name__}, not an object")
        version = head.get("version")
        if version != STATE_VERSION:
            older = isinstance(version, int) and not isinstance(version, bool) and version < STATE_VERSION
            raise E(f"{path}: statistics state version {str(version)[:20]}, this reader knows {STATE_VERSION}"
                    + (": written by an older version of engram_numba; recompute it" if older else ""))
        src = f"{path}: __state__"

        def num(key, lo=0):
            v = field(head, key, int, src, E)
            if v < lo:
                raise E(f"{src}: key {key!r} must be >= {lo}, got {v}")
            return v

        layer_ids = field(head, "layer_ids", list, src, E)
        if not layer_ids or len(layer_ids) > 4096 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                             for x in layer_ids):
            raise E(f"{src}: key 'layer_ids' must be a non-empty list of integers")
        L = len(layer_ids)
        hc, n_hash_cols, n_heads, max_ngram = num("hc", 1), num("n_hash_cols", 1), num("n_heads", 1), num("max_ngram", 2)
        V, R = num("compressed_vocab", 1), num("raw_vocab", 1)
        pad = num("pad_id")
        if pad >= V:
            raise E(f"{src}: pad_id {pad} is outside the compressed vocabulary [0, {V})")
        table_rows = field(head, "table_rows", list, src, E)
        if len(table_rows) != L or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in table_rows):
            raise E(f"{src}: key 'table_rows' must be {L} positive integers")
        bins, max_contexts = num("bins", 1), num("max_contexts", 1)
        contexts, rows = field(head, "contexts", bool, src, E), field(head, "rows", bool, src, E)
        meta = field(head, "meta", dict, src, E)
        consts = field(head, "hash_constants", dict, src, E, required=False)
        counters = {k: num(k) for k in ("n_documents", "n_tokens", "n_masked", "n_chunks")}
        exact = field(head, "exact", dict, src, E)
        sums = {}
        for k in _EXACT_FIELDS:
            rows_k = exact.get(k)
            if (not isinstance(rows_k, list) or len(rows_k) != L or
                    not all(isinstance(r, list) and len(r) == hc for r in rows_k)):
                raise E(f"{src}: exact.{k} must be {L} lists of {hc} decimal strings")
            try:
                sums[k] = [[_exact_int(x) for x in r] for r in rows_k]
            except (TypeError, ValueError):
                raise E(f"{src}: exact.{k} holds a value that is not a decimal integer of at most "
                        f"{_MAX_EXACT_DIGITS} digits") from None
        # every array's declared shape, before anything of the header's sizes is allocated
        width, _ = pack_width(max_ngram, max(int(V - 1).bit_length(), 1))
        want = {"counts": ((L, hc, 6), np.int64), "minmax": ((L, hc, 4), np.float64),
                "fine": ((L, hc, FINE_BINS), np.int64), "tok_count": ((V,), np.int64),
                "tok_gsum": ((L, hc, V), np.int64), "raw_count": ((R,), np.int64)}
        if "token_map" in members:
            want["token_map"] = ((R,), np.int64)
        if rows:
            for li, r in enumerate(table_rows):
                want[f"rows{li}"] = ((-(-r // 8),), np.uint8)
        shapes = {}
        for name, (shape, dtype) in want.items():
            if name not in members:
                raise E(f"{path}: array {name!r} is missing")
            got_shape, got_dtype = member_header(zf, members[name], path, E)
            if got_shape != shape or got_dtype != np.dtype(dtype):
                raise E(f"{path}: array {name!r} is {got_dtype}{list(got_shape)[:6]}, but the header makes it "
                        f"{np.dtype(dtype)}{list(shape)}")
            shapes[name] = got_shape
        ctx_names = {}
        if contexts:
            for n in range(2, max_ngram + 1):
                names = (f"ctx{n}_keys", f"ctx{n}_count", f"ctx{n}_gsum")
                hs = []
                for name in names:
                    if name not in members:
                        raise E(f"{path}: array {name!r} is missing")
                    hs.append(member_header(zf, members[name], path, E))
                G = hs[1][0][0] if len(hs[1][0]) == 1 else -1
                for name, (got_shape, got_dtype), shape in zip(names, hs, ((G, width), (G,), (G, L, hc))):
                    if G < 0 or got_shape != shape or got_dtype != np.dtype(np.int64):
                        raise E(f"{path}: array {name!r} is {got_dtype}{list(got_shape)[:6]}, but the header makes "
                                f"it int64{list(shape)}")
                ctx_names[n] = names
        st = cls(layer_ids=layer_ids, hc=hc, n_hash_cols=n_hash_cols, n_heads=n_heads, max_ngram=max_ngram,
                 compressed_vocab=V, raw_vocab=R, pad_id=pad, table_rows=table_rows, hash_constants=consts,
                 bins=bins, max_contexts=max_contexts, contexts=contexts, rows=rows, meta=meta)
        for k, v in counters.items():
            setattr(st, k, v)
        for k, v in sums.items():
            setattr(st, k, v)
        arrays = {name: read_member(zf, members[name], path, E) for name in want}
        st.counts, st.minmax, st.fine = arrays["counts"], arrays["minmax"], arrays["fine"]
        st.tok_count, st.tok_gsum, st.raw_count = arrays["tok_count"], arrays["tok_gsum"], arrays["raw_count"]
        if "token_map" in arrays:
            tm = arrays["token_map"]
            if tm.size and (int(tm.min()) < 0 or int(tm.max()) >= V):
                raise E(f"{path}: array 'token_map' holds ids outside the compressed vocabulary [0, {V})")
            st.token_map = tm
        cc = head.get("context_counters", {})
        for n, names in ctx_names.items():
            c = cc.get(str(n)) if isinstance(cc, dict) else None
            if not (isinstance(c, list) and len(c) == 4 and all(isinstance(x, int) and not isinstance(x, bool)
                                                               and x >= 0 for x in c)):
                raise E(f"{src}: context_counters.{n} must be 4 non-negative integers")
            t = st.contexts[n]
            t.load(*(read_member(zf, members[name], path, E) for name in names))
            t.prunes, t.dropped_entries, t.dropped_occurrences, t.undercount_bound = c
        st.row_bitmaps = [arrays[f"rows{li}"] for li in range(len(st.row_bitmaps))]
    st.identity = _identity_of_state(head, st, src)
    return st


def _exact_int(x) -> int:
    if not isinstance(x, str) or len(x) > _MAX_EXACT_DIGITS:
        raise ValueError(x)
    return int(x)


def _identity_of_state(head: dict, st, src: str) -> dict | None:
    """The identity a state carries; for a file written before identities were kept, rebuilt from
    its hash constants and token map (the encodings stay unknown)."""
    from ..identity import check_identity
    stored = check_identity(head.get("identity"), src, StatisticsFileError)
    rebuilt = {"hash": None, "token_map": None, "encodings": None}
    c = st.hash_constants
    if isinstance(c, dict):
        try:
            L = len(st.layer_ids)
            mult = np.asarray(c["multipliers"], dtype=np.int64).reshape(L, st.max_ngram)
            primes = np.asarray(c["primes"], dtype=np.int64).reshape(L, st.max_ngram - 1, st.n_heads)
            offsets = np.asarray(c["offsets"], dtype=np.int64).reshape(L, st.n_hash_cols)
        except (KeyError, TypeError, ValueError, OverflowError):
            raise StatisticsFileError(f"{src}: hash_constants do not have the shapes of the header's model") from None
        rebuilt["hash"] = constants_digest(st.layer_ids, st.max_ngram, st.n_heads, st.pad_id, mult, primes, offsets)
    if st.token_map is not None:
        rebuilt["token_map"] = token_map_digest(st.token_map)
    if stored is None:
        return rebuilt if (rebuilt["hash"] or rebuilt["token_map"]) else None
    differ = identity_mismatch(stored, rebuilt)
    if differ:
        raise StatisticsFileError(f"{src}: the stored model identity does not match its own {', '.join(differ)}")
    return stored
