"""What this machine computes with: CUDA, and whether its CPU has native bf16.

The learner trains under bf16 autocast and a worker's engine computes in bf16 only where the hardware
has bf16 (CUDA, or a CPU with AVX512-BF16 or AMX); elsewhere bf16 is emulated and slower than fp32.
"""

from __future__ import annotations


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def compute_dtype(cuda: bool) -> str:
    """The engine's dtype when none is asked for."""
    return "bfloat16" if cuda or cpu_has_bf16() else "float32"
