"""cuBLAS as a projection backend, for comparison: kv = bf16(x @ wkv^T) through PyTorch.

Never a default: it is there so that a run can put cuBLAS's numerics next to the numba kernels'
stage by stage (`Pipeline(model, {"proj": "cuda"}, versions={"proj": "cublas_v1"})`, or
`project(x, wkv, version="cublas_v1")`). It needs PyTorch with CUDA (the optional extra
`engram-numba[cublas]`); without it, or in numba's simulator, `prepare` says so before anything
runs.

The prepared launch wraps x, wkv and out as torch tensors once (no copies: `torch.as_tensor`
reads `__cuda_array_interface__`; bf16 words are viewed as torch.bfloat16) and each call runs
`torch.matmul(x, wkv.T, out=out)` on the launch's stream. cuBLAS accumulates in fp32; torch's
permission for reduced-precision (bf16) reductions inside split-K is switched off for the call, so
the result is held to the same tolerance as the numba kernels (docs/numerics.md).
"""
from __future__ import annotations

from ...device.intrinsics import SIMULATOR

INSTALL_HINT = "pip install 'engram-numba[cublas]' (PyTorch with CUDA)"


class TorchLaunch:
    """A prepared cuBLAS projection: calling it runs the matmul into `out` and returns `out`."""

    __slots__ = ("name", "out", "grid", "block", "_run")

    def __init__(self, name: str, run, out):
        self.name, self._run, self.out = name, run, out
        self.grid = self.block = None

    def __call__(self):
        self._run()
        return self.out

    def __repr__(self) -> str:
        return f"TorchLaunch({self.name}: torch.matmul -> cuBLAS)"


def _torch():
    try:
        import torch
    except ImportError:
        raise RuntimeError(f"proj version cublas_v1 runs cuBLAS through PyTorch, which is not installed: "
                           f"{INSTALL_HINT}") from None
    if not torch.cuda.is_available():
        raise RuntimeError("proj version cublas_v1: PyTorch is installed but sees no CUDA GPU "
                           f"(a CPU-only build?): {INSTALL_HINT}")
    return torch


def _torch_stream(torch, stream):
    """The torch stream for a numba stream (0: the default stream)."""
    if stream is None or (isinstance(stream, int) and stream == 0):
        return torch.cuda.default_stream()
    handle = getattr(stream, "handle", stream)
    ptr = getattr(handle, "value", None)
    if ptr is None:
        ptr = int(handle)
    return torch.cuda.ExternalStream(int(ptr)) if ptr else torch.cuda.default_stream()


def prepare_cublas_v1(x, wkv, out, *, stream=0) -> TorchLaunch:
    """prepare(x, wkv, out, *, stream=0) -> a launch of torch.matmul (cuBLAS) into out."""
    if SIMULATOR:
        raise RuntimeError("proj version cublas_v1 calls cuBLAS on a GPU; numba's CUDA simulator has none "
                           "(pick a numba kernel such as gemm_v1 there)")
    torch = _torch()
    tx = torch.as_tensor(x, device="cuda").view(torch.bfloat16)        # [T, K]
    tw = torch.as_tensor(wkv, device="cuda").view(torch.bfloat16)      # [N, K]
    to = torch.as_tensor(out, device="cuda").view(torch.bfloat16)      # [T, N]
    ts = _torch_stream(torch, stream)
    flags = torch.backends.cuda.matmul

    def run():
        allowed = flags.allow_bf16_reduced_precision_reduction
        flags.allow_bf16_reduced_precision_reduction = False
        try:
            with torch.cuda.stream(ts):
                torch.matmul(tx, tw.t(), out=to)
        finally:
            flags.allow_bf16_reduced_precision_reduction = allowed

    return TorchLaunch("cublas_v1", run, out)


def launcher(rec, x, wkv, out, *, stream=0) -> TorchLaunch:
    """The record's launcher (cuBLAS needs no kernel of ours: no geometry, nothing to compile)."""
    return prepare_cublas_v1(x, wkv, out, stream=stream)
