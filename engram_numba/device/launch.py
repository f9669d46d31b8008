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


class ClusterLaunch(PreparedLaunch):
    """A prepared launch whose CTAs run in thread-block clusters of `cluster` (x, y, z) CTAs (sm_90).

    numba-cuda 0.30.4's launch has no cluster dimension, so this one does what its kernel launch
    does (the specialisation for `args`, its arguments flattened once) and passes a cuda.core
    `LaunchConfig` with `cluster`, whose `grid` counts clusters (`grid` here counts CTAs: each of
    its dimensions must be a multiple of the cluster's). The arguments are flattened at
    construction: `args` is not read again. In numba's simulator, which has no clusters, it is a
    plain launch of the same grid."""

    __slots__ = ("cluster", "_kernel", "_config", "_stream", "_flat")

    def __init__(self, name: str, kernel, grid, block, stream, args: tuple, out=None, sharedmem: int = 0,
                 cluster=(2, 1, 1)):
        super().__init__(name, kernel, grid, block, stream, args, out, sharedmem)
        grid3 = tuple(grid) + (1,) * (3 - len(grid)) if isinstance(grid, tuple) else (int(grid), 1, 1)
        self.cluster = tuple(cluster)
        if any(g % c for g, c in zip(grid3, self.cluster)):
            raise ValueError(f"{name}: grid {grid3} is not a whole number of clusters of {self.cluster}")
        from numba.cuda import config
        self._kernel = None
        if config.ENABLE_CUDASIM:
            return
        from cuda.core import LaunchConfig
        from numba.cuda.cudadrv import driver
        compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
        self._stream = driver._to_core_stream(stream)
        flat, retr = [], []
        for t, v in zip(compiled.argument_types, args):
            compiled._prepare_args(t, v, stream, retr, flat)
        if retr:
            raise ValueError(f"{name}: a cluster launch takes device arrays only (an argument needs a copy back)")
        self._flat = flat
        self._kernel = compiled._codelibrary.get_cufunc().kernel
        self._config = LaunchConfig(grid=tuple(g // c for g, c in zip(grid3, self.cluster)), cluster=self.cluster,
                                    block=block, shmem_size=sharedmem)

    def __call__(self):
        if self._kernel is None:
            return super().__call__()
        from cuda.core import launch
        launch(self._stream, self._config, self._kernel, *self._flat)
        return self.out

    def __repr__(self) -> str:
        return f"ClusterLaunch({self.name}, grid={self.grid}, cluster={self.cluster}, block={self.block})"


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
