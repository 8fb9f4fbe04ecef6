"""Predicting a run's memory before it starts, and refusing runs that cannot fit.

All KV storage is preallocated from prompt + max_new_tokens (+ the largest tree), so
the bulk of a run's memory is known before the first forward.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch

WORKING_SLACK = 64 * 2**20  # activations of a prefill chunk, sampler buffers, ...


@attrs.frozen(kw_only=True)
class MemoryEstimate:
    """Bytes a generation will newly allocate (weights are already loaded)."""

    positions: int  # KV store capacity
    kv_bytes: int  # the full KV store
    view_bytes: int  # a partial drafting view's own buffers
    working_bytes: int  # logits of one tree, activations, slack
    packed_bytes: int = 0  # the few-rows kernel's packed weight copies not made yet

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.view_bytes + self.working_bytes + self.packed_bytes


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` (None when it cannot be told)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (``parameters()`` yields tied weights once)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def reset_peak_rss() -> None:
    """Start a new peak-resident-memory measurement (Linux; no-op elsewhere)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mib() -> float:
    """Peak resident memory of this process since start or :func:`reset_peak_rss`, MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def malloc_mib() -> tuple[float, float] | None:
    """(in use, free) MiB of glibc malloc's heaps, mmapped chunks counted in use (their
    pages resident only once written), or None where the C library is not glibc 2.33+.
    Resident memory that grows with the first figure is memory still held; with the
    second, freed memory the heaps keep."""
    import ctypes

    class _Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _Info
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20, info.fordblks / 2**20
