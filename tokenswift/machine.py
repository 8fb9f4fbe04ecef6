"""What machine this is: its processor's name and bfloat16 features, or its GPU."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def machine_name(device: torch.device) -> str:
    """The accelerator's name, or the CPU's model name with its bfloat16-relevant features."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    features = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return f"{name} [{' '.join(features)}]"


def native_bfloat16(device: torch.device) -> bool:
    """True where bfloat16 products of every shape run in hardware: CUDA, or a CPU with
    AMX-BF16 or AVX512-BF16."""
    if device.type == "cuda":
        return True
    return any(feature in machine_name(device) for feature in ("amx_bf16", "avx512_bf16"))
