"""EngramConfig: derived widths and validation that names the field and the value."""
import pytest

from engram_numba.config import EngramConfig


def test_released_shapes():
    cfg = EngramConfig.released()
    assert (cfg.dim, cfg.hc, cfg.layer_ids, cfg.max_ngram_size, cfg.n_heads, cfg.head_dim) == (5120, 4, (1, 14), 4, 8, 256)
    assert cfg.n_hash_cols == 24 and cfg.proj_in == 6144 and cfg.proj_out == 25600 and cfg.eps == 1e-20
    assert cfg.layer_index(14) == 1


@pytest.mark.parametrize("hc", [1, 2, 3, 4])
def test_hc_one_to_four(hc):
    assert EngramConfig(dim=64, hc=hc, layer_ids=(1,)).proj_out == 64 * (hc + 1)


@pytest.mark.parametrize("kwargs, match", [
    ({"hc": 0}, "hc must be a positive integer, got 0"),
    ({"hc": 5}, r"hc must be in 1..=4, got 5"),
    ({"dim": -64}, "dim must be a positive integer, got -64"),
    ({"dim": 64.0}, "dim must be a positive integer, got 64.0"),
    ({"layer_ids": ()}, "layer_ids must name at least one layer"),
    ({"layer_ids": (1, 1)}, r"layer_ids must be unique, got \(1, 1\)"),
    ({"layer_ids": (1, -2)}, "layer_ids must be non-negative, got -2"),
    ({"head_dim": 128}, "head_dim must be 256 for the table encodings .* got 128"),
    ({"head_dim": 128, "table_type": "q8_0"}, "head_dim must be 256 for q8_0 tables: every row holds 256 values, got 128"),
    ({"max_ngram_size": 1}, "max_ngram_size must be >= 2"),
    ({"n_heads": 0}, "n_heads must be a positive integer, got 0"),
    ({"eps": -1.0}, "eps must be a non-negative float, got -1.0"),
])
def test_validation_names_field_and_value(kwargs, match):
    args = {"dim": 64, "hc": 4, "layer_ids": (1, 4)} | kwargs
    with pytest.raises(ValueError, match=match):
        EngramConfig(**args)


def test_the_default_table_type_is_unknown_not_q2k():
    assert EngramConfig(dim=64, hc=1, layer_ids=(0,)).table_type == ""


def test_head_dim_free_for_other_table_types():
    assert EngramConfig(dim=64, hc=1, layer_ids=(0,), head_dim=128, table_type="F32").proj_in == 3 * 8 * 128


def test_unknown_layer_is_named():
    with pytest.raises(ValueError, match=r"layer id 7 is not an engram layer of this model \(engram layers: \[1, 4\]\)"):
        EngramConfig(dim=64, hc=4, layer_ids=(1, 4)).layer_index(7)
