"""Corpus statistics in shards and on Dask: shards cut on document boundaries read exactly what
the whole-file readers read; parquet and saved Hugging Face datasets; a LocalCluster of two CPU
workers gives the one-process statistics exactly, also when a worker is killed mid-run and when
a run resumes from partial files; foreign or corrupt partial files are refused by name."""
import json
import os
import signal
import threading
import time

import numpy as np
import pytest

from test_corpus import assert_same_stats, make_corpus

from engram_numba.analysis import distributed as dist
from engram_numba.analysis.corpus import _id_documents, _jsonl_documents, _text_documents, corpus_files, corpus_stats
from engram_numba.analysis.shards import plan_shards, shard_pairs
from engram_numba.analysis.streaming import merge
from engram_numba.fixtures import TINY_PATH
from engram_numba.formats.schema_a import load_gguf


@pytest.fixture(scope="module")
def model():
    return load_gguf(TINY_PATH)


def _same_pairs(got, want):
    assert [n for n, _ in got] == [n for n, _ in want]
    for (n, a), (_, b) in zip(got, want):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b, err_msg=n)
        else:
            assert a == b, n


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
def test_shards_cut_on_document_boundaries_read_what_the_whole_file_reader_reads(tmp_path, newline):
    """Text by line and by paragraph, JSONL and .ids, cut into many small byte ranges (and 2-D .npy
    into row ranges): the shards' documents, in shard order, are the whole file's, names and all."""
    lines = make_corpus(60, seed=5)
    paras = newline.join(lines[:20]) + newline + newline + "  " + newline + newline.join(lines[20:40]) + \
        newline * 3 + newline.join(lines[40:])
    (tmp_path / "a.txt").write_bytes(("\ufeff" + newline.join(lines) + newline).encode())
    (tmp_path / "p.txt").write_bytes(paras.encode())
    (tmp_path / "d.jsonl").write_bytes(newline.join(json.dumps({"text": t}) for t in lines).encode())
    rng = np.random.default_rng(1)
    (tmp_path / "t.ids").write_bytes(newline.join(" ".join(map(str, rng.integers(0, 99, int(rng.integers(1, 9)))))
                                                  for _ in range(50)).encode())
    np.save(tmp_path / "m.npy", rng.integers(0, 99, (37, 5)))
    for name, split, reader in (("a.txt", "line", lambda p: _text_documents(p, "line")),
                                ("p.txt", "paragraph", lambda p: _text_documents(p, "paragraph")),
                                ("d.jsonl", "line", lambda p: _jsonl_documents(p, "text")),
                                ("t.ids", "line", lambda p: _id_documents(p, "ids")),
                                ("m.npy", "line", lambda p: _id_documents(p, "npy"))):
        path = tmp_path / name
        for size in (1, 97, 1 << 20):
            plan = plan_shards([path], split=split, shard_bytes=size)
            assert [s.index for s in plan] == list(range(len(plan)))
            if size == 1 and name not in ("p.txt", "m.npy") and newline != "\r":   # cuts are at \n only
                assert len(plan) > 10, name
            got = [p for s in plan for p in shard_pairs(s)]
            want = [(n.replace(str(path), str(path.resolve())), v) for n, v in reader(path)]
            _same_pairs(got, want)
    with pytest.raises(ValueError, match="shard_bytes"):
        plan_shards([tmp_path / "a.txt"], shard_bytes=0)


