"""What this machine computes with: CUDA, and whether its CPU has native bf16.

The learner trains under bf16 autocast and a worker's engine computes in bf16 only where the hardware
has bf16 (CUDA, or a CPU with AVX512-BF16 or AMX); elsewhere bf16 is emulated and slower than fp32.
`ECHO2_CPU_BF16=0` makes a CPU with bf16 compute in fp32 all the same, as one without it does: for runs that
must match a CPU without bf16 (benchmarks), or a learner publishing fp16 (`--wire-dtype fp16`).
`pin_thread` keeps one thread (the learner's training loop) on CPUs of its own.
"""

from __future__ import annotations

import os


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (and `ECHO2_CPU_BF16` is not 0)."""
    if os.environ.get("ECHO2_CPU_BF16", "") == "0":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def compute_dtype(cuda: bool) -> str:
    """The engine's dtype when none is asked for."""
    return "bfloat16" if cuda or cpu_has_bf16() else "float32"


def engine_dtype(cuda: bool, wire: str) -> str:
    """An engine's dtype when none is asked for, for a run publishing in `wire`. With fp16 versions, an engine that
    would compute in bf16 computes in fp16 on CUDA and in fp32 on a CPU instead: bf16 would round each weight
    again, to a policy the learner does not train."""
    native = compute_dtype(cuda)
    if wire != "fp16" or native == "float32":
        return native
    return "float16" if cuda else "float32"


def parse_cpus(spec: str) -> set[int]:
    """A CPU list as taskset writes it: "0", "0,2", "0-3" or "0-1,4". ValueError on anything else."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{spec!r} is not a CPU list (e.g. 0, 0,2 or 0-3)")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"{spec!r}: the range {part.strip()} runs backwards")
        cpus.update(range(low, high + 1))
    return cpus


def usable_cpus(spec: str) -> set[int]:
    """`parse_cpus(spec)`, checked against the CPUs this process may run on. ValueError if it names others."""
    cpus, allowed = parse_cpus(spec), os.sched_getaffinity(0)
    if not cpus <= allowed:
        have = ",".join(map(str, sorted(allowed)))
        raise ValueError(f"CPUs {sorted(cpus - allowed)} are not available to this process (it may use {have})")
    return cpus


def pin_thread(cpus: set[int]) -> None:
    """Run the calling thread (only it: Linux affinity is per thread) on `cpus`; threads it starts later
    inherit them. The process's other threads keep their CPUs."""
    os.sched_setaffinity(0, cpus)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc's malloc.h)
KEEP_FREED_BYTES, MMAP_FROM_BYTES = 64 << 20, 32 << 20


def keep_freed_memory() -> None:
    """Let glibc's malloc keep freed memory for reuse (up to KEEP_FREED_BYTES at the top of a heap; blocks under
    MMAP_FROM_BYTES from the heap) instead of returning it to the OS at once. The delta coder allocates a few MB
    of numpy temporaries per 512 KB chunk; with glibc's defaults each came back as fresh pages, and the page
    faults (1.7 M for a 1.19 GB version, about 4 us each on this project's VM) were half the encode's time:
    15.2 s on one core with the defaults, 8.2 s after this (scripts/bench_publish.py). A no-op off glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_FROM_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES)
    except (OSError, AttributeError):  # not glibc
        pass
