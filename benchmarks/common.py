"""Shared benchmark plumbing: timing, the ceilings probe, machine description, output files, and
the per-ISA-tier runs (a worker subprocess per tier, PyTorch capped to the same instructions)."""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
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


# ---- per-ISA-tier tables (issue 22: one mechanism for every benchmark) ---------------------------

#: Our ISA tiers, lowest first (TOKAMAX_CPU_ISA's values).
TIERS = ("scalar", "avx2", "avx512", "avx512bf16", "amx")

#: PyTorch capped to the instructions of each of our tiers: ATen's kernels, oneDNN (bf16 matmul,
#: AMX) and MKL (fp32 sgemm).
TIER_CAPS = {
    "amx": {},
    "avx512bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "scalar": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
               "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def best_cpu_tier() -> str:
    """The highest tier this CPU runs (TOKAMAX_CPU_ISA, read on every call, set aside meanwhile)."""
    forced = os.environ.pop("TOKAMAX_CPU_ISA", None)
    try:
        return torch.ops.tokamax._cpu_description()[2]
    finally:
        if forced is not None:
            os.environ["TOKAMAX_CPU_ISA"] = forced


def select_tiers(spec: str, best: str) -> tuple[list[str], list[str]]:
    """The tiers to run for --tiers spec ('all' or a comma-separated list), lowest first, and
    those skipped because they are above the CPU's best tier. 'all' leaves out scalar (named
    only). An unknown name raises ValueError."""
    if best not in TIERS:
        raise ValueError(f"unknown best tier {best!r}; expected one of {', '.join(TIERS)}")
    if spec == "all":
        wanted = [t for t in TIERS if t != "scalar"]
    else:
        wanted = [t.strip() for t in spec.split(",") if t.strip()]
        unknown = [t for t in wanted if t not in TIERS]
        if unknown:
            raise ValueError(f"--tiers: unknown tier(s) {', '.join(unknown)}; expected 'all' or of {', '.join(TIERS)}")
        wanted = sorted(dict.fromkeys(wanted), key=TIERS.index)
    limit = TIERS.index(best)
    return [t for t in wanted if TIERS.index(t) <= limit], [t for t in wanted if TIERS.index(t) > limit]


def check_tiers_arg(parser, spec: str) -> None:
    """parser.error (one line, no traceback) for a --tiers value naming an unknown tier."""
    try:
        select_tiers(spec, TIERS[-1])
    except ValueError as exc:
        parser.error(str(exc))


def tier_caps_text(tier: str) -> str:
    return " ".join(f"{k}={v}" for k, v in TIER_CAPS[tier].items()) or "uncapped"


def emit_worker_row(row: dict) -> None:
    """A tier worker's one result: a JSON line on stdout, which run_tier_worker collects."""
    print(json.dumps(dict(row, tier=os.environ.get("TOKAMAX_CPU_ISA", ""))), flush=True)


def run_tier_worker(script: str, tier: str, package_root: str, worker_args: list[str]) -> list[dict]:
    """Runs `python script --worker 1 *worker_args` with TOKAMAX_CPU_ISA=tier, PyTorch capped to
    the tier (TIER_CAPS) and package_root's tokamax_torch; its JSON lines, [] if it failed."""
    env = dict(os.environ, TOKAMAX_CPU_ISA=tier, PYTHONPATH=package_root, **TIER_CAPS[tier])
    out = subprocess.run([sys.executable, script, "--worker", "1", *worker_args], env=env, capture_output=True,
                         text=True)
    if out.returncode != 0:
        print(f"tier {tier} ({package_root}) failed:\n{out.stderr[-2000:]}")
        return []
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def ratio_text(ratio: float) -> str:
    """A table's ratio cell: '1.23x', a '*' after it when below 1.0x (PyTorch faster)."""
    return f"{ratio:>7.2f}x{'*' if ratio < 1.0 else ' '}"


def write_tiers_json(name: str, payload: dict) -> None:
    """Writes run_tiers' payload to results/<name>.json, unless no tier ran (every one skipped):
    then the previous results stay."""
    if not payload["rows"]:
        print("\nno tier ran: results file left as it was")
        return
    print(f"\nwrote {write_json(name, payload)}")


def run_tiers(spec: str, script: str, worker_args: list[str], checkouts: dict[str, str], print_table) -> dict:
    """The per-tier driver of every benchmark's --tiers: prints the machine and the ceilings
    (best tier, measured now); for each selected tier, lowest first, runs one worker per checkout
    (label -> package root, see run_tier_worker) and calls print_table(tier, {label: rows}); a
    tier above the CPU's best gets one line instead. Returns the JSON payload (rows carry their
    tier and checkout). Raises ValueError for an unknown tier name before measuring anything."""
    best = best_cpu_tier()
    tiers, skipped = select_tiers(spec, best)
    info = machine()
    ceilings = measure_ceilings()
    print(f"machine: {info['cpu']} ({info['device_kind']}), {info['threads']} threads, torch {info['torch']}")
    print(f"ceilings (measured now, best tier {best}): fp32 FMA peak {ceilings['fma_gflops']:.1f} GFLOP/s "
          f"(256-bit: {ceilings['fma_avx2_gflops']:.1f}), bf16 engine {ceilings['bf16_gflops']:.1f} GFLOP/s, "
          f"read bandwidth {ceilings['read_gbps']:.1f} GB/s")
    rows = []
    for tier in TIERS:
        if tier in skipped:
            print(f"\ntier {tier}: not available on this CPU (best tier {best}); rows left open")
        elif tier in tiers:
            results = {label: run_tier_worker(script, tier, root, worker_args) for label, root in checkouts.items()}
            print(f"\ntier {tier} (PyTorch: {tier_caps_text(tier)}); ratio = fastest PyTorch path / tokamax, "
                  f"* below 1.0x")
            print_table(tier, results)
            rows += [dict(r, checkout=label) for label, got in results.items() for r in got]
    return {"machine": info, "ceilings": ceilings, "best_tier": best, "skipped_tiers": skipped, "rows": rows}