def _write_parquet_and_dataset(tmp_path, lines):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    table = pa.table({"id": list(range(len(lines))), "text": lines})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=7)
    ds = tmp_path / "saved"                      # the layout of datasets' Dataset.save_to_disk
    ds.mkdir()
    half = len(lines) // 2
    files = []
    for k, part in enumerate((lines[:half], lines[half:])):
        name = f"data-{k:05d}-of-00002.arrow"
        t = pa.table({"text": part, "n": [len(x) for x in part]})
        with pa.OSFile(str(ds / name), "wb") as sink, pa.ipc.new_stream(sink, t.schema) as w:
            for b in t.to_batches(max_chunksize=5):
                w.write_batch(b)
        files.append({"filename": name})
    (ds / "state.json").write_text(json.dumps({"_data_files": files, "_fingerprint": "x", "_format_type": None,
                                               "_split": "train"}))
    (ds / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string", "_type": "Value"}}}))
    return tmp_path / "c.parquet", ds


def test_parquet_and_saved_datasets_stream_as_their_texts(tmp_path, model):
    lines = make_corpus(40, seed=9)
    lines[3] = ""                                # empty rows are skipped, as empty lines are
    pq_path, ds = _write_parquet_and_dataset(tmp_path, lines)
    want = corpus_stats(model, texts=[t for t in lines if t], backend="cpu")
    assert [f.name for f in corpus_files(ds)] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    for corpus in (pq_path, ds):
        assert_same_stats(want, corpus_stats(model, corpus, backend="cpu"))
        plan = plan_shards(corpus_files(corpus), shard_bytes=200)
        assert len(plan) > 2
        settings = dist._settings("cpu", 4096, None, "text", "line", None, True, 20, 200_000, True, True, "fp32", None)
        parts = [dist.run_shard(s, None, dist.PathModel(TINY_PATH), settings, None, dist.model_identity(model))
                 for s in plan]
        assert_same_stats(want, merge([p.stats() for p in parts]))
    with pytest.raises(ValueError, match="no column 'body'"):
        corpus_stats(model, pq_path, backend="cpu", field="body")
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(ValueError, match="several splits.*train, test"):
        corpus_files(tmp_path / "dd")


def test_without_dask_the_api_and_the_flags_say_how_to_install_it(tmp_path, monkeypatch, capsys):
    import sys
    from engram_numba import cli
    monkeypatch.setitem(sys.modules, "distributed", None)
    (tmp_path / "c.txt").write_text("the cat sat\n")
    with pytest.raises(ImportError, match=r"engram-numba\[distributed\]"):
        dist.distributed_corpus_stats(TINY_PATH, tmp_path / "c.txt", out=tmp_path / "o", workers=2)
    assert cli.main(["stats", str(tmp_path / "c.txt"), "--workers", "2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "engram-numba[distributed]" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="continuous"):
        dist.distributed_corpus_stats(TINY_PATH, tmp_path / "c.txt", out=tmp_path / "o", continuous=True)


def test_a_worker_started_with_dasks_malloc_trim_gets_glibcs_thresholds(monkeypatch):
    """Dask's nanny sets MALLOC_TRIM_THRESHOLD_, which pins glibc's mmap threshold at 128 KB (every
    chunk's temporaries faulted in afresh): a worker that has it set raises the thresholds when it
    builds its engine; one without it is left alone."""
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    assert dist._malloc_as_a_process() is False
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "65536")
    import platform
    if not (os.uname().sysname == "Linux" and platform.libc_ver()[0] == "glibc"):
        pytest.skip("mallopt is glibc's")
    assert dist._malloc_as_a_process() is True


# On a LocalCluster ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client():
    pytest.importorskip("distributed")
    import dask
    from distributed import Client
    # a killed worker's nanny restarts it; on a loaded machine that can take longer than the 15 s
    # after which the cluster object gives a lost worker's name up and closes its nanny
    with dask.config.set({"distributed.deploy.lost-worker-timeout": "300s"}):
        cluster = dist.local_cluster(2, dashboard=False)
        c = Client(cluster)
        yield c
        c.close()
        cluster.close()


@pytest.fixture(scope="module")
def study(tmp_path_factory, model):
    """A small corpus in two files and its one-process statistics."""
    root = tmp_path_factory.mktemp("corpus")
    lines = make_corpus(72, seed=21)
    (root / "a.txt").write_text("\n".join(lines[:40]) + "\n", encoding="utf-8")
    (root / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in lines[40:]) + "\n", encoding="utf-8")
    return root, corpus_stats(model, root, backend="cpu")


def _fake_profiler(dask_worker=None, check=False):
    """On a worker: stand-ins for Dask's profiler callbacks, running (check=True: are they running?
    then removed)."""
    from tornado.ioloop import PeriodicCallback
    pcs = dask_worker.periodic_callbacks
    if check:
        ok = all(pcs[k].is_running() for k in ("profile", "profile-cycle"))
        for k in ("profile", "profile-cycle"):
            pcs.pop(k).stop()
        return ok
    for k in ("profile", "profile-cycle"):
        if k not in pcs:
            pcs[k] = PeriodicCallback(lambda: None, 10_000)
            pcs[k].start()
    return True


@pytest.mark.slow
def test_two_cpu_workers_give_the_one_process_statistics_and_resume(tmp_path, client, study, model):
    root, want = study
    out = tmp_path / "run"
    st = dist.distributed_corpus_stats(TINY_PATH, root, out=out, client=client, shard_bytes=600, progress=False)
    assert_same_stats(want, st)
    summary = st.meta["distributed"]
    n = summary["shards"]
    assert n >= 4 and summary["computed"] == n and summary["tokens"] == want.n_tokens
    assert summary["workers"] == 2 and sum(w["tokens"] for w in summary["per_worker"].values()) == want.n_tokens
    assert [d["shard"] for d in summary["per_shard"]] == list(range(n))
    assert sum(d["tokens"] for d in summary["per_shard"]) == want.n_tokens
    assert all(d["seconds"] > 0 and d["timing"]["wall_s"] > 0 and d["worker"] in summary["per_worker"]
               for d in summary["per_shard"])
    parts = sorted((out / "parts").glob("shard-*.npz"))
    assert len(parts) == n and (out / "parts" / "plan.json").is_file()
    # a worker that died after sending a shard's statistics but before writing its part file: the
    # driver finds the file missing at the end, recomputes that shard and writes it
    from engram_numba.analysis.streaming import DEFAULT_MAX_CONTEXTS
    plan = [(s, None) for s in plan_shards(corpus_files(root), shard_bytes=600)]
    settings = dist._settings("cpu", 4096, None, "text", "line", None, True, 20, DEFAULT_MAX_CONTEXTS, True, True,
                              "fp32", None)
    before = dist.load_partial(str(parts[2])).stats()
    parts[2].unlink()
    assert dist._rewrite_lost_parts(client, plan, {}, out, dist.PathModel(TINY_PATH), settings,
                                    dist.model_identity(model), None) == 1
    assert_same_stats(before, dist.load_partial(str(parts[2])).stats())
    # an interrupted run: two shards' files missing; the rerun computes just those two
    parts[1].unlink()
    parts[-1].unlink()
    # the clusters local_cluster starts run without Dask's statistical profiler; on a cluster given to
    # the run a running profiler is stopped for the run (it took the GIL from every shard) and started again
    assert not any(client.run(lambda dask_worker: "profile" in dask_worker.periodic_callbacks).values())
    assert not any(client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_")).values())   # malloc as in process
    client.run(_fake_profiler)
    assert all(client.run(dist._quiet_workers).values())          # stops them, says they were running
    assert not any(client.run(lambda dask_worker: dask_worker.periodic_callbacks["profile"].is_running()).values())
    client.run(dist._quiet_workers, start=True)
    again = dist.distributed_corpus_stats(TINY_PATH, root, out=out, client=client, shard_bytes=600, progress=False)
    assert all(client.run(_fake_profiler, check=True).values())
    assert again.meta["distributed"]["computed"] == 2 and again.meta["distributed"]["skipped"] == n - 2
    assert_same_stats(want, again)
    # refused by name: a corrupt file, a file of another shard, another study in the same folder
    parts[0].write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=f"{parts[0].name} cannot be read"):
        dist.distributed_corpus_stats(TINY_PATH, root, out=out, client=client, shard_bytes=600, progress=False)
    os.replace(parts[2], parts[0])
    with pytest.raises(ValueError, match=f"{parts[0].name} belongs to another study.*shard.index"):
        dist.distributed_corpus_stats(TINY_PATH, root, out=out, client=client, shard_bytes=600, progress=False)
    with pytest.raises(ValueError, match="another study.*settings"):
        dist.distributed_corpus_stats(TINY_PATH, root, out=out, client=client, shard_bytes=600, progress=False,
                                      bins=10)


@pytest.mark.slow
def test_a_worker_killed_mid_run_changes_nothing(tmp_path, client, study):
    root, want = study
    out = tmp_path / "run"
    pids = client.run(os.getpid)
    victim = sorted(pids.items())[1][1]
    killed = []

    def kill_after_the_first_shard():
        deadline = time.time() + 300
        while time.time() < deadline and not list((out / "parts").glob("shard-*.npz")):
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        killed.append(len(list((out / "parts").glob("shard-*.npz"))))
    t = threading.Thread(target=kill_after_the_first_shard, daemon=True)
    t.start()
    st = dist.distributed_corpus_stats(TINY_PATH, root, out=out, client=client, shard_bytes=300, progress=False)
    t.join()
    assert_same_stats(want, st)
    n = st.meta["distributed"]["shards"]
    assert killed and killed[0] < n                    # the worker died with shards still to do
    client.wait_for_workers(2, timeout=300)            # its nanny brings it back for the next test
    assert len(list((out / "parts").glob("shard-*.npz"))) == n


@pytest.mark.slow
def test_the_stats_command_on_a_scheduler_writes_the_one_process_results(tmp_path, client, study, capsys):
    from engram_numba import cli
    from engram_numba.analysis.streaming import StreamingGateStats
    root, want = study
    out = tmp_path / "study"
    addr = client.scheduler.address
    rc = cli.main(["stats", str(root), "--scheduler", addr, "--out", str(out), "--shard-mb", "0.003",
                   "--tables", "csv"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "worker(s)" in text and "shard(s)" in text and "tokens/s" in text and "engram-" in text
    assert_same_stats(want, StreamingGateStats.load(out / "stats.npz"))
    assert (out / "summary.md").is_file() and list((out / "parts").glob("shard-*.npz"))
    for bad, msg in ((["--workers", "2", "--scheduler", addr], "not both"),
                     (["--scheduler", addr, "--continuous"], "--continuous needs the corpus in one process")):
        assert cli.main(["stats", str(root), "--out", str(tmp_path / "x"), *bad]) == 2
        assert msg in capsys.readouterr().err
