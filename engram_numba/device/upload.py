"""Host -> device uploads at the hardware's pace: pinned staging, chunked, overlapped.

A pageable `cuda.to_device` of a memory-mapped table copies it twice on one thread (page cache ->
the driver's pinned bounce buffer -> device), faulting in every 4 KiB page of the map on the way:
1.5-3 GB/s for a 30 GiB table. `Uploader` instead:
  1. reads the array in chunks (64 MiB) into a ring of pinned host buffers, from several threads
     at once: straight from the file with `os.preadv` when the array is a view of a `np.memmap`
     (one kernel copy out of the page cache, no page faults), else with `np.copyto` (both release
     the GIL);
  2. copies each filled buffer to the device with an asynchronous copy, alternating two streams,
     while the threads fill the next buffers;
  3. hands a buffer back to the threads once the event recorded after its copy has fired.
Each upload's record splits its time: the readers' summed read seconds, and how long the issuing
thread waited for a buffer to be filled (read-bound) or for a copy to finish (link-bound).
So the page-cache read, the PCIe transfer and the next reads overlap; what bounds the whole is
the slower of the parallel page-cache read (host memory bandwidth) and PCIe (about 50 GB/s for
Gen5 x16 one way). From a cold disk the bound is the disk itself (docs/gpu.md, "Start-up").

    up = Uploader()
    dev = up.upload(layer.table, "layer 1 table")    # device array, same shape and dtype
    up.close()                                       # frees the pinned buffers
    up.stats                                         # bytes, seconds, GB/s per upload and in total

In numba's simulator there is no device: upload is `cuda.to_device`.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from numba import cuda

from .intrinsics import SIMULATOR

DEFAULT_CHUNK_BYTES = 64 << 20
# page-cache readers: one thread's preadv out of the page cache runs at a few GB/s, so the PCIe
# link (~55 GB/s pinned) needs many of them
DEFAULT_THREADS = max(4, min(12, os.cpu_count() or 4))
SMALL_BYTES = 8 << 20          # below this a plain copy is as fast as setting up the pipeline


def file_region(arr: np.ndarray):
    """(path, byte offset) of a C-contiguous array that is a view of a `np.memmap` of a file, else
    None (then the bytes are read through memory). The offset is measured from the memmap that
    owns the mapping (a slice of a memmap is a memmap too, but keeps its parent's `offset`)."""
    if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
        return None
    root = None
    base = arr
    for _ in range(64):
        if base is None:
            break
        if isinstance(base, np.memmap) and getattr(base, "filename", None) and not isinstance(base.base, np.ndarray):
            root = base
            break
        base = getattr(base, "base", None)
    if root is None:
        return None
    return str(root.filename), int(arr.ctypes.data) - int(root.ctypes.data) + int(getattr(root, "offset", 0) or 0)


@dataclass
class UploadRecord:
    what: str
    nbytes: int
    seconds: float
    method: str          # "pread" (from the file), "memcpy" (through memory), "direct" (small / simulator)
    read_seconds: float = 0.0       # summed over the reader threads: time filling pinned buffers
    wait_read_seconds: float = 0.0  # the issuing thread waiting for a buffer to be filled (read-bound)
    wait_copy_seconds: float = 0.0  # the issuing thread waiting for a device copy to finish (link-bound)

    @property
    def gbps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9


@dataclass
class UploadStats:
    records: list = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    @property
    def gbps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9

    def as_dict(self) -> dict:
        return {"bytes": self.nbytes, "seconds": round(self.seconds, 4), "gb_per_s": round(self.gbps, 2),
                "read_seconds": round(sum(r.read_seconds for r in self.records), 4),
                "wait_read_seconds": round(sum(r.wait_read_seconds for r in self.records), 4),
                "wait_copy_seconds": round(sum(r.wait_copy_seconds for r in self.records), 4),
                "uploads": [{"what": r.what, "bytes": r.nbytes, "seconds": round(r.seconds, 4),
                             "gb_per_s": round(r.gbps, 2), "method": r.method,
                             "read_seconds": round(r.read_seconds, 4),
                             "wait_read_seconds": round(r.wait_read_seconds, 4),
                             "wait_copy_seconds": round(r.wait_copy_seconds, 4)} for r in self.records]}


class Uploader:
    """Pinned, chunked, overlapped host -> device copies (see the module doc).

    chunk_bytes: bytes a staging buffer holds; threads: concurrent page-cache readers; the ring
    has threads + 2 buffers, so every thread can read while two buffers are in flight to the GPU.
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, threads: int = DEFAULT_THREADS):
        if chunk_bytes < 1 << 16 or threads < 1:
            raise ValueError(f"chunk_bytes must be >= 64 KiB and threads >= 1, got {chunk_bytes}, {threads}")
        self.chunk_bytes = int(chunk_bytes)
        self.threads = int(threads)
        self.n_buffers = self.threads + 2
        self.stats = UploadStats()
        self._bufs = None
        self._streams = None
        self._events = None
        self._pool = None

    # -- resources ------------------------------------------------------------------------------
    def _ensure(self):
        if self._bufs is None:
            self._bufs = [cuda.pinned_array(self.chunk_bytes, dtype=np.uint8) for _ in range(self.n_buffers)]
            self._streams = [cuda.stream(), cuda.stream()]
            self._events = [cuda.event(timing=False) for _ in range(self.n_buffers)]
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="engram-upload")

    def close(self) -> None:
        """Wait for the copies in flight and free the pinned buffers and threads."""
        if self._streams is not None:
            for s in self._streams:
                s.synchronize()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._bufs = self._streams = self._events = self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- uploads --------------------------------------------------------------------------------
    def upload(self, host, what: str = "array"):
        """A device array holding a copy of `host` (any shape; made C-contiguous first if it is
        not). Returns when the copy is complete."""
        host = np.asarray(host)
        t0 = time.perf_counter()
        if SIMULATOR or host.nbytes < SMALL_BYTES:
            dev = cuda.to_device(np.ascontiguousarray(host))
            if not SIMULATOR:
                cuda.synchronize()
            self.stats.records.append(UploadRecord(what, int(host.nbytes), time.perf_counter() - t0, "direct"))
            return dev
        region = file_region(host)
        if not host.flags.c_contiguous:
            host = np.ascontiguousarray(host)
        dev = cuda.device_array(host.shape, dtype=host.dtype)
        self._ensure()
        split = self._pipeline(host, dev, region)
        self.stats.records.append(UploadRecord(what, int(host.nbytes), time.perf_counter() - t0,
                                               "pread" if region else "memcpy", *split))
        return dev

    def _pipeline(self, host: np.ndarray, dev, region) -> tuple:
        """-> (read seconds summed over the threads, seconds waiting for reads, seconds waiting for
        copies): where the time went."""
        nbytes = int(host.nbytes)
        dst = dev.reshape(dev.size).view(np.uint8)                   # [nbytes] device bytes
        src = host.reshape(-1).view(np.uint8)                        # [nbytes] host bytes (memcpy path)
        chunk = self.chunk_bytes
        n = (nbytes + chunk - 1) // chunk
        nb = self.n_buffers
        fd = os.open(region[0], os.O_RDONLY) if region else -1
        base = region[1] if region else 0

        read_s = []            # per chunk, appended by the threads (list.append is atomic)
        wait_read = wait_copy = 0.0

        def fill(i: int) -> int:
            t_fill = time.perf_counter()
            lo = i * chunk
            size = min(chunk, nbytes - lo)
            buf = self._bufs[i % nb][:size]
            if fd >= 0:
                view = memoryview(buf)
                done = 0
                while done < size:
                    got = os.preadv(fd, [view[done:]], base + lo + done)
                    if got <= 0:
                        raise OSError(f"read {done} of {size} bytes at offset {base + lo} of {region[0]}: "
                                      "the file is shorter than the array")
                    done += got
            else:
                np.copyto(buf, src[lo:lo + size])
            read_s.append(time.perf_counter() - t_fill)
            return size

        try:
            futures = {i: self._pool.submit(fill, i) for i in range(min(n, nb - 1))}
            for i in range(n):
                t_w = time.perf_counter()
                size = futures.pop(i).result()                       # chunk i is staged in buffer i % nb
                wait_read += time.perf_counter() - t_w
                b = i % nb
                stream = self._streams[i & 1]
                lo = i * chunk
                dst[lo:lo + size].copy_to_device(self._bufs[b][:size], stream=stream)
                self._events[b].record(stream)
                # the buffer chunk i-1 used is free once its copy is done: give it chunk i-1+nb
                j = i - 1 + nb
                if i >= 1 and j < n:
                    t_w = time.perf_counter()
                    self._events[(i - 1) % nb].synchronize()
                    wait_copy += time.perf_counter() - t_w
                    futures[j] = self._pool.submit(fill, j)
                elif i == 0 and nb - 1 < n:
                    futures[nb - 1] = self._pool.submit(fill, nb - 1)
            t_w = time.perf_counter()
            for s in self._streams:
                s.synchronize()
            wait_copy += time.perf_counter() - t_w
            return sum(read_s), wait_read, wait_copy
        finally:
            for f in list(futures.values()) if "futures" in locals() else []:
                f.cancel()
            if fd >= 0:
                os.close(fd)
