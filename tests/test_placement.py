"""Table placement (device / host / mmap), the host-row fetcher's prefetch ordering and the hot-row
cache, in numba's simulator on the tiny model: results bit-identical to device tables, refusals
made before anything is allocated."""
import numpy as np
import pytest
from numba import cuda

from engram_numba import placement
from engram_numba.device.hostrows import HostLayer, RowFetcher, cache_hit_rates, rank_rows
from engram_numba.engine import EngramV41
from engram_numba.fixtures import TINY_PATH, TINY_TOKENS
from engram_numba.formats.load import load_model
from engram_numba.placement import PlacementError, plan_placement
from engram_numba.stages.hash.cpu import EngramHasher

T = 3
GB = 10 ** 9


@pytest.fixture(scope="module")
def model():
    return load_model(TINY_PATH)


@pytest.fixture(scope="module")
def device_engine(model):
    return EngramV41(model, max_tokens=4, tables="device")


def _ids(model, tokens):
    return EngramHasher(model.hash_tables).hash(tokens)          # [T, L, C]


# -- the plan -------------------------------------------------------------------------------------
def test_plan_policies():
    sizes = {1: 30 * GB, 14: 30 * GB}
    kw = dict(row_bytes={1: 84, 14: 84}, n_rows={1: 30 * GB // 84, 14: 30 * GB // 84})
    p = plan_placement(sizes, {1: "device", 14: "host"}, device_free=100 * GB, host_available=100 * GB, **kw)
    assert p.as_dict()["tables"] == {1: "device", 14: "host"} and p.kind == "mixed"
    assert p.host_pinned_bytes == 30 * GB and p.device_bytes == 30 * GB
    p = plan_placement(sizes, "device<=40GB", device_free=100 * GB, host_available=100 * GB, **kw)
    assert [lp.placement for lp in p.layers.values()] == ["device", "host"]
    p = plan_placement(sizes, "auto", device_free=45 * GB, host_available=20 * GB, **kw)
    assert [lp.placement for lp in p.layers.values()] == ["device", "mmap"]      # host too small: mmap
    p = plan_placement(sizes, "auto", device_free=45 * GB, host_available=60 * GB, **kw)
    assert [lp.placement for lp in p.layers.values()] == ["device", "host"]
    p = plan_placement(sizes, None, device_tables=True, device_free=None, host_available=None, **kw)
    assert p.kind == "device"
    p = plan_placement(sizes, "host", cache_gb={14: 2}, device_free=100 * GB, host_available=100 * GB, **kw)
    assert p.layers[14].cache_budget_bytes == 2 * GB and p.layers[1].cache_bytes == 0
    assert p.layers[14].cache_bytes == 2 * GB // 84 * 84 + 4 * (30 * GB // 84) + 8 * 4096   # rows + remap + counters


@pytest.mark.parametrize("tables, cache, match", [
    ({1: "gpu"}, None, "placement is one of"),
    ({2: "host"}, None, "names layer"),
    ({1: "device", 14: "device"}, None, "do not fit on the device"),
    ("host", None, "do not fit in pinnable host memory"),
    ({1: "device", 14: "host"}, {1: 1}, "cache_gb is for host-resident tables"),
    ("host", -1, "must be a number >= 0"),
    (3.5, None, "tables must be"),
])
def test_plan_refusals_name_the_problem(tables, cache, match):
    sizes = {1: 30 * GB, 14: 30 * GB}
    kw = dict(row_bytes={1: 84, 14: 84}, n_rows={1: 30 * GB // 84, 14: 30 * GB // 84})
    with pytest.raises(PlacementError, match=match):
        plan_placement(sizes, tables, cache_gb=cache, device_free=40 * GB, host_available=40 * GB, **kw)


@pytest.mark.parametrize("where, probe", [("device", "device_free_bytes"), ("host", "host_available_bytes")])
def test_refusal_leaves_nothing_allocated(model, monkeypatch, where, probe):
    calls = []
    for name in ("to_device", "device_array", "mapped_array", "pinned_array", "stream", "event"):
        real = getattr(cuda, name)
        monkeypatch.setattr(cuda, name, lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1])
    monkeypatch.setattr(placement, probe, lambda: 1000)          # 1000 bytes: nothing fits
    with pytest.raises(PlacementError, match=r"layer 4 .*GB|layer 1 .*GB"):
        EngramV41(model, max_tokens=4, tables=where)
    assert calls == []


# -- bit-identical to device tables ---------------------------------------------------------------
def test_mixed_placement_rows_bit_identical_prefill_and_decode(model, device_engine, rng):
    mixed = EngramV41(model, max_tokens=4, tables={1: "device", 4: "host"})
    assert mixed.build_report["tables"] == {1: "device", 4: "host"}
    assert mixed.build_report["placement"]["kind"] == "mixed"
    assert mixed.layers[4].placement == "host" and mixed.host_bytes == model.layers[4].table.nbytes
    assert mixed.device_bytes < device_engine.device_bytes       # the host table is not on the device
    for n in (T, 1):                                               # a prefill chunk, a decode token
        ids = _ids(model, rng.choice(TINY_TOKENS, n))
        for li, lid in enumerate((1, 4)):
            for e in (device_engine, mixed):
                e.rows_from_ids(lid, ids[:, li, :])
            np.testing.assert_array_equal(mixed.rows_bf16(lid).copy_to_host(),
                                          device_engine.rows_bf16(lid).copy_to_host())


DECODE_TOKENS = [int(t) for t in TINY_TOKENS[3:5]]         # decoded live, then dead
# The whole-decode tests below are about where the rows come from: every engine of theirs holds
# wkv as bf16, whose projection (gemv_v1 in the simulator) is the cheapest to simulate (the default
# Q2_K one, 2-3x slower there, is test_engine_decode.py's); the rows path is the same for any wkv format.
DECODE_WKV = "bf16"


@pytest.fixture(scope="module")
def device_decodes(model):
    """The yardstick of the decode tests below, computed once (each simulated decode step is
    seconds): a highway h0 and what device tables' decode makes of it after each of
    DECODE_TOKENS, one hasher through both (the first live, the second dead)."""
    engine = EngramV41(model, max_tokens=4, tables="device", wkv_format=DECODE_WKV)
    h0 = np.random.default_rng(20261202).standard_normal((1, model.config.hc, model.config.dim)).astype(np.float32)
    h, hs, after = cuda.to_device(h0), EngramHasher(model.hash_tables), []
    for k, tok in enumerate(DECODE_TOKENS):
        engine.decode(tok, h, hs, token_mask=k == 0)
        after.append(h.copy_to_host())
    return h0, after


@pytest.mark.slow
def test_mixed_placement_decode_step_bit_identical(model, device_decodes):
    mixed = EngramV41(model, max_tokens=4, tables={1: "device", 4: "host"}, wkv_format=DECODE_WKV)
    h0, after = device_decodes
    h = cuda.to_device(h0)                                         # a decode step: one token, both layers
    mixed.decode(DECODE_TOKENS[0], h, EngramHasher(model.hash_tables))
    np.testing.assert_array_equal(h.copy_to_host(), after[0])


@pytest.mark.slow
def test_decode_with_the_next_token_prefetched_is_bit_identical(model, device_decodes):
    """prefetch_decode hashes the next token and fetches its host rows ahead; the decode of that
    token then reads the staged rows and ends on device tables' bits (a live token, a dead one)."""
    host = EngramV41(model, max_tokens=4, tables={1: "device", 4: "host"}, wkv_format=DECODE_WKV)
    h0, after = device_decodes
    h, hs = cuda.to_device(h0), EngramHasher(model.hash_tables)
    for k, tok in enumerate(DECODE_TOKENS):
        assert host.prefetch_decode(tok, hs, token_mask=k == 0)
        host.decode(tok, h, hs, token_mask=k == 0)
    np.testing.assert_array_equal(h.copy_to_host(), after[-1])
    assert host._fetcher.taken == len(DECODE_TOKENS) and host._fetcher.missed == 0      # every token read ahead


def test_prefetch_decode_then_another_call_is_refused(model):
    """After prefetch_decode the hasher holds that token: a decode of another token (or with
    another hasher), a step, a second prefetch are refused before anything is written."""
    host = EngramV41(model, max_tokens=4, tables={1: "device", 4: "host"})
    toks = [int(t) for t in TINY_TOKENS[:2]]
    hs = EngramHasher(model.hash_tables)
    assert host.prefetch_decode(toks[0], hs)
    assert host._fetcher.issued == 1 and hs.position == 1
    h0 = np.ones((1, model.config.hc, model.config.dim), np.float32)
    h = cuda.to_device(h0)
    for bad in (lambda: host.decode(toks[1], h, hs), lambda: host.decode(toks[0], h, EngramHasher(model.hash_tables)),
                lambda: host.decode(toks[0], h, hs, token_mask=False),
                lambda: host.step([toks[0]], h, hs, graph=False), lambda: host.prefetch_decode(toks[1], hs)):
        with pytest.raises(ValueError, match="prefetch"):
            bad()
    np.testing.assert_array_equal(h.copy_to_host(), h0)             # nothing written
    assert hs.position == 1 and host._fetcher.issued == 1
    assert not EngramV41(model, max_tokens=4, tables="device").prefetch_decode(toks[0], hs)   # no host table
    assert hs.position == 1                                         # ... and nothing hashed


def test_fetch_rows_pair_reads_both_layers_in_one_launch(rng):
    """The decode graph's fetch: both layers' rows (one through a cache, one with split parts)
    in one launch, equal to the tables' rows."""
    from engram_numba.device.hostrows import FetchRowsLaunch, RowCache
    ta = rng.integers(0, 256, (40, 84), dtype=np.uint8)
    tb = rng.integers(0, 256, (30, 264), dtype=np.uint8)
    cache = RowCache(40, 84, 5 * 84, np.uint32)
    hot = np.array([3, 17, 9])
    cache.fill(hot, lambda r: ta[r])
    la = HostLayer(1, [cuda.to_device(ta)], 84, 40, cache)
    lb = HostLayer(2, [cuda.to_device(np.ascontiguousarray(tb[:, :256])), cuda.to_device(np.ascontiguousarray(tb[:, 256:]))], 264, 30, None)
    ia, ib = np.array([17, 0, 39, 3, 3]), rng.integers(0, 30, 7)
    oa, ob = cuda.device_array((6, 21), np.uint32), cuda.device_array((7, 66), np.uint32)
    FetchRowsLaunch([(la, cuda.to_device(ia), oa), (lb, cuda.to_device(ib), ob)])()
    np.testing.assert_array_equal(oa.copy_to_host()[:5].view(np.uint8), ta[ia])
    np.testing.assert_array_equal(ob.copy_to_host().view(np.uint8), tb[ib])
    one = cuda.device_array((7, 66), np.uint32)                     # one layer: the pair's other half is empty
    FetchRowsLaunch([(lb, cuda.to_device(ib[::-1].copy()), one)])()
    np.testing.assert_array_equal(one.copy_to_host().view(np.uint8), tb[ib[::-1]])
    bad = cuda.to_device(np.zeros(1, np.uint32))                   # ids outside the table: counted, not read
    FetchRowsLaunch([(lb, cuda.to_device(np.array([30, 2, -1])), one)], bad=bad)()
    assert bad.copy_to_host()[0] == 2
    np.testing.assert_array_equal(one.copy_to_host()[1].view(np.uint8), tb[2])
    with pytest.raises(ValueError, match="fetch output must be"):
        FetchRowsLaunch([(la, cuda.to_device(ia), ob)])


@pytest.mark.gpu
def test_host_tables_on_the_gpu_bit_identical(model, rng, gpu_record):
    """On a GPU: decode graphs that gather straight from mapped host memory, and prefetched,
    cached chunks, end on the same highway bits as device tables."""
    dev = EngramV41(model, max_tokens=4, tables="device", stream=cuda.stream())
    host = EngramV41(model, max_tokens=4, tables={1: "device", 4: "host"}, cache_gb={4: 30 * 84 / 1e9},
                     stream=cuda.stream())
    host.fill_cache(4, _ids(model, TINY_TOKENS)[:, 1, :])
    hc, dim = model.config.hc, model.config.dim
    h0 = rng.standard_normal((1, hc, dim)).astype(np.float32)
    outs = []
    for e, ahead in ((dev, False), (host, False), (host, True)):
        h = cuda.to_device(h0)
        hs = EngramHasher(model.hash_tables)
        for k, tok in enumerate(TINY_TOKENS[:6]):
            if ahead and k % 3:                                    # the next token's rows fetched ahead, or not
                assert e.prefetch_decode(int(tok), hs)
            e.decode(int(tok), h, hs)
        e.decode_stream.synchronize()
        outs.append(h.copy_to_host())
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])
    assert host.decode_bad_ids() == 0
    chunks = [TINY_TOKENS[0:4], TINY_TOKENS[4:8], TINY_TOKENS[8:12]]
    hp = rng.standard_normal((4, hc, dim)).astype(np.float32)
    hs = EngramHasher(model.hash_tables)
    ids = [hs.hash(c) for c in chunks]
    for a, b in zip(_highways_over_chunks(dev, model, ids, hp, ahead=0),
                    _highways_over_chunks(host, model, ids, hp, ahead=1)):
        np.testing.assert_array_equal(a, b)
    rep = host.cache_report()
    assert rep["prefetch"]["missed"] == 0 and rep["prefetch"]["taken"] == 3
    gpu_record(test="host tables: decode graph + prefetched cached chunks == device tables",
               hit_rate=round(rep[4]["hit_rate"], 3), passed=True)


def _highways_over_chunks(engine, model, ids, hp, ahead: int) -> list:
    """The highway hp after both layers of each chunk (row ids `ids`, one [T, layers, C] a chunk),
    each chunk's rows prefetched `ahead` chunks before it is computed (0: none)."""
    for k in range(min(ahead, len(ids))):
        engine.prefetch(ids[k])
    got = []
    for k in range(len(ids)):
        if ahead and k + ahead < len(ids):
            engine.prefetch(ids[k + ahead])
        h = cuda.to_device(hp)
        for li, lid in enumerate(model.config.layer_ids):
            engine.rows_from_ids(lid, ids[k][:, li, :])
            engine.apply(lid, h)
        got.append(h.copy_to_host())
    return got


@pytest.mark.gpu
def test_clock_cache_on_the_gpu_two_ahead_bit_identical_and_counts_like_its_twin(model, rng, gpu_record):
    """On a GPU: both tables in host memory behind CLOCK caches, chunks prefetched two ahead on the
    layers' high-priority side streams: the device-table highway bits, and per fetch the hits and
    inserts of the CPU twin (real concurrency: atomics, claims, several blocks)."""
    from engram_numba.device.hostrows import clock_cache_sim
    dev = EngramV41(model, max_tokens=4, tables="device", stream=cuda.stream())
    host = EngramV41(model, max_tokens=4, tables="host", cache_gb=12 * 84 / 1e9, cache="clock", stream=cuda.stream())
    hc, dim = model.config.hc, model.config.dim
    chunks = [rng.choice(TINY_TOKENS, 4) for _ in range(9)]
    hs = EngramHasher(model.hash_tables)
    ids = [hs.hash(c) for c in chunks]
    hp = rng.standard_normal((4, hc, dim)).astype(np.float32)
    for a, b in zip(_highways_over_chunks(dev, model, ids, hp, ahead=0),
                    _highways_over_chunks(host, model, ids, hp, ahead=2)):
        np.testing.assert_array_equal(a, b)
    rep = host.cache_report()
    assert rep["prefetch"]["missed"] == 0 and rep["prefetch"]["taken"] == 2 * len(chunks)
    for li, lid in enumerate(model.config.layer_ids):
        cache = host._fetcher.layers[lid].cache
        sim = clock_cache_sim([i[:, li, :] for i in ids], cache.n_sets, cache.ways)
        assert [p["hits"] for p in rep[lid]["per_fetch"]] == sim["hits"].tolist()
        assert [p["inserted"] for p in rep[lid]["per_fetch"]] == sim["inserted"].tolist()
        np.testing.assert_array_equal(cache.tags.copy_to_host(), sim["tags"])
    gpu_record(test="host tables, CLOCK caches, prefetched two ahead == device tables; counters == CPU twin",
               hit_rate={lid: round(rep[lid]["hit_rate"], 3) for lid in model.config.layer_ids}, passed=True)


def test_host_fp8_split_scales_prefetched_rows_bit_identical(rng):
    m = load_model(TINY_PATH.parent / "tiny_v41_hf")             # fp8 codes [rows, 256] + scales [rows, 8]
    dev = EngramV41(m, max_tokens=2, tables="device")
    host = EngramV41(m, max_tokens=2, tables="host")
    ids = _ids(m, rng.choice(TINY_TOKENS, 2))
    assert host.prefetch(ids)
    lid = m.config.layer_ids[1]
    for e in (dev, host):
        e.rows_from_ids(lid, ids[:, 1, :])
    assert host._fetcher.taken == 1 and host._fetcher.missed == 0  # decoded from the prefetched buffer
    np.testing.assert_array_equal(host.rows_bf16(lid).copy_to_host(), dev.rows_bf16(lid).copy_to_host())


def test_prefetch_checks_ids_first(model):
    host = EngramV41(model, max_tokens=4, tables={4: "host"})
    ids = _ids(model, TINY_TOKENS[:2])
    bad = ids.copy()
    bad[1, 1, 2] = model.layers[4].table.shape[0]
    with pytest.raises(ValueError, match=r"row id \d+ \(token 1, column 2\) is outside layer 4"):
        host.prefetch(bad)
    with pytest.raises(ValueError, match="row_ids must be integers"):
        host.prefetch(ids[:, :1])
    assert host._fetcher.issued == 0
    assert not EngramV41(model, max_tokens=4, tables="device").prefetch(ids)   # no host layer: nothing to do


# -- prefetch ordering ----------------------------------------------------------------------------
class _LogEvent:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def record(self, stream=0):
        self.log.append(("record", self.name, stream))

    def wait(self, stream=0):
        self.log.append(("wait", self.name, stream))

    def synchronize(self):
        self.log.append(("sync", self.name))


def test_prefetch_buffers_are_reused_only_after_their_consumer(rng):
    from engram_numba.device.hostrows import N_BUFFERS
    assert N_BUFFERS == 3
    log = []
    table = cuda.to_device(rng.integers(0, 256, (50, 84), dtype=np.uint8))
    f = RowFetcher([HostLayer(7, [table], 84, 50, None)], max_rows=6, compute_stream="compute",
                   side_stream=cuda.stream(), event_factory=lambda n: _LogEvent(n, log))
    side = f.side
    chunks = [rng.integers(0, 50, 6) for _ in range(5)]
    assert [f.issue({7: chunks[c]}) for c in range(3)] == [0, 1, 2]          # two chunks ahead of chunk 0
    assert f.match(7, chunks[1]) == 1 and f.match(7, chunks[0]) == 0 and f.match(7, chunks[3]) is None
    got = f.take(7, 0)                                             # consumer of chunk 0
    np.testing.assert_array_equal(got.copy_to_host(), table.copy_to_host()[chunks[0]])
    f.release(0)
    mark = len(log)
    assert f.issue({7: chunks[3]}) == 0                            # buffer 0 again
    ops = log[mark:]
    # the host waits for the ids copy of chunk 0, the side stream for chunk 0's decode, before any write
    assert ops[0] == ("sync", "fetched0") and ops[1] == ("wait", "consumed0", side)
    assert ops[-1] == ("record", "fetched0", side)
    assert log.index(("record", "consumed0", "compute")) < mark + 1
    assert log[log.index(("wait", "fetched0", "compute")) - 1] == ("record", "fetched2", side)  # take waited
    f.take(7, 1)
    f.release(1)
    mark = len(log)
    f.issue({7: chunks[4]})
    assert log[mark:mark + 2] == [("sync", "fetched1"), ("wait", "consumed1", side)]
    np.testing.assert_array_equal(f.take(7, f.match(7, chunks[2])).copy_to_host(), table.copy_to_host()[chunks[2]])
    np.testing.assert_array_equal(f.take(7, f.match(7, chunks[3])).copy_to_host(), table.copy_to_host()[chunks[3]])


def test_two_layers_fetch_on_their_own_streams_and_events(rng):
    """Each layer's fetch is ordered by its own events (a layer's decode waits only for its own
    rows), and a buffer is refilled only after that layer's consumer of it."""
    log = []
    ta = cuda.to_device(rng.integers(0, 256, (50, 84), dtype=np.uint8))
    tb = cuda.to_device(rng.integers(0, 256, (40, 84), dtype=np.uint8))
    f = RowFetcher([HostLayer(1, [ta], 84, 50, None), HostLayer(2, [tb], 84, 40, None)], max_rows=6,
                   compute_stream="compute", side_stream=cuda.stream(), event_factory=lambda n: _LogEvent(n, log))
    side = f.side
    ids = [{1: rng.integers(0, 50, (2, 3)), 2: rng.integers(0, 40, (2, 3))} for _ in range(4)]
    for c in range(3):
        assert f.issue(ids[c]) == c
    assert ("record", "fetched0.1", side) in log and ("record", "fetched0.2", side) in log
    for lid, t in ((1, ta), (2, tb)):
        mark = len(log)
        got = f.take(lid, f.match(lid, ids[0][lid].reshape(-1)))
        assert log[mark:] == [("wait", f"fetched0.{lid}", "compute")]          # its own rows only
        np.testing.assert_array_equal(got.copy_to_host(), t.copy_to_host()[ids[0][lid].reshape(-1)])
        f.release(0, lid)
    mark = len(log)
    assert f.issue(ids[3]) == 0
    ops = log[mark:]
    assert ops[:2] == [("sync", "fetched0.1"), ("sync", "fetched0.2")]
    assert ops.index(("wait", "consumed0.1", side)) < ops.index(("record", "fetched0.1", side))
    assert ops.index(("wait", "consumed0.2", side)) < ops.index(("record", "fetched0.2", side))


def test_a_stale_prefetch_is_not_used(model, device_engine):
    host = EngramV41(model, max_tokens=4, tables={4: "host"}, cache_gb={4: 20 * 84 / 1e9})
    a, b = _ids(model, TINY_TOKENS[:2]), _ids(model, TINY_TOKENS[5:7])
    host.prefetch(a)
    host.rows_from_ids(4, b[:, 1, :])                              # not what was prefetched: fetched now
    device_engine.rows_from_ids(4, b[:, 1, :])
    np.testing.assert_array_equal(host.rows_bf16(4).copy_to_host(), device_engine.rows_bf16(4).copy_to_host())
    assert host._fetcher.missed == 1


# -- the hot-row cache ----------------------------------------------------------------------------
def test_cache_hits_and_bytes_per_fetch(model, device_engine, rng):
    slots = 12
    host = EngramV41(model, max_tokens=4, tables="host", cache_gb=slots * 84 / 1e9)
    train = _ids(model, rng.choice(TINY_TOKENS, 8))[:, 1, :]
    ranked = rank_rows(train)
    assert host.fill_cache(4, train) == min(slots, ranked.size)
    hot = set(ranked[:slots].tolist())
    reports = []
    for toks in (TINY_TOKENS[:3], TINY_TOKENS[3:6]):
        ids = _ids(model, toks)
        host.rows_from_ids(4, ids[:, 1, :])
        device_engine.rows_from_ids(4, ids[:, 1, :])
        np.testing.assert_array_equal(host.rows_bf16(4).copy_to_host(), device_engine.rows_bf16(4).copy_to_host())
        reports.append(sum(int(r) in hot for r in ids[:, 1, :].reshape(-1)))
    rep = host.cache_report(4)[4]
    assert [p["hits"] for p in rep["per_fetch"]] == reports
    n = model.config.n_hash_cols * 3
    assert [p["misses"] for p in rep["per_fetch"]] == [n - h for h in reports]
    assert rep["host_bytes"] == (2 * n - sum(reports)) * 84 and rep["cache_bytes"] == sum(reports) * 84
    with pytest.raises(ValueError, match="cache rows must lie in"):
        host.fill_cache(4, [model.layers[4].table.shape[0]], ranked=True)
    with pytest.raises(ValueError, match="no cache|placed 'device'"):
        device_engine.fill_cache(4, train)


def test_rank_rows_and_hit_rates_against_a_direct_count(rng):
    ids = rng.zipf(1.3, 5000) % 300
    ranked = rank_rows(ids)
    counts = np.bincount(ids, minlength=300)
    assert np.all(np.diff(counts[ranked]) <= 0) and ranked.size == np.count_nonzero(counts)
    test = rng.zipf(1.3, 3000) % 300
    rates = cache_hit_rates(ids, test, [0, 10, 1000])
    assert rates[0] == 0.0 and rates[1000] == np.isin(test, ranked).mean()
    assert rates[10] == pytest.approx(np.isin(test, ranked[:10]).mean())


# -- corpus runs prefetch the next chunk ----------------------------------------------------------
def test_corpus_lookahead_prefetches_two_jobs_before_job_k_is_computed():
    from engram_numba.analysis.corpus import PREFETCH_DEPTH, _ahead
    from engram_numba.device.hostrows import N_BUFFERS
    assert PREFETCH_DEPTH < N_BUFFERS                              # a prefetched buffer is never refilled untaken
    log = []
    for job in _ahead(iter([1, 2, 3, 4]), lambda j: log.append(("prefetch", j))):
        log.append(("compute", job))
    assert log == [("prefetch", 1), ("prefetch", 2), ("prefetch", 3), ("compute", 1), ("prefetch", 4),
                   ("compute", 2), ("compute", 3), ("compute", 4)]
    log = []
    for job in _ahead(iter([1, 2, 3]), lambda j: log.append(("prefetch", j)), depth=1):
        log.append(("compute", job))
    assert log == [("prefetch", 1), ("prefetch", 2), ("compute", 1), ("prefetch", 3), ("compute", 2),
                   ("compute", 3)]
    assert list(_ahead(iter([1, 2]), None)) == [1, 2]


@pytest.mark.slow
def test_corpus_stats_with_host_tables_prefetches_and_equals_device_tables(model):
    from engram_numba.analysis.corpus import corpus_stats
    docs = [np.array([48]), np.array([17])]                              # two one-token chunks
    runs = {}
    for where in ("device", "host"):
        eng = EngramV41(model, max_tokens=1, tables=where, wkv_format=DECODE_WKV)
        with pytest.warns(UserWarning, match="simulator"):
            runs[where] = corpus_stats(model, documents=docs, backend="cuda", chunk_tokens=1, engine=eng,
                                       contexts=False)
        if where == "host":
            assert eng.cache_report()["prefetch"] == {"issued": 2, "taken": 4, "missed": 0}   # all prefetched
    a, b = runs["device"], runs["host"]
    assert a.n_tokens == b.n_tokens == 2
    for r, s in zip(a, b):
        assert (r.n, r.mean, r.std, r.q50) == (s.n, s.mean, s.std, s.q50)
    for x, y in zip(a.row_bitmaps, b.row_bitmaps):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow      # compile-only, like the compile tier (which make test-fast leaves out too)
def test_fetch_kernel_compiles_for_sm90():
    """Compile-only (the simulator does no type checking): the fetch kernel for 4-byte words and for
    bytes, in a subprocess with the simulator off (no GPU needed)."""
    import os
    import subprocess
    import sys
    code = ("from numba import cuda, types\n"
            "from engram_numba.device.hostrows import fetch_rows_v1 as k\n"
            "for w in (types.uint32[:, ::1], types.uint8[:, ::1]):\n"
            "    sig = (w, w, w, types.int32[::1], types.int64[::1], w, types.int64[::1], types.int64)\n"
            "    ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(9, 0))\n"
            "    assert 'atom.shared' in ptx or 'atom.add' in ptx or 'red.' in ptx, 'no atomic'\n"
            "from engram_numba.device.hostrows import fetch_rows_pair_v1 as p\n"
            "w = types.uint32[:, ::1]\n"
            "one = (w, w, w, types.int32[::1], types.int64[::1], w)\n"
            "cuda.compile_ptx(p.py_func, one + one + (types.uint32[::1],), cc=(9, 0))\n"
            "from engram_numba.device.hostrows import clock_fetch_v1 as cf, clock_insert_v1 as ci\n"
            "t2, u8, i64 = types.int64[:, ::1], types.uint8[::1], types.int64[::1]\n"
            "for w in (types.uint32[:, ::1], types.uint8[:, ::1]):\n"
            "    ptx, _ = cuda.compile_ptx(cf.py_func, (w, w, w, t2, u8, i64, types.int64, i64, w, i64, types.int64), cc=(9, 0))\n"
            "    assert 'atom.global.max.s64' in ptx or 'red.global.max.s64' in ptx, 'no claim'\n"
            "    cuda.compile_ptx(ci.py_func, (w, t2, u8, u8, i64, types.int64, i64, w, i64, types.int64), cc=(9, 0))\n"
            "print('ok')\n")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


# -- the CLI -------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, why", [
    (["--table-placement", "host"], "needs the cuda backend"),
    (["--backend", "cuda", "--table-placement", "1=device,2=host"], "names layer(s) [2]"),
    (["--backend", "cuda", "--table-placement", "gpu"], "tables must be None, one of"),
])
def test_cli_stats_table_placement_refusals(tmp_path, capsys, argv, why):
    from engram_numba.cli import main
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat\n")
    code = main(["stats", str(corpus), "--out", str(tmp_path / "o"), "--tables", "csv", *argv])
    err = capsys.readouterr().err
    assert code != 0 and why in err and "Traceback" not in err and err.startswith("error:")
    assert not (tmp_path / "o").exists()                       # refused before any output


