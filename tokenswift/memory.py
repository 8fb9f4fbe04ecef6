"""Predicting a run's memory before it starts, and refusing runs that cannot fit.

All KV storage is preallocated from prompt + max_new_tokens (+ the largest tree), so
the bulk of a run's memory is known before the first forward.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import attrs
import torch

logger = logging.getLogger(__name__)

WORKING_SLACK = 64 * 2**20  # activations of a prefill chunk, sampler buffers, ...

# oneDNN (bfloat16 products on CPUs with AVX512-BF16 or AMX) keeps each new shape's
# compiled primitive in two caches, PyTorch's ideep cache (LRU_CACHE_CAPACITY) and
# oneDNN's own (ONEDNN_PRIMITIVE_CACHE_CAPACITY), 1,024 entries each by default. Shapes
# follow prompt lengths, prefill chunks and contexts, so a server or a long run kept
# making new ones: on a 2-core AMD EPYC Zen 4, SmolLM2 in bfloat16, requests of 100
# distinct prompt lengths held +2.4 MiB each (a linear of 300 row counts, +0.58 MiB
# each) and would have gone on to ~1 GiB; with 64 entries each, 0.16 MiB a request and
# the same decoding speed (a run's few shapes stay cached).
NATIVE_CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
NATIVE_CACHE_ENTRIES = 64


def cap_native_caches(entries: int = NATIVE_CACHE_ENTRIES) -> None:
    """Cap oneDNN's per-shape caches at ``entries`` each where the environment does
    not set them. Read at the process's first oneDNN product, so it acts when called
    before that (importing tokenswift calls it). A user's value wins, except ideep's
    0, which crashes the process at its first product: that becomes 1, with a warning."""
    for name in NATIVE_CACHE_VARIABLES:
        os.environ.setdefault(name, str(entries))
    if os.environ["LRU_CACHE_CAPACITY"].strip() == "0":
        logger.warning("LRU_CACHE_CAPACITY=0 crashes PyTorch's first bfloat16 product on a CPU; using 1 instead")
        os.environ["LRU_CACHE_CAPACITY"] = "1"


@attrs.frozen(kw_only=True)
class MemoryEstimate:
    """Bytes a generation will newly allocate (weights are already loaded)."""

    positions: int  # KV store capacity
    kv_bytes: int  # the full KV store
    view_bytes: int  # a partial drafting view's own buffers
    working_bytes: int  # logits of one tree, activations, slack
    packed_bytes: int = 0  # the few-rows kernel's packed weight copies not made yet
    prefill_copy_bytes: int = 0  # the model's copy in the prefill dtype, held during the prefill

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.view_bytes + self.working_bytes + self.packed_bytes + self.prefill_copy_bytes


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
