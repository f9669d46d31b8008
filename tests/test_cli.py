"""The `engram-numba` command: every subcommand runs and says what it did."""
import numpy as np
import pytest

from engram_numba.cli import main
from engram_numba.fixtures import TINY_PATH
from engram_numba.pipeline import Capture


def test_run_saves_captures(tmp_path, capsys):
    out = tmp_path / "cap.npz"
    assert main(["run", str(TINY_PATH), "--tokens", "2,17,47,13", "--backend", "cpu", "--capture", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ran 4 tokens" in text and "gate statistics" in text and str(out) in text
    cap = Capture.load(out)
    assert cap["tokens.ids"].tolist() == [2, 17, 47, 13] and cap["L4.gate.gate"].shape == (4, 4)


def test_run_per_stage_backends(capsys):
    assert main(["run", "--tokens", "5,6", "--backend", "rows=cpu,proj=cpu,gate=reference"]) == 0
    assert "'rows': 'cpu'" in capsys.readouterr().out


def test_run_rejects_bad_tokens():
    with pytest.raises(SystemExit, match="comma-separated integers"):
        main(["run", "--tokens", "1,x"])
    with pytest.raises(ValueError, match="token id 99 at position 1"):
        main(["run", "--tokens", "1,99", "--backend", "cpu"])


def test_diff_command(capsys):
    assert main(["diff", str(TINY_PATH), "--a", "reference", "--b", "cpu", "--tokens", "3,4,5"]) == 0
    text = capsys.readouterr().out
    assert "reference vs cpu" in text and "L1.proj.kv" in text


def test_make_fixture_elsewhere(tmp_path, capsys):
    out = tmp_path / "t.gguf"
    assert main(["make-fixture", "--out", str(out)]) == 0
    assert out.read_bytes() == TINY_PATH.read_bytes()
    assert (tmp_path / "t_golden.npz").exists()


def test_bench_needs_a_gpu_and_says_so(capsys):
    from numba.cuda import config
    if not config.ENABLE_CUDASIM:
        pytest.skip("a GPU is present")
    assert main(["bench"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_hash_only_runs_on_the_cpu(capsys):
    assert main(["bench", "--hash-only"]) == 0
    assert "4096-token prefill" in capsys.readouterr().out


@pytest.mark.slow
def test_demo(tmp_path, capsys):
    """The README's main job, end to end (about 30 s here: the cuda stages run in the simulator)."""
    assert main(["demo", "--out-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    for needle in ("reference vs cpu", "reference vs cuda", "residual fp32 vs residual bf16",
                   "gate statistics", "gate heatmap saved to"):
        assert needle in text
    assert (tmp_path / "gate_heatmap.png").stat().st_size > 10_000
    cap = Capture.load(tmp_path / "reference_capture.npz")
    assert np.isfinite(cap["L4.highway.out"]).all()