def test_cli_table_placement_spec():
    import argparse

    from engram_numba.commands.stats import table_placement_spec
    assert table_placement_spec("1=device, 14=host") == {1: "device", 14: "host"}
    assert table_placement_spec("device<=100GB") == "device<=100GB"
    with pytest.raises(argparse.ArgumentTypeError, match="not one of"):
        table_placement_spec("1=gpu")


def test_placement_report_plans_without_building(model, monkeypatch):
    """What `info` prints: the auto plan from the tables' shapes alone (nothing allocated)."""
    calls = []
    for name in ("device_array", "to_device", "pinned_array", "mapped_array"):
        monkeypatch.setattr(cuda, name, lambda *a, _n=name, **k: calls.append(_n))
    roomy = placement.placement_report(model, max_tokens=4, device_free=1 << 40, host_available=1 << 40)
    assert roomy["kind"] == "device" and roomy["host_pinned_bytes"] == 0
    t1, t4 = (roomy["layers"][lid]["table_bytes"] for lid in (1, 4))
    assert (t1, t4) == (model.layers[1].table.nbytes, model.layers[4].table.nbytes)
    other = roomy["weights_and_workspaces_bytes"]
    tight = placement.placement_report(model, max_tokens=4, device_free=placement.DEVICE_RESERVE + other + t1 + 10_000,
                                       host_available=1 << 40)
    assert [tight["layers"][lid]["placement"] for lid in (1, 4)] == ["device", "host"]
    assert tight["layers"][4]["pinned_bytes"] == t4 and t4 > 10_000
    assert tight["device_bytes_planned"] == tight["weights_and_workspaces_bytes"] + t1
    refused = placement.placement_report(model, tables="device", device_free=placement.DEVICE_RESERVE,
                                         host_available=1 << 40)
    assert "do not fit on the device" in refused["refused"]
    text = placement.format_placement(tight)
    assert "layer 4: host" in text and "pinned host" in text
    assert calls == []


