"""CUDA graphs of prepared launches, captured on a numba stream (stream capture).

A CUDA graph records a fixed sequence of kernel launches (their arguments included) once and
replays it for about one graph launch of host time; numba's own launch costs 17-41 us a kernel
on the H200. What invalidates a graph: any change to the arrays it points at (a new highway
buffer, new workspaces from a larger max_tokens) or to its launch shapes (another token count):
build a new one then.

Besides prepared launches, a captured sequence may hold `HostToDeviceCopy` steps: an
asynchronous copy out of pinned host memory becomes a memcpy node, so a replay uploads whatever
the host wrote into that pinned buffer last (the decode graph's row ids).
"""
from __future__ import annotations


class CapturedGraph:
    """A CUDA graph of prepared launches, captured on a numba stream (see `EngramV41.capture_apply`).

    graph = CapturedGraph(stream, [launch_a, launch_b], n_tokens=1)
    graph.replay()       # asynchronous on `stream`
"""

    def __init__(self, stream, launches, n_tokens: int):
        from cuda.bindings import driver as drv
        self._drv = drv
        self.stream = stream
        self.n_tokens = n_tokens
        self._handle = drv.CUstream(int(stream.handle))
        _cu(drv.cuStreamBeginCapture(self._handle, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            "cuStreamBeginCapture")
        try:
            for launch in launches:
                launch()
        finally:
            graph = _cu(drv.cuStreamEndCapture(self._handle), "cuStreamEndCapture")
        self._graph = graph
        self._exec = _cu(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        self._launches = launches  # keeps the arrays the graph points at alive

    def replay(self) -> None:
        """Launch the captured kernels again, asynchronously on the capture stream."""
        _cu(self._drv.cuGraphLaunch(self._exec, self._handle), "cuGraphLaunch")

    def __del__(self):
        try:
            self._drv.cuGraphExecDestroy(self._exec)
            self._drv.cuGraphDestroy(self._graph)
        except Exception:
            pass


class HostToDeviceCopy:
    """An asynchronous copy of a pinned host array into a device array on `stream` (cuMemcpyHtoDAsync),
    callable like a prepared launch, so it can sit in a CapturedGraph's sequence.

    src must be page-locked (`numba.cuda.pinned_array`): a copy from pageable memory cannot be
    captured. The bytes copied are src's as they are when the copy runs (at each replay)."""

    __slots__ = ("name", "dst", "src", "nbytes", "_drv", "_args")

    def __init__(self, dst, src, stream, name: str = "h2d"):
        import numpy as np
        from cuda.bindings import driver as drv

        from .devarray import data_address
        if not isinstance(src, np.ndarray) or not src.flags.c_contiguous:
            raise ValueError("HostToDeviceCopy's src must be a C-contiguous pinned numpy array")
        if int(dst.nbytes) != int(src.nbytes):
            raise ValueError(f"HostToDeviceCopy: dst has {dst.nbytes} bytes, src {src.nbytes}")
        if not stream or not int(getattr(stream, "handle", 0) or 0):
            raise ValueError("HostToDeviceCopy needs a non-default stream (a captured copy must be on the capture stream)")
        self.name, self.dst, self.src, self.nbytes = name, dst, src, int(src.nbytes)
        self._drv = drv
        self._args = (drv.CUdeviceptr(data_address(dst)), int(src.ctypes.data), self.nbytes,
                      drv.CUstream(int(stream.handle)))

    def __call__(self):
        _cu(self._drv.cuMemcpyHtoDAsync(*self._args), "cuMemcpyHtoDAsync")
        return self.dst


def _cu(result, what: str):
    """Unpack a cuda.bindings (CUresult, value...) tuple, raising on an error."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)
