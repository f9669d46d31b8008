"""CUDA graphs of prepared launches, captured on a numba stream (stream capture).

A CUDA graph records a fixed sequence of kernel launches (their arguments included) once and
replays it for about one graph launch of host time; numba's own launch costs 17-41 us a kernel
on the H200. What invalidates a graph: any change to the arrays it points at (a new highway
buffer, new workspaces from a larger max_tokens) or to its launch shapes (another token count):
build a new one then.
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


def _cu(result, what: str):
    """Unpack a cuda.bindings (CUresult, value...) tuple, raising on an error."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)
