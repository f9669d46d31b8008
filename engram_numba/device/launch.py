"""Prepared kernel launches: validate and convert the arguments once, launch many times.

A launcher such as `projection.project` checks its arguments, builds zero-copy views (a uint32
view of bf16 words, a flat view of a matrix) and picks a kernel and grid: on the H200 that Python
work cost several hundred microseconds per call, more than the kernel at T=1. `prepare_*`
functions do that work once and return a `PreparedLaunch`; calling it only launches. `EngramV41`
keeps one per layer and token count, which is what decode steps reuse.
"""
from __future__ import annotations


class PreparedLaunch:
    """One kernel launch with fixed arguments. `out` is the array the launch writes (if any)."""

    __slots__ = ("name", "configured", "args", "out", "grid", "block")

    def __init__(self, name: str, kernel, grid, block, stream, args: tuple, out=None):
        self.name = name
        self.grid, self.block = grid, block
        self.configured = kernel[grid, block, stream]   # numba's launch configuration, reusable
        self.args = args
        self.out = out

    def __call__(self):
        self.configured(*self.args)
        return self.out

    def __repr__(self) -> str:
        return f"PreparedLaunch({self.name}, grid={self.grid}, block={self.block})"


class NoLaunch:
    """A prepared launch with nothing to do (an empty shape)."""

    __slots__ = ("name", "out")

    def __init__(self, name: str, out=None):
        self.name, self.out = name, out

    def __call__(self):
        return self.out
