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

On a CPU with AVX512-BF16 but no AMX, bfloat16 products of many rows run in hardware
yet need not beat float32: on a 2-core Intel Xeon of that kind, a 2,048-row product ran
at 167 GFLOPS in bfloat16 against 295 in float32, and a 2K prefill of the demo model
took 3.9-4.5 s in bfloat16 against 2.5-2.8 s in float32 (the float32 copy of the model,
0.17 s, included). There :func:`prefill_dtype` takes whichever a probe of many-row
products measures faster (once per machine, cached), and :func:`prefill_min_tokens`
keeps a short prompt in the model's dtype: below ~256 tokens the copy costs more than
it saves (64 tokens: 0.13 s against 0.22-0.31; 256: 0.43 against 0.36-0.41; 512: 0.79
against 0.60).
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
PROBE_ROWS = 512  # the many-row probe's rows: one prefill chunk
PROBE_ROW_MATRICES = 4  # the many-row probe's matrices (its products are compute-bound)
# float32 prefills where the many-row probe measured it at least this much faster than
# bfloat16 (the copy of the model and the probe's own spread are not free)
FLOAT32_MARGIN = 1.2
# the shortest prompt a float32 prefill repays its copy of the model for, where bfloat16 is native
TWIN_MIN_TOKENS = 256


def _product_milliseconds(dtype: torch.dtype, rows: int, matrices: int, repeats: int) -> float:
    """Least time, in ms, of a ``rows``-row product through ``matrices`` probe matrices
    (the first of ``repeats + 1`` rounds left out: it warms up)."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(PROBE_SHAPE, generator=generator).to(dtype) for _ in range(matrices)]
    x = torch.randn(rows, PROBE_SHAPE[1], generator=generator).to(dtype)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for weight in weights:
            torch.nn.functional.linear(x, weight)
        times.append(time.perf_counter() - start)
    return 1000 * min(times[1:])


def one_row_milliseconds(dtype: torch.dtype, repeats: int = 5) -> float:
    """Least time of a one-row product through every probe matrix, in ms."""
    return _product_milliseconds(dtype, 1, PROBE_MATRICES, repeats)


def many_rows_milliseconds(dtype: torch.dtype, repeats: int = 3) -> float:
    """Least time of a :data:`PROBE_ROWS`-row product through :data:`PROBE_ROW_MATRICES`
    probe matrices, in ms."""
    return _product_milliseconds(dtype, PROBE_ROWS, PROBE_ROW_MATRICES, repeats)


def _cached_choice(name: str, field: str, device: torch.device, measure, choose) -> str:
    """A choice measured once per machine, torch and thread count: read from the
    calibration file ``name`` where it holds one, else ``choose(measure())`` written there
    (the measurements under ``field``)."""
    path = cache_dir() / "calibration" / name
    key = f"{machine_name(device)} | torch {torch.__version__} | {torch.get_num_threads()} threads"
    try:
        record = json.loads(path.read_text())
        if record.get("key") == key and record.get("choice") in ("float32", "bfloat16"):
            return record["choice"]
    except (OSError, ValueError):
        pass
    measured = measure()
    choice = choose(measured)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "choice": choice, field: measured}, indent=2) + "\n")
    except OSError:
        pass
    return choice


def _bfloat16_without_tiles(device: torch.device) -> bool:
    """A CPU with native bfloat16 products (AVX512-BF16) but no AMX tiles."""
    name = machine_name(device)
    return device.type == "cpu" and "avx512_bf16" in name and "amx_bf16" not in name


def many_rows_dtype(device: str | torch.device) -> str:
    """Which of float32 and bfloat16 runs many-row products faster here, measured once
    (a fraction of a second, cached): float32 only where it is :data:`FLOAT32_MARGIN`
    times as fast."""
    device = torch.device(device)

    def measure() -> dict[str, float]:
        return {"float32": many_rows_milliseconds(torch.float32), "bfloat16": many_rows_milliseconds(torch.bfloat16)}

    def choose(measured: dict[str, float]) -> str:
        choice = "float32" if measured["float32"] * FLOAT32_MARGIN <= measured["bfloat16"] else "bfloat16"
        logger.info("prefill dtype: %d-row products %.1f ms float32, %.1f ms bfloat16 -> %s", PROBE_ROWS,
                    measured["float32"], measured["bfloat16"], choice)
        return choice

    return _cached_choice("prefill-dtype.json", "many_rows_ms", device, measure, choose)


def auto_dtype(device: str | torch.device) -> str:
    """The dtype ``"auto"`` stands for on ``device`` (see the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda" or native_bfloat16(device):
        return "bfloat16"

    def measure() -> dict[str, float]:
        return {"float32": one_row_milliseconds(torch.float32), "bfloat16": one_row_milliseconds(torch.bfloat16)}

    def choose(measured: dict[str, float]) -> str:
        choice = "bfloat16" if measured["bfloat16"] <= measured["float32"] else "float32"
        logger.info("dtype auto: one-row products %.1f ms float32, %.1f ms bfloat16 -> %s", measured["float32"],
                    measured["bfloat16"], choice)
        return choice

    return _cached_choice("dtype.json", "one_row_ms", device, measure, choose)


def prefill_dtype(choice: str, model_dtype: torch.dtype, device: str | torch.device) -> torch.dtype:
    """The dtype a prompt's prefill computes in for ``[model] prefill_dtype = choice``:
    "model" (or a dtype equal to the model's) the model's own; "auto": for a
    bfloat16/float16 model on a CPU, float32 without native bfloat16 arithmetic, and with
    AVX512-BF16 but no AMX whichever :func:`many_rows_dtype` measures faster; else the
    model's own; a dtype name: that dtype."""
    device = torch.device(device)
    if choice == "model":
        return model_dtype
    if choice == "auto":
        half = model_dtype in (torch.bfloat16, torch.float16)
        if not half or device.type != "cpu":
            return model_dtype
        if not native_bfloat16(device):
            return torch.float32
        if _bfloat16_without_tiles(device) and many_rows_dtype(device) == "float32":
            return torch.float32
        return model_dtype
    return getattr(torch, choice)


def prefill_min_tokens(choice: str, model_dtype: torch.dtype, device: str | torch.device) -> int:
    """The shortest prompt the prefill dtype of ``choice`` applies to (shorter ones
    prefill in the model's dtype): :data:`TWIN_MIN_TOKENS` where ``auto`` chose float32
    on a CPU with native bfloat16 (the copy of the model must repay itself); 0 elsewhere
    (without native bfloat16 a many-row bfloat16 product crawls at any length)."""
    device = torch.device(device)
    if choice != "auto" or prefill_dtype(choice, model_dtype, device) == model_dtype:
        return 0
    return TWIN_MIN_TOKENS if native_bfloat16(device) else 0
