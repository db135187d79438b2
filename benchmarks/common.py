"""Shared benchmark plumbing: timing, the ceilings probe, machine description, output files."""

from __future__ import annotations

import ctypes
import json
import pathlib
import platform
import statistics
import time

import torch

import tokamax_torch

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def time_fn(fn, *, warmup: int = 1, reps: int = 5, min_seconds: float = 0.0) -> dict:
    """Median and min wall time of fn() in milliseconds."""
    for _ in range(warmup):
        fn()
    samples = []
    start = time.perf_counter()
    while len(samples) < reps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "samples": len(samples)}


def time_interleaved(fns, *, warmup: int = 1, reps: int = 5) -> list[dict]:
    """time_fn for several functions at once, their timed calls alternating (f0, f1, ..., f0,
    f1, ...), so that each sees the same drift of a shared machine's speed."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    samples = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, samples):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return [{"median_ms": statistics.median(x), "min_ms": min(x), "samples": len(x)} for x in samples]


def measure_ceilings() -> dict:
    """fp32 FMA peak (active ISA tier, and 256-bit AVX2), DRAM read bandwidth and the rate of the
    tier's bf16 product engine (AMX tiles on amx, vdpbf16ps on avx512bf16, 0 elsewhere), all
    threads."""
    buffer = torch.ones(2**26)  # 256 MiB, far past the last-level cache of the dev machine
    best = [0.0, 0.0, 0.0, 0.0]
    for _ in range(3):
        probe = torch.ops.tokamax._measure_ceilings(buffer, 100_000_000)
        best = [max(a, b) for a, b in zip(best, probe)]
    return {"fma_gflops": best[0], "fma_avx2_gflops": best[1], "read_gbps": best[2], "bf16_gflops": best[3],
            "isa": tokamax_torch.device_kind().rsplit("_", 1)[1]}


def machine() -> dict:
    desc = torch.ops.tokamax._cpu_description()
    model = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "device_kind": tokamax_torch.device_kind(),
        "l1d_l2_l3_bytes": [int(x) for x in desc[3:6]],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def write_json(name: str, payload: dict) -> pathlib.Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


# ---- peak memory (one measurement for every benchmark) ------------------------------------------

def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _libc():
    """glibc, told to serve every allocation over 128 KiB by a fresh mmap (a fixed threshold
    turns off its adaptive one), so freed buffers are returned to the OS instead of reused and
    each call's working memory shows up in the resident set."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = None  # set by enable_peak_memory() after every timing, since fresh mmaps slow allocation down


def enable_peak_memory() -> None:
    """Switches glibc to fresh mmaps (see _libc); call after the timings, before peak_memory_mib."""
    global _LIBC
    _LIBC = _libc()


def peak_memory_mib(fn) -> float:
    """Growth of the resident set's high-water mark during fn() (Linux: clear_refs resets it).
    Counts every allocation, the kernels' own scratch included (their cache of released
    buffers emptied first), not only torch tensors. NaN before enable_peak_memory()."""
    if _LIBC is None:
        return float("nan")
    tokamax_torch.empty_cache()  # so the call's working memory is mapped, and counted, afresh
    _LIBC.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return float("nan")
    before = _status_kib("VmRSS")
    fn()
    return max(_status_kib("VmHWM") - before, 0) / 1024
