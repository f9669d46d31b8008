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

    def __init__(self, name: str, kernel, grid, block, stream, args: tuple, out=None, sharedmem: int = 0):
        self.name = name
        self.grid, self.block = grid, block
        # numba's launch configuration, reusable; sharedmem: bytes of dynamic shared memory
        self.configured = kernel[grid, block, stream, sharedmem] if sharedmem else kernel[grid, block, stream]
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


SHARED_STATIC_LIMIT = 48 * 1024


def allow_dynamic_shared(kernel, args: tuple, nbytes: int) -> None:
    """Let `kernel`'s specialisation for `args` launch with `nbytes` of dynamic shared memory.

    Above 48 KiB a kernel must opt in (the driver's MAX_DYNAMIC_SHARED_SIZE_BYTES attribute) or its
    launch fails; numba does not do it, so the launcher compiles the specialisation the launch will
    pick (same argument types) and sets the attribute once. No-op in numba's simulator."""
    from numba.cuda import config
    if config.ENABLE_CUDASIM or nbytes <= SHARED_STATIC_LIMIT:
        return
    from numba.cuda.cudadrv.driver import binding, driver
    compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
    cufunc = compiled._codelibrary.get_cufunc()
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, int(nbytes), cufunc.handle, cufunc.device.id)
