"""Host -> device uploads at the hardware's pace: pinned staging, chunked, overlapped.

A pageable `cuda.to_device` of a memory-mapped table copies it twice on one thread (page cache ->
the driver's pinned bounce buffer -> device), faulting in every 4 KiB page of the map on the way:
1.5-3 GB/s for a 30 GiB table. `Uploader` instead:
  1. reads the array in chunks (32 MiB) into a ring of pinned host buffers (one pinned allocation,
     made on the first large upload and reused by every later one), from a fixed pool of threads,
     with `np.copyto` out of the array (for a view of a `np.memmap`: out of the file's map, the
     page cache's pages mapped in by the copy's faults, 16 at a time), or, with read="pread", for
     a file-backed array with `os.preadv` on the file (one kernel copy, no faults; slower per
     thread on the machines measured so far: docs/gpu.md, "Start-up"). Both release the GIL;
  2. copies each filled buffer to the device with an asynchronous copy on one stream as soon as
     it is full, while the threads fill the next buffers;
  3. hands a buffer back to the threads once the event recorded after its copy has fired.
Each upload's record splits its time: the readers' summed read seconds, the device's copy seconds
(CUDA events around every chunk's copy), and how long the issuing thread waited for a buffer to be
filled (read-bound) or for a copy to finish (link-bound). The page-cache read, the PCIe transfer
and the next reads overlap; what bounds the whole is the slower of the parallel read (host memory
bandwidth, or page-cache population on a first read: see `resident_fraction`) and PCIe (about
54 GB/s for Gen5 x16 one way). From a cold disk the bound is the disk itself (docs/gpu.md,
"Start-up").

    up = Uploader()
    dev = up.upload(layer.table, "layer 1 table")    # device array, same shape and dtype
    up.close()                                       # frees the pinned buffers
    up.stats                                         # bytes, seconds, GB/s per upload and in total

A file-backed array is checked against its file's length before anything is allocated on the
device (a file truncated since it was mapped is refused by name). In numba's simulator there is no
device: uploads below `direct_below` bytes (all of them, by default) are `cuda.to_device`; with
`direct_below=0` the chunked pipeline runs there too (synchronously), which is how its
reassembly is tested without a GPU.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from numba import cuda

from .intrinsics import SIMULATOR

DEFAULT_CHUNK_BYTES = 32 << 20


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which a container may narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 4


# page-cache readers: one thread moves a few GB/s out of the page cache (less on a first read,
# which also allocates the cache's pages), so the PCIe link (~54 GB/s pinned) needs many
DEFAULT_THREADS = max(2, min(12, usable_cpus()))
READ_METHODS = ("mmap", "pread")   # how a file-backed array is read (the first is the default)
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


def check_file_region(arr, what: str = "array") -> None:
    """Refuse (ValueError naming `what` and the file) a file-backed array whose bytes run past the
    end of its file: a file truncated after it was mapped. Reading such a map would end the process
    (SIGBUS); an upload would fail half-way. Arrays not backed by a file pass."""
    region = file_region(arr) if isinstance(arr, np.ndarray) else None
    if region is None:
        return
    path, offset = region
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise ValueError(f"{what}: cannot stat its file {path}: {exc}") from None
    end = offset + int(arr.nbytes)
    if size < end:
        raise ValueError(f"{what}: needs bytes {offset}..{end} of {path}, but the file holds {size} bytes "
                         f"(truncated or replaced since it was opened?)")


def resident_fraction(path, offset: int = 0, nbytes: int | None = None) -> float | None:
    """Fraction (0..1) of the pages of bytes [offset, offset+nbytes) of `path` that are in the page
    cache now (mincore(2) on a fresh read-only map; reads nothing). None where mincore is not
    available. Holes of a sparse file on tmpfs read as zeros without being cached: they count as
    not resident."""
    import ctypes
    import mmap
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    mincore.restype = ctypes.c_int
    size = os.stat(path).st_size
    nbytes = size - offset if nbytes is None else min(int(nbytes), size - offset)
    if nbytes <= 0:
        return 1.0
    page = mmap.PAGESIZE
    lo = offset // page * page
    length = offset + nbytes - lo
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), length, access=mmap.ACCESS_READ, offset=lo)
        try:
            view = np.frombuffer(mm, dtype=np.uint8)
            vec = np.zeros((length + page - 1) // page, dtype=np.uint8)
            rc = mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(length),
                         vec.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte)))
            del view
        finally:
            mm.close()
    if rc != 0:
        return None
    return float(np.count_nonzero(vec & 1)) / len(vec)


@dataclass
class UploadRecord:
    what: str
    nbytes: int
    seconds: float
    method: str          # "mmap" (copied out of the file's map), "pread" (read from the file),
                         # "memcpy" (an array in memory), "direct" (small / simulator)
    read_seconds: float = 0.0       # summed over the reader threads: time filling pinned buffers
    wait_read_seconds: float = 0.0  # the issuing thread waiting for a buffer to be filled (read-bound)
    wait_copy_seconds: float = 0.0  # the issuing thread waiting for a device copy to finish (link-bound)
    copy_seconds: float = 0.0       # the device's time in this upload's H2D copies (CUDA events)
    threads: int = 0                # reader threads (0: no pipeline)
    chunks: int = 0                 # staging buffers' worth of bytes read and copied

    @property
    def gbps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9


def _rate(nbytes, seconds):
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else None


@dataclass
class UploadStats:
    records: list = field(default_factory=list)
    threads: int = 0                 # the uploader's reader threads
    chunk_bytes: int = 0             # bytes of one pinned staging buffer
    n_buffers: int = 0               # staging buffers in the ring
    pinned_alloc_seconds: float = 0.0  # allocating (and so pinning and touching) the ring, once
    read: str = ""                   # how file-backed arrays are read ("mmap" or "pread")

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    @property
    def gbps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9

    def split(self) -> dict:
        """The pipelined uploads' figures: bytes, wall seconds, the readers' rate (bytes over their
        summed read seconds, times the threads: what they deliver when all are busy) and the
        link's (bytes over the device's copy seconds)."""
        piped = [r for r in self.records if r.threads]
        nb = sum(r.nbytes for r in piped)
        read_s = sum(r.read_seconds for r in piped)
        copy_s = sum(r.copy_seconds for r in piped)
        per_thread = nb / read_s / 1e9 if read_s > 0 else None
        return {"pipelined_bytes": nb, "pipelined_seconds": round(sum(r.seconds for r in piped), 4),
                "pipelined_gb_per_s": _rate(nb, sum(r.seconds for r in piped)),
                "read_gb_per_s_per_thread": round(per_thread, 2) if per_thread else None,
                "read_gb_per_s": round(per_thread * self.threads, 2) if per_thread else None,
                "copy_seconds": round(copy_s, 4), "copy_gb_per_s": _rate(nb, copy_s)}

    def as_dict(self) -> dict:
        return {"bytes": self.nbytes, "seconds": round(self.seconds, 4), "gb_per_s": round(self.gbps, 2),
                "read_seconds": round(sum(r.read_seconds for r in self.records), 4),
                "wait_read_seconds": round(sum(r.wait_read_seconds for r in self.records), 4),
                "wait_copy_seconds": round(sum(r.wait_copy_seconds for r in self.records), 4),
                "read_method": self.read, "threads": self.threads, "chunk_bytes": self.chunk_bytes,
                "n_buffers": self.n_buffers,
                "pinned_alloc_seconds": round(self.pinned_alloc_seconds, 4), **self.split(),
                "uploads": [{"what": r.what, "bytes": r.nbytes, "seconds": round(r.seconds, 4),
                             "gb_per_s": round(r.gbps, 2), "method": r.method,
                             "read_seconds": round(r.read_seconds, 4),
                             "wait_read_seconds": round(r.wait_read_seconds, 4),
                             "wait_copy_seconds": round(r.wait_copy_seconds, 4),
                             "copy_seconds": round(r.copy_seconds, 4)} for r in self.records]}


class Uploader:
    """Pinned, chunked, overlapped host -> device copies (see the module doc).

    chunk_bytes: bytes a staging buffer holds; threads: concurrent page-cache readers; the ring
    has threads + 2 buffers, so every thread can read while two buffers are in flight to the GPU
    (threads=12, 32 MiB: 448 MiB pinned, allocated once). direct_below: arrays smaller than this
    are copied with `cuda.to_device` (default 8 MiB on a GPU, everything in the simulator).
    read: how a file-backed array is read, "mmap" or "pread" (module doc); None = $ENGRAM_UPLOAD_READ,
    else "mmap".
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, threads: int = DEFAULT_THREADS,
                 direct_below: int | None = None, read: str | None = None):
        if chunk_bytes < 1 << 16 or threads < 1:
            raise ValueError(f"chunk_bytes must be >= 64 KiB and threads >= 1, got {chunk_bytes}, {threads}")
        if direct_below is not None and direct_below < 0:
            raise ValueError(f"direct_below must be >= 0 bytes or None, got {direct_below}")
        if read is None:
            read = os.environ.get("ENGRAM_UPLOAD_READ") or READ_METHODS[0]
            if read not in READ_METHODS:
                raise ValueError(f"ENGRAM_UPLOAD_READ must be one of {READ_METHODS}, got {read!r}")
        if read not in READ_METHODS:
            raise ValueError(f"read must be one of {READ_METHODS} or None, got {read!r}")
        self.read = read
        self.chunk_bytes = int(chunk_bytes)
        self.threads = int(threads)
        self.n_buffers = self.threads + 2
        self.direct_below = direct_below
        self.stats = UploadStats(threads=self.threads, chunk_bytes=self.chunk_bytes, n_buffers=self.n_buffers,
                                 read=self.read)
        self._ring = None
        self._bufs = None
        self._stream = None
        self._starts = None
        self._ends = None
        self._pool = None

    # -- resources ------------------------------------------------------------------------------
    def _ensure(self):
        if self._bufs is None:
            t0 = time.perf_counter()
            # one allocation for the ring: pinning (and touching) is paid once, here
            self._ring = cuda.pinned_array(self.n_buffers * self.chunk_bytes, dtype=np.uint8)
            self._bufs = [self._ring[i * self.chunk_bytes:(i + 1) * self.chunk_bytes] for i in range(self.n_buffers)]
            self._stream = cuda.stream()
            self._starts = [cuda.event() for _ in range(self.n_buffers)]
            self._ends = [cuda.event() for _ in range(self.n_buffers)]
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="engram-upload")
            self.stats.pinned_alloc_seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Wait for the copies in flight and free the pinned buffers and threads."""
        if self._stream is not None:
            self._stream.synchronize()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._ring = self._bufs = self._stream = self._starts = self._ends = self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- uploads --------------------------------------------------------------------------------
    def upload(self, host, what: str = "array"):
        """A device array holding a copy of `host` (any shape; made C-contiguous first if it is
        not). Returns when the copy is complete."""
        host = np.asarray(host)
        check_file_region(host, what)                               # before any device allocation
        t0 = time.perf_counter()
        direct_below = (1 << 62 if SIMULATOR else SMALL_BYTES) if self.direct_below is None else self.direct_below
        if host.nbytes < direct_below or host.nbytes == 0:
            dev = cuda.to_device(np.ascontiguousarray(host))
            if not SIMULATOR:
                cuda.synchronize()
            self.stats.records.append(UploadRecord(what, int(host.nbytes), time.perf_counter() - t0, "direct"))
            return dev
        region = file_region(host) if self.read == "pread" else None
        method = "pread" if region else ("mmap" if file_region(host) else "memcpy")
        if not host.flags.c_contiguous:
            host = np.ascontiguousarray(host)
        dev = cuda.device_array(host.shape, dtype=host.dtype)
        self._ensure()
        t0 = time.perf_counter()                                    # the ring's one-time pinning is its own figure
        read_s, wait_read, wait_copy, copy_s, n = self._pipeline(host, dev, region, what)
        self.stats.records.append(UploadRecord(what, int(host.nbytes), time.perf_counter() - t0,
                                               method, read_s, wait_read, wait_copy,
                                               copy_s, self.threads, n))
        return dev

    def _pipeline(self, host: np.ndarray, dev, region, what: str) -> tuple:
        """-> (read seconds summed over the threads, seconds waiting for reads, seconds waiting for
        copies, device copy seconds, chunks): where the time went."""
        nbytes = int(host.nbytes)
        dst = dev.reshape(dev.size).view(np.uint8)                   # [nbytes] device bytes
        src = host.reshape(-1).view(np.uint8)                        # [nbytes] host bytes (memcpy path)
        chunk = self.chunk_bytes
        n = (nbytes + chunk - 1) // chunk
        nb = self.n_buffers
        stream = self._stream
        fd = os.open(region[0], os.O_RDONLY) if region else -1
        base = region[1] if region else 0
        if fd >= 0 and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, base, nbytes, os.POSIX_FADV_SEQUENTIAL)   # larger readahead from a cold disk

        read_s = []            # per chunk, appended by the threads (list.append is atomic)
        wait_read = wait_copy = copy_ms = 0.0

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
                        raise OSError(f"{what}: read {done} of {size} bytes at offset {base + lo} of {region[0]}: "
                                      "the file is shorter than the array")
                    done += got
            else:
                np.copyto(buf, src[lo:lo + size])
            read_s.append(time.perf_counter() - t_fill)
            return size

        def copy_time(k: int) -> float:
            """ms the device spent copying chunk k (its buffer's events have fired)."""
            ms = self._starts[k % nb].elapsed_time(self._ends[k % nb])
            return max(float(ms), 0.0)         # the simulator answers -1

        futures = {}
        try:
            for i in range(min(n, nb - 1)):
                futures[i] = self._pool.submit(fill, i)
            for i in range(n):
                t_w = time.perf_counter()
                size = futures.pop(i).result()                       # chunk i is staged in buffer i % nb
                wait_read += time.perf_counter() - t_w
                b = i % nb
                lo = i * chunk
                self._starts[b].record(stream)
                dst[lo:lo + size].copy_to_device(self._bufs[b][:size], stream=stream)
                self._ends[b].record(stream)
                # the buffer chunk i-1 used is free once its copy is done: give it chunk i-1+nb
                j = i - 1 + nb
                if i >= 1 and j < n:
                    t_w = time.perf_counter()
                    self._ends[(i - 1) % nb].synchronize()
                    wait_copy += time.perf_counter() - t_w
                    copy_ms += copy_time(i - 1)
                    futures[j] = self._pool.submit(fill, j)
                elif i == 0 and nb - 1 < n:
                    futures[nb - 1] = self._pool.submit(fill, nb - 1)
            t_w = time.perf_counter()
            stream.synchronize()
            wait_copy += time.perf_counter() - t_w
            for k in range(max(0, n - nb), n):                       # chunks whose buffer was not reused
                copy_ms += copy_time(k)
            return sum(read_s), wait_read, wait_copy, copy_ms / 1e3, n
        finally:
            for f in futures.values():
                f.cancel()
            if futures:                                              # a failed read: let the rest finish
                for f in futures.values():
                    try:
                        f.result()
                    except Exception:
                        pass
                stream.synchronize()
            if fd >= 0:
                os.close(fd)
