"""Split GGUFs (docs/formats.md section 3): shards found from the -NNNNN-of-MMMMM name, every
shard mapped, checked against split.no / split.count / split.tensors.count, tensors in any shard."""
import shutil

import numpy as np
import pytest

import engram_numba as en
from engram_numba.fixtures import TINY_PATH, TINY_TOKENS, format_paths
from engram_numba.formats import errors as E
from engram_numba.formats import schema_a as mf
from engram_numba.formats.split import write_split_gguf
from engram_numba.pipeline import Pipeline

from formats_helpers import schema_a_layers, tiny_config, tiny_tables

SPLIT_DIR = format_paths()["split"]


@pytest.fixture
def split_model(tmp_path, rng):
    """A 3-shard schema-A split: (shard paths, layers, kvs, tensors)."""
    config, tables = tiny_config(), tiny_tables()
    layers = schema_a_layers(rng, config, tables)
    kvs, tensors = mf.build_gguf_entries(config, tables, layers)
    paths = write_split_gguf(tmp_path / "m", kvs, [tensors[:1], tensors[1:6], tensors[6:]])
    return paths, layers, kvs, tensors


def test_any_shard_or_the_folder_opens_the_whole_model(split_model):
    paths, layers, _, _ = split_model
    for p in (*paths, paths[0].parent):
        with en.load_model(p) as m:
            assert m.format == "split gguf (3 shards, schema A, q2k tables)"
            assert m.shards == [str(x) for x in paths]
            assert len(m.tensors) == 8
            for lid in (1, 4):
                np.testing.assert_array_equal(m.layers[lid].table, layers[lid]["table"])
                np.testing.assert_array_equal(m.layers[lid].wkv_raw, layers[lid]["wkv"])
                np.testing.assert_array_equal(m.layers[lid].q_weight, layers[lid]["q_weight"])
            # shard 1 holds only layer 1's table; its wkv is in shard 2
            assert m.tensors["blk.1.engram_embd.weight"].shard == 0 and m.tensors["blk.1.engram_wkv.weight"].shard == 1
    with en.load_gguf(paths[2]) as m:   # load_gguf reads schema-A splits too
        assert m.layers[4].n_rows == 630


def test_fixture_split_equals_the_single_file():
    single, split = en.load_model(TINY_PATH), en.load_model(SPLIT_DIR)
    assert split.format == "split gguf (3 shards, schema A, q2k tables)"
    for lid in (1, 4):
        np.testing.assert_array_equal(split.layers[lid].table, single.layers[lid].table)
        np.testing.assert_array_equal(split.layers[lid].wkv_bf16(), single.layers[lid].wkv_bf16())
    a = Pipeline(single, "reference").run(TINY_TOKENS)
    b = Pipeline(split, "cpu").run(TINY_TOKENS)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_missing_shard_names_the_file(split_model):
    paths, *_ = split_model
    paths[1].unlink()
    for p in (paths[0], paths[2], paths[0].parent):
        with pytest.raises(E.MissingShardError, match=r"1 of 3 shards missing: m-00002-of-00003\.gguf"):
            en.load_model(p)


def test_shards_of_two_splits(split_model, tmp_path, rng):
    paths, layers, kvs, tensors = split_model
    other = tmp_path / "other"
    other.mkdir()
    config, tables = tiny_config(), tiny_tables()
    kvs2, tensors2 = mf.build_gguf_entries(config, tables, schema_a_layers(rng, config, tables))
    # the same count of shards, another cut: shard 2 of the other split put in place of ours
    others = write_split_gguf(other / "m", kvs2, [tensors2[:3], tensors2[3:4], tensors2[4:]])
    shutil.copy(others[1], paths[1])
    with pytest.raises(E.MixedSplitError, match="different splits"):
        en.load_model(paths[0])
    # two splits in one folder: refuse to guess
    folder = tmp_path / "both"
    folder.mkdir()
    write_split_gguf(folder / "a", kvs, [tensors[:4], tensors[4:]])
    write_split_gguf(folder / "b", kvs, [tensors[:4], tensors[4:]])
    with pytest.raises(E.MixedSplitError, match="holds shards of 2 different splits"):
        en.load_model(folder)


def test_same_tensor_in_two_shards(tmp_path, split_model):
    _, _, kvs, tensors = split_model
    paths = write_split_gguf(tmp_path / "dup", kvs, [tensors[:5], tensors[4:]])
    # split.tensors.count counts 9 (as written), and blk.4's table is in both shards
    with pytest.raises(E.MixedSplitError, match=r"tensor 'blk\.4\.engram_embd\.weight' appears in two shards"):
        en.load_model(paths[0])


def test_wrong_split_no(tmp_path, split_model):
    _, _, kvs, tensors = split_model
    paths = write_split_gguf(tmp_path / "w", kvs, [tensors[:4], tensors[4:]])
    paths[0].rename(tmp_path / "x")
    paths[1].rename(paths[0])
    (tmp_path / "x").rename(paths[1])           # the two shards swapped
    with pytest.raises(E.BadSplitNumberError, match=r"w-00001-of-00002\.gguf: split\.no = 1, but the file name makes "
                                                    r"it shard 1 of 2"):
        en.load_model(paths[0])


def test_split_count_and_tensor_count_checked(tmp_path, split_model):
    _, _, kvs, tensors = split_model
    from engram_numba.formats.gguf import write_gguf_raw
    p = tmp_path / "c-00001-of-00002.gguf"
    write_gguf_raw(p, kvs + [("split.no", "u16", 0), ("split.count", "u16", 3), ("split.tensors.count", "i32", 8)],
                   tensors[:4])
    write_gguf_raw(tmp_path / "c-00002-of-00002.gguf",
                   [("split.no", "u16", 1), ("split.count", "u16", 3), ("split.tensors.count", "i32", 8)], tensors[4:])
    with pytest.raises(E.MixedSplitError, match=r"split\.count = 3, but the file name .* say 2 shards"):
        en.load_model(p)
    write_gguf_raw(p, kvs + [("split.no", "u16", 0), ("split.count", "u16", 2), ("split.tensors.count", "i32", 9)],
                   tensors[:4])
    write_gguf_raw(tmp_path / "c-00002-of-00002.gguf",
                   [("split.no", "u16", 1), ("split.count", "u16", 2), ("split.tensors.count", "i32", 9)], tensors[4:])
    with pytest.raises(E.MixedSplitError, match=r"split\.tensors\.count = 9, but the 2 shards hold 8 tensors"):
        en.load_model(p)


def test_a_shard_without_its_name(tmp_path, split_model):
    paths, *_ = split_model
    renamed = tmp_path / "renamed.gguf"
    shutil.copy(paths[0], renamed)
    with pytest.raises(E.BadSplitNumberError, match=r"split\.count = 3, so this is one shard .* keep gguf-split's "
                                                    r"file names"):
        en.load_model(renamed)


def test_info_describes_a_split(capsys):
    from engram_numba.cli import main
    assert main(["info", str(SPLIT_DIR)]) == 0
    out = capsys.readouterr().out
    for needle in ("split gguf (3 shards, schema A, q2k tables)", "shards    3", "tiny_v41-00002-of-00003.gguf",
                   "shard 3", "split: 3 shards, split.no 0..2 as named", "layer 4: primes sum 630, table rows 630  OK"):
        assert needle in out, needle