def test_cli_info_reports_placement(capsys):
    import json

    from engram_numba.cli import main
    assert main(["info", str(TINY_PATH), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)["placement"]
    assert {lay["placement"] for lay in rep["layers"].values()} <= {"device", "host", "mmap"}
    assert rep["layers"]["1"]["table_bytes"] == 462 * 84


def test_cache_hits_per_chunk_add_up_to_the_hit_rate(model, rng):
    from engram_numba.bench.cache_hits import chunk_hits, run
    train, test = rng.zipf(1.4, (900, 6)) % 200, rng.zipf(1.4, (70, 6)) % 200
    ranked = rank_rows(train)
    r = chunk_hits(ranked, test, 15, 84, chunk=16)
    assert [p["tokens"] for p in r["per_chunk"]] == [16, 16, 16, 16, 6]
    assert r["hits"] == sum(np.isin(test[k:k + 16], ranked[:15]).sum() for k in range(0, 70, 16))
    assert r["hit_rate"] == pytest.approx(cache_hit_rates(train, test, [15])[15])
    assert all(p["host_bytes"] == 84 * p["misses"] and p["hits"] + p["misses"] == 6 * p["tokens"] for p in r["per_chunk"])
    docs = [rng.choice(TINY_TOKENS, 40) for _ in range(20)]
    res = run(budgets=(1e-6,), log=lambda *a: None, model=model, docs=docs)
    lay = res["layers"]["1"]["budgets"]["1e-06 GB q2k"]
    assert lay["slots"] == 11 and res["n_documents"] == {"train": 18, "held_out": 2}
    assert 0 < lay["hit_rate"] <= 1 and lay["hits"] + lay["misses"] == 80 * model.config.n_hash_cols


# -- the dynamic (CLOCK) cache --------------------------------------------------------------------
def _lru_hits_brute(seq, size):
    from collections import OrderedDict
    lru, hits = OrderedDict(), 0
    for x in seq:
        if x in lru:
            hits += 1
            lru.move_to_end(x)
        else:
            lru[x] = None
            if len(lru) > size:
                lru.popitem(last=False)
    return hits


def test_lru_stack_distances_give_the_lru_hits_of_every_size(rng):
    from engram_numba.device.hostrows import lru_stack_distances
    seq = rng.zipf(1.3, 3000) % 150
    d = lru_stack_distances(seq)
    assert d[0] == -1 and (d >= -1).all() and np.count_nonzero(d == -1) == np.unique(seq).size
    for size in (1, 4, 17, 60, 150):
        assert int(np.count_nonzero((d >= 0) & (d < size))) == _lru_hits_brute(seq.tolist(), size)


def _clock_brute(chunks, n_sets, ways):
    """The policy as written in the docs, in plain Python: per chunk, lookups first (a hit sets
    the slot's bit), then each set's lowest-positioned miss is inserted by its CLOCK hand."""
    from engram_numba.device.hostrows import clock_set_of
    tags = [[-1] * ways for _ in range(n_sets)]
    ref = [[0] * ways for _ in range(n_sets)]
    hand = [0] * n_sets
    out = []
    for ids in chunks:
        hits, claim = 0, {}
        for r, row in enumerate(ids.tolist()):
            s = int(clock_set_of([row], n_sets)[0])
            if row in tags[s]:
                ref[s][tags[s].index(row)] = 1
                hits += 1
            else:
                claim.setdefault(s, (r, row))
        for s, (r, row) in claim.items():
            j = hand[s]
            while tags[s][j] >= 0 and ref[s][j]:
                ref[s][j] = 0
                j = (j + 1) % ways
            tags[s][j], ref[s][j], hand[s] = row, 0, (j + 1) % ways
        out.append((hits, len(claim)))
    return out, tags


def test_clock_twin_follows_the_policy(rng):
    from engram_numba.device.hostrows import clock_cache_sim
    chunks = [rng.zipf(1.2, 40) % 90 for _ in range(12)]
    sim = clock_cache_sim(chunks, 5, 4)
    brute, tags = _clock_brute(chunks, 5, 4)
    assert list(zip(sim["hits"].tolist(), sim["inserted"].tolist())) == brute
    assert sim["tags"].tolist() == tags
    assert sim["hits"].sum() > 0 and (sim["inserted"] > 0).all()
    again = clock_cache_sim(chunks[6:], 5, 4, state=clock_cache_sim(chunks[:6], 5, 4))   # continued = one run
    assert again["hits"].tolist() == sim["hits"][6:].tolist()


@pytest.mark.parametrize("row_bytes, parts", [(84, (84,)), pytest.param(264, (256, 8), marks=pytest.mark.slow),
                                              pytest.param(18, (18,), marks=pytest.mark.slow)])
def test_clock_cache_fetches_bit_identical_rows_and_counts_like_its_twin(rng, row_bytes, parts):
    """The device cache (simulator) against its CPU twin, chunk by chunk: the same hits, inserts
    and final tags, bit-identical rows; words (84, 264 B) and bytes (18 B); split parts."""
    from engram_numba.device.hostrows import ClockCache, clock_cache_sim, word_dtype
    n_rows = 120
    table = rng.integers(0, 256, (n_rows, row_bytes), dtype=np.uint8)
    split = np.cumsum(parts)[:-1]
    dev_parts = [cuda.to_device(np.ascontiguousarray(p)) for p in np.split(table, split, axis=1)]
    words = word_dtype(*parts)
    cache = ClockCache(n_rows, row_bytes, 6 * 4 * row_bytes + row_bytes - 1, words)   # 6 sets of 4 ways
    assert (cache.n_sets, cache.n_slots) == (6, 24)
    f = RowFetcher([HostLayer(3, dev_parts, row_bytes, n_rows, cache)], max_rows=20, side_stream=cuda.stream())
    f.max_blocks = 2                                               # a bounded grid: the kernel strides
    chunks = [rng.zipf(1.3, 20) % n_rows for _ in range(6)]
    for c in chunks:
        got = f.take(3, f.issue({3: c}))
        np.testing.assert_array_equal(got.copy_to_host(), table[c])
    sim = clock_cache_sim(chunks, 6, 4)
    rep = cache.report()
    assert [p["hits"] for p in rep["per_fetch"]] == sim["hits"].tolist()
    assert [p["inserted"] for p in rep["per_fetch"]] == sim["inserted"].tolist()
    assert rep["hits"] > 0 and rep["policy"] == "clock" and rep["rows_held"] == int((sim["tags"] >= 0).sum())
    np.testing.assert_array_equal(cache.tags.copy_to_host(), sim["tags"])
    np.testing.assert_array_equal(cache.ref.copy_to_host(), sim["ref"])
    held = cache.tags.copy_to_host().reshape(-1)                   # every cached row is the table's row
    slots = np.flatnonzero(held >= 0)
    np.testing.assert_array_equal(cache.table.copy_to_host()[slots].view(np.uint8), table[held[slots]])


def test_clock_cache_warm_start_and_engine_rows_equal_device_tables(model, device_engine, rng):
    n = 16
    host = EngramV41(model, max_tokens=4, tables={4: "host"}, cache_gb={4: n * 84 / 1e9}, cache="clock")
    assert host.build_report["placement"]["cache"] == "clock"
    cache = host._fetcher.layers[4].cache
    assert cache.policy == "clock" and cache.n_slots == n
    train = _ids(model, rng.choice(TINY_TOKENS, 8))[:, 1, :]
    held = host.fill_cache(4, train)                               # warm start from the ranked rows
    assert 0 < held <= n and set(cache.rows.tolist()) <= set(train.reshape(-1).tolist())
    for toks in (TINY_TOKENS[:3], TINY_TOKENS[3:6], TINY_TOKENS[:3]):
        ids = _ids(model, toks)
        host.prefetch(ids)
        for e in (host, device_engine):
            e.rows_from_ids(4, ids[:, 1, :])
        np.testing.assert_array_equal(host.rows_bf16(4).copy_to_host(), device_engine.rows_bf16(4).copy_to_host())
    rep = host.cache_report(4)[4]
    assert rep["fetches"] == 3 and rep["hits"] > 0 and rep["hits"] + rep["misses"] == 3 * 3 * model.config.n_hash_cols
    assert host.fill_cache(4, [], ranked=True) == 0 and host.cache_report(4)[4]["rows_held"] == 0   # emptied


def test_clock_plan_costs_nothing_a_table_row():
    from engram_numba.device.hostrows import ClockCache, RowCache
    kw = dict(row_bytes={1: 84, 14: 84}, n_rows={1: 30 * GB // 84, 14: 30 * GB // 84},
              device_free=100 * GB, host_available=100 * GB)
    sizes = {1: 30 * GB, 14: 30 * GB}
    clock = plan_placement(sizes, "host", cache_gb=0.0625, cache="clock", **kw)
    static = plan_placement(sizes, "host", cache_gb=0.0625, **kw)
    per = clock.layers[1].cache_bytes
    assert per == ClockCache.device_bytes_for(30 * GB // 84, 84, 0.0625 * GB) and per < 0.0625 * GB * 1.2
    assert static.layers[1].cache_bytes == RowCache.device_bytes_for(30 * GB // 84, 84, 0.0625 * GB) > 4 * (30 * GB // 84)
    assert clock.as_dict()["cache"] == "clock"
    with pytest.raises(PlacementError, match="cache must be one of"):
        plan_placement(sizes, "host", cache_gb=1, cache="lru", **kw)


def test_set_cache_swaps_policy_and_budget_without_repinning(model, device_engine):
    host = EngramV41(model, max_tokens=4, tables={4: "host"}, cache_gb={4: 12 * 84 / 1e9})
    pinned = host._host_tables[4]
    assert host.set_cache({4: 8 * 84 / 1e9}, "clock") == {4: 8}
    assert host._host_tables[4] is pinned and host.build_report["placement"]["tables"] == {1: "mmap", 4: "host"}
    assert host.placement.as_dict()["cache"] == "clock" and host._fetcher.layers[4].cache.policy == "clock"
    ids = _ids(model, TINY_TOKENS[:3])
    for _ in range(2):                                             # the second read hits what the first inserted
        host.rows_from_ids(4, ids[:, 1, :])
    device_engine.rows_from_ids(4, ids[:, 1, :])
    np.testing.assert_array_equal(host.rows_bf16(4).copy_to_host(), device_engine.rows_bf16(4).copy_to_host())
    rep = host.cache_report(4)[4]
    assert rep["per_fetch"][0]["hits"] == 0 and rep["per_fetch"][1]["hits"] > 0
    assert host.set_cache(0) == {4: 0} and not host._fetcher.layers[4].cache.n_slots
    for bad, match in ((lambda: host.set_cache(1, "lfu"), "cache must be one of"),
                       (lambda: host.set_cache({1: 1}), r"names layer\(s\) \[1\]"),
                       (lambda: device_engine.set_cache(1), "no table is in host memory")):
        with pytest.raises(PlacementError, match=match):
            bad()
