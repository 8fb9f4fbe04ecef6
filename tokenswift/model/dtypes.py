"""``dtype = "auto"``: the model dtype for this machine.

bfloat16 halves the bytes a forward streams, which is what decoding is bound by; but on
a CPU without native bfloat16 arithmetic (no AMX-BF16, no AVX512-BF16) only the
one-row products are fast, and a product of 16+ rows runs under 1 GFLOPS (measured on
an AMD EPYC, Zen 3, AVX2). So:

* CUDA: bfloat16;
* a CPU with AMX-BF16 or AVX512-BF16: bfloat16;
* any other CPU: whichever is faster for a one-row product, measured once on this
  machine (a second or so, cached): one-row steps are what plain decoding does and
  what the cost model keeps choosing where tree nodes are expensive, as they are in
  bfloat16 there;
* a ``tiny`` random model (tests, docs): float32, whose results tests compare exactly.

The prompt's prefill is a product of 512-row chunks, where the opposite holds on such a
CPU: float32 runs at the cores' FMA peak while bfloat16 products of many rows crawl (a
2K prefill of the demo model: 6.5 s in float32, 32.8 s in bfloat16, AMD EPYC Zen 3). So
:func:`prefill_dtype` computes the prefill in float32 there, storing the KV in the
model's dtype; every preset and ``ar`` prefill the same way, so the lossless contract
holds as before.
"""

from __future__ import annotations

import json
import logging
import time

import torch

from tokenswift.machine import machine_name, native_bfloat16
from tokenswift.paths import cache_dir

logger = logging.getLogger(__name__)

PROBE_SHAPE = (2048, 1024)  # one weight matrix of the probe (out, in)
PROBE_MATRICES = 24  # 200 MB in float32: well beyond any cache, like a model's weights


def one_row_milliseconds(dtype: torch.dtype, repeats: int = 5) -> float:
    """Least time of a one-row product through every probe matrix, in ms."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(PROBE_SHAPE, generator=generator).to(dtype) for _ in range(PROBE_MATRICES)]
    row = torch.randn(1, PROBE_SHAPE[1], generator=generator).to(dtype)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for weight in weights:
            torch.nn.functional.linear(row, weight)
        times.append(time.perf_counter() - start)
    return 1000 * min(times[1:])


def auto_dtype(device: str | torch.device) -> str:
    """The dtype ``"auto"`` stands for on ``device`` (see the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda" or native_bfloat16(device):
        return "bfloat16"
    path = cache_dir() / "calibration" / "dtype.json"
    key = f"{machine_name(device)} | torch {torch.__version__} | {torch.get_num_threads()} threads"
    try:
        record = json.loads(path.read_text())
        if record.get("key") == key and record.get("choice") in ("float32", "bfloat16"):
            return record["choice"]
    except (OSError, ValueError):
        pass
    measured = {"float32": one_row_milliseconds(torch.float32), "bfloat16": one_row_milliseconds(torch.bfloat16)}
    choice = "bfloat16" if measured["bfloat16"] <= measured["float32"] else "float32"
    logger.info("dtype auto: one-row products %.1f ms float32, %.1f ms bfloat16 -> %s", measured["float32"], measured["bfloat16"], choice)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "choice": choice, "one_row_ms": measured}, indent=2) + "\n")
    except OSError:
        pass
    return choice


def prefill_dtype(choice: str, model_dtype: torch.dtype, device: str | torch.device) -> torch.dtype:
    """The dtype a prompt's prefill computes in for ``[model] prefill_dtype = choice``:
    "model" (or a dtype equal to the model's) the model's own; "auto": float32 for a
    bfloat16/float16 model on a CPU without native bfloat16 arithmetic, else the
    model's own; a dtype name: that dtype."""
    device = torch.device(device)
    if choice == "model":
        return model_dtype
    if choice == "auto":
        half = model_dtype in (torch.bfloat16, torch.float16)
        return torch.float32 if half and device.type == "cpu" and not native_bfloat16(device) else model_dtype
    return getattr(torch, choice)
