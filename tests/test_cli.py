"""The `engram-numba` command: every subcommand runs and says what it did."""
import numpy as np
import pytest

from engram_numba.cli import main
from engram_numba.fixtures import TINY_PATH
from engram_numba.capture import Capture


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


@pytest.mark.parametrize("argv, message", [
    (["run", "--tokens", "1,x"], "--tokens must be comma- or space-separated integers, got '1,x'"),
    (["run", "--tokens", "1_0"], "got '1_0'"),
    (["run", "--tokens", "1.5"], "got '1.5'"),
    (["run", "--tokens", " "], "--tokens is empty"),
    (["run", "--tokens", "1,99", "--backend", "cpu"], "token id 99 at position 1 is outside the model's token map [0, 64)"),
    (["run", "--tokens", "1,-3"], "token id -3 at position 1"),
    (["run", "/no/such/model.gguf"], "model file /no/such/model.gguf does not exist"),
    (["run", "/"], "is a directory"),
    (["run", "--capture", "/no/such/dir/cap.npz"], "folder /no/such/dir does not exist"),
    (["info", "/no/such/file.gguf"], "does not exist"),
    (["diff", "/no/a.npz", "/no/b.npz"], "capture file /no/a.npz does not exist"),
])
def test_user_mistakes_are_one_line_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["run", "--backend", "gpu"], "unknown backend 'gpu'"),
    (["run", "--backend", "projection=cpu"], "expected STAGE=BACKEND"),
    (["run", "--backend", "rows=tpu"], "unknown backend 'tpu'"),
    (["diff", "--max-ulp", "-1"], "must be >= 0"),
    (["kernels", "--stage", "hash"], "invalid choice"),
])
def test_argument_errors_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_tokens_accept_spaces_and_commas(capsys):
    assert main(["run", "--tokens", "2 17,47  13", "--backend", "cpu"]) == 0
    assert "ran 4 tokens" in capsys.readouterr().out


def test_run_says_the_highway_is_synthetic(capsys):
    assert main(["run", "--tokens", "5,6", "--backend", "cpu"]) == 0
    assert "highway: synthetic" in capsys.readouterr().out


def test_info_json(capsys):
    import json
    assert main(["info", str(TINY_PATH), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["config"]["dim"] == 64 and info["config"]["layer_ids"] == [1, 4]
    assert info["layers"]["1"]["table_encoding"] == "q2k" and info["checks"][0]["ok"]
    assert any(t["name"] == "blk.4.engram_embd.weight" and t["type"] == "Q2_K" for t in info["tensors"])


def test_diff_two_saved_captures_with_tolerances(tmp_path, capsys):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    assert main(["run", "--tokens", "3,4,5", "--backend", "cpu", "--capture", str(a)]) == 0
    assert main(["run", "--tokens", "3,4,5", "--backend", "cpu", "--residual", "bf16", "--capture", str(b)]) == 0
    capsys.readouterr()
    assert main(["diff", str(a), str(a), "--max-ulp", "0"]) == 0
    assert "within tolerances" in capsys.readouterr().out
    assert main(["diff", str(a), str(b), "--max-ulp", "0"]) == 1
    out = capsys.readouterr().out
    assert "tolerance exceeded: L1.highway.out" in out and "exceed the tolerances" in out
    assert main(["diff", str(a), str(b), "--rtol", "1.0"]) == 0
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a capture")
    assert main(["diff", str(a), str(bad)]) == 2
    assert "is not a capture saved by engram-numba" in capsys.readouterr().err


def test_kernels_lists_the_registry(capsys):
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    for name in ("q2k_v3", "gemv_v3", "gemm_v3", "gate_v2"):
        assert name in out


def test_bench_smoke_runs_the_suite_in_the_simulator(tmp_path, capsys):
    from numba.cuda import config
    if not config.ENABLE_CUDASIM:
        pytest.skip("a GPU is present: the smoke run is for machines without one")
    import json
    out = tmp_path / "smoke.json"
    assert main(["bench", "--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {r["stage"] for r in res["records"]} == {"gather_dequant", "projection", "gate", "apply", "projection_q2k",
                                                   "projection_fp8", "decode_step", "engine_build"}
    assert all(r["validated"] for r in res["variants"]) and res["variants"]
    assert (tmp_path / "smoke.png").stat().st_size > 1000


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
    for needle in ("reference vs cpu: 22/22 points bit-identical", "reference vs cuda: 22/22 points bit-identical",
                   "residual fp32 vs residual bf16", "gate statistics", "gate heatmap saved to"):
        assert needle in text
    assert (tmp_path / "gate_heatmap.png").stat().st_size > 10_000
    cap = Capture.load(tmp_path / "reference_capture.npz")
    assert np.isfinite(cap["L4.highway.out"]).all()
