"""Native CPU kernels, built on the machine at first use.

:func:`decode_attention` is the attention of a forward's few new tokens over a layer's
committed KV (``decode_attention.cpp``): the KV range split across threads, one pass
over the keys and values for all query rows of a KV head, partial softmaxes merged by
log-sum-exp; with AMX, the products of a KV head's 3+ bfloat16 rows run on tiles, and
with AVX512-BF16 but no AMX those of 9+ rows (trees of 3+ tokens) by pairs of bfloat16
products.
PyTorch's CPU flash kernel parallelises over batch x heads x query blocks only, which
for one sequence with 3 KV heads keeps two thirds of the work on one of two threads,
and never splits the KV.

:func:`few_rows_linear` is ``F.linear`` for a few rows (``few_rows_linear.cpp``): the
weight streamed once for all rows (AMX tiles where the CPU has them), each row's result
independent of the others. With AVX512-BF16 but no AMX tiles (and for the shapes the
tiles do not take), and on AVX2, a bfloat16 weight is rearranged once, at its first
product, into the pairs layout AVX512-BF16's instruction reads (which AVX2 widens in
registers), and that copy is kept while the weight lives
(:func:`packed_weight_bytes`). Whether the model's products use it is
:func:`linears_by_default` (``TOKENSWIFT_LINEARS``).

The extension is compiled with ``torch.utils.cpp_extension`` for this CPU
(``-march=native``) into ``$TOKENSWIFT_CACHE/kernels/<key>/``, the key naming the
source, torch's version and the CPU, so a second run loads it in milliseconds
(``$TOKENSWIFT_KERNEL_CACHE`` names another folder for the builds alone). Where
it cannot be built (no compiler, no ninja) one warning is logged and :func:`available`
is False: attention then takes the PyTorch path it always had. ``TOKENSWIFT_KERNELS=off``
turns the kernels off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

from tokenswift.machine import machine_name
from tokenswift.paths import cache_dir

logger = logging.getLogger(__name__)

SOURCES = (Path(__file__).with_name("decode_attention.cpp"), Path(__file__).with_name("few_rows_linear.cpp"))
HEADERS = (Path(__file__).with_name("amx.h"),)  # included by the sources: staged beside them, part of the key
ENV = "TOKENSWIFT_KERNELS"
LINEARS_ENV = "TOKENSWIFT_LINEARS"  # auto (default), kernel (wherever it serves) or torch (never)
CACHE_ENV = "TOKENSWIFT_KERNEL_CACHE"  # where builds go, if not $TOKENSWIFT_CACHE/kernels
MARCH_ENV = "TOKENSWIFT_KERNELS_MARCH"  # -march for the build (default native); e.g. haswell to try the AVX2 path
# New tokens per forward the kernel serves. Measured on a 2-core Sapphire Rapids (AMX),
# kernel vs PyTorch's attention, 2K and 16K keys: 1 token 1.2-1.5x faster, 2 tokens
# 1.1-1.2x, 3 tokens 0.85x in bfloat16 (its products, row by row on AVX512, lose to
# oneDNN's AMX GEMMs as the rows grow); float32 breaks even near 6. Wider trees and
# prompt chunks take PyTorch's path there.
MAX_TOKENS = 2
# Without AMX, on AVX512-BF16 (a 2-core AMD EPYC Zen 4), 30 layers of bfloat16 attention
# over 2,048 keys: kernel 3.95 / 3.96 / 6.5 / 10.4 / 19.8 / 36.8 ms for 1 / 3 / 4 / 8 /
# 16 / 32 tokens, PyTorch's 12.0 / 12.1 / 13.4 / 21.8 / 38.7 / 66.8.
# (Before the pairs paths for 9+ rows; with them, 2026-12-05, 4 / 16 tokens 4.7 / 12.2 ms
# against 5.7 / 17.9 over 2K keys, and 42.9 / 121.8 against 53.6 / 191.3 over 32K.)
MAX_TOKENS_AVX512_BF16 = 32
# With AMX (a 2-core Sapphire Rapids, 2026-12-03; the kernel's products of 3+ rows on
# AMX tiles), 30 layers of bfloat16 attention, kernel vs PyTorch's, in turns in one
# process (`benchmarks/attention_tokens.py`): over 2,048 keys 2.4 / 3.4 / 5.1 / 8.1 /
# 17.9 ms for 1 / 4 / 8 / 16 / 32 tokens against 4.0 / 6.2 / 7.9 / 11.6 / 17.1; over
# 16,384 keys 19.9 / 25.2 / 35.8 / 54.3 / 99.0 against 47.6 / 56.5 / 74.0 / 108.0 / 128.4.
# (Before the tiles, with the products by AVX512-BF16 pairs, 16 tokens lost: 282 vs 276
# ms over 16K keys.)
MAX_TOKENS_AMX_BF16 = 16
# On AVX2 without AVX512 (the path built with -march=haswell: blocks of keys and values
# converted once for all rows), measured on a 2-core AMD EPYC Zen 4 made to run as an
# AVX2 machine (the kernel built for haswell; PyTorch with ATEN_CPU_CAPABILITY=avx2,
# ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2), 30 layers of bfloat16 attention
# (`benchmarks/attention_tokens.py`, 2026-12-05): over 2,048 keys 4.2 / 7.1 / 8.2 / 14.5
# / 27.1 ms for 1 / 3 / 4 / 8 / 16 tokens against PyTorch's 9.0 / 12.0 / 12.7 / 18.1 /
# 26.5; over 16,384 keys 24.3 / 37.4 / 43.9 / 100.2 / 189.3 against 64.8 / 81.5 / 85.3 /
# 126.0 / 200.2. Not yet measured on an AVX2-only CPU itself.
MAX_TOKENS_AVX2_BF16 = 8


def max_tokens(dtype: torch.dtype = torch.bfloat16) -> int:
    """New tokens per forward that :func:`decode_attention` serves on this CPU for
    ``dtype``: in bfloat16, :data:`MAX_TOKENS_AVX512_BF16` where the kernels are built
    for AVX512-BF16 without AMX, :data:`MAX_TOKENS_AMX_BF16` with AMX and
    :data:`MAX_TOKENS_AVX2_BF16` on AVX2 without AVX512; :data:`MAX_TOKENS` elsewhere
    (where wider forwards are not measured faster)."""
    if dtype == torch.bfloat16:
        path = linear_path()
        if path == "avx512-bf16":
            return MAX_TOKENS_AVX512_BF16
        if path == "amx":
            return MAX_TOKENS_AMX_BF16
        if path == "avx2":
            return MAX_TOKENS_AVX2_BF16
    return MAX_TOKENS


def enabled() -> bool:
    """False where ``TOKENSWIFT_KERNELS`` is ``off`` (or ``0``/``false``)."""
    return os.environ.get(ENV, "auto").strip().lower() not in ("off", "0", "false", "no")


def march() -> str:
    return os.environ.get(MARCH_ENV, "native")


def build_root() -> Path:
    """The folder of the kernels' builds, one subfolder per :func:`build_key`."""
    override = os.environ.get(CACHE_ENV, "").strip()
    return Path(override) if override else cache_dir() / "kernels"


def build_key() -> str:
    text = b"".join(source.read_bytes() for source in SOURCES + HEADERS) + torch.__version__.encode() + machine_name(torch.device("cpu")).encode() + march().encode()
    return hashlib.sha256(text).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def _load() -> bool:
    if not enabled():
        return False
    try:
        from torch.utils import cpp_extension

        directory = build_root() / build_key()
        directory.mkdir(parents=True, exist_ok=True)
        for header in HEADERS:
            _staged(header, directory)
        cpp_extension.load(
            name=f"tokenswift_kernels_{build_key()}",
            sources=[str(_staged(source, directory)) for source in SOURCES],
            extra_cflags=["-O3", f"-march={march()}", "-fopenmp", "-ffp-contract=fast"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: today's path
        logger.warning("tokenswift's CPU kernels could not be built (%s); using PyTorch's attention and products",
                       str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
        return False
    global _fake_registered, _path
    _path = torch.ops.tokenswift_cpu.few_rows_linear_path()  # fixed by the build: asked once
    if not _fake_registered:  # once per process, however often the build is looked up again
        torch.library.register_fake("tokenswift_cpu::few_rows_linear")(_linear_shape)
        _fake_registered = True
    return True


_fake_registered = False
_path: str | None = None  # the built kernels' bfloat16 product path (see linear_path)


def _staged(source: Path, directory: Path) -> Path:
    """``source`` copied into the build folder (the folder is keyed by the sources'
    bytes): the build then names the same files whichever checkout or install imported
    tokenswift, so ninja does not rebuild because the package moved."""
    staged = directory / source.name
    text = source.read_bytes()
    if not staged.is_file() or staged.read_bytes() != text:
        partial = directory / f".{source.name}.{os.getpid()}"
        partial.write_bytes(text)
        partial.replace(staged)  # atomic: a concurrent build sees the old bytes or the new, never half
    return staged


def _linear_shape(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def available() -> bool:
    """Whether the kernels are built and loaded (building them at the first call)."""
    return _load()


def chunk_size(keys: int, kv_heads: int) -> int:
    """Keys per work item: enough items for every thread several times over, each big
    enough that its fixed costs do not matter."""
    threads = torch.get_num_threads()
    per_head = max(1, -(-4 * threads // kv_heads))
    # Every thread the same number of chunks: 3 KV heads x 3 chunks left one of two
    # threads a chunk more, and 30 layers of an 8-token tree over 2,048 keys took 6.0 ms
    # against 5.0-5.2 in 4 chunks (a 2-core Sapphire Rapids, the KV in cache; 5.9-6.2
    # against 6.5-7.7 read from memory; 1 token and 32K keys unchanged).
    while per_head * kv_heads % threads:
        per_head += 1
    # Up to 1,024 keys: 30 layers of 64K positions ran 4% faster than with 256 (a
    # 2-core Sapphire Rapids; 64 to 16K keys all within 10%).
    return max(64, min(1024, -(-keys // per_head)))


def serves(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` takes this forward's attention (building the
    kernel at the first call that could use it)."""
    return (
        query.device.type == "cpu"
        and query.shape[2] <= max_tokens(query.dtype)
        and key.stride(-1) == 1
        and value.stride(-1) == 1
        and key.stride(2) == value.stride(2)
        and key.dtype == value.dtype
        and key.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        and available()
    )


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix: int, tree_mask: torch.Tensor | None, scaling: float,
    chunk: int | None = None,
) -> torch.Tensor:
    """query: [1, q_heads, n, D]; key/value: [1, kv_heads, prefix + n, D] (the new
    tokens' keys last; views of the store are fine); tree_mask: [n, n] bool among the
    new tokens, or None when every row sees every key; chunk: keys per work item (default
    :func:`chunk_size`, for a caller that settles it once for many layers). Returns
    [1, n, q_heads, D] in the query's dtype; the softmax in float32 (float64 for float64
    queries)."""
    if chunk is None:
        chunk = chunk_size(key.shape[2] if tree_mask is None else prefix, key.shape[1])
    return torch.ops.tokenswift_cpu.decode_attention_heads(query, key, value, prefix, tree_mask, chunk, float(scaling))


def staged_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, store_keys: torch.Tensor, store_values: torch.Tensor,
    prefix: int, tree_mask: torch.Tensor | None, scaling: float, chunk: int,
) -> torch.Tensor:
    """One layer of a verify forward in one call: ``key``/``value`` ([1, kv_heads, n, D])
    written into ``store_keys``/``store_values`` ([1, kv_heads, capacity, D]) at positions
    ``[prefix, prefix + n)``, then :func:`decode_attention` of ``query`` ([1, q_heads, n, D])
    over positions ``[0, prefix + n)`` (``tree_mask``, ``chunk`` as there). Returns [1, n,
    q_heads, D] in the query's dtype."""
    return torch.ops.tokenswift_cpu.staged_attention(
        query, key, value, store_keys, store_values, prefix, tree_mask, chunk, float(scaling)
    )


# Rows a few-rows product serves. Measured on a 2-core Sapphire Rapids (AMX path), the
# 210 bfloat16 products of a SmolLM2-135M forward: 10.0 / 11.3 / 12.9 / 18.7 / 28.1 ms
# for 1 / 4 / 16 / 32 / 64 rows against 21-23 ms for PyTorch's 1-32 rows and 28.6 for 64.
MAX_LINEAR_ROWS = 32


def linear_path() -> str | None:
    """The few-rows product's bfloat16 path in the built kernels: "amx", "avx512-bf16",
    "avx512", "avx2" or "scalar" (the last three widen to float32); None where the
    kernels are not available."""
    if not available():
        return None
    return _path


# The bfloat16 paths on which ``auto`` turns the kernel on: measured faster than PyTorch's
# products on each (docs/compiled.md). On AVX2 (an AMD EPYC Zen 3, 2 cores; the W rows
# widened in registers) the 210 products of a SmolLM2-135M forward took 11-12 / 13-15 /
# 20-22 / 30-36 ms for 1 / 2 / 4 / 8 rows against PyTorch's 14-17 / 25-29 / 46-55 /
# 87-100, and a compiled tree forward of 2 / 4 / 8 tokens at 2K positions 22.5 / 32.1 /
# 45.6 ms against 45.2 / 75.9 / 128.2. With the weights packed in the pairs layout
# (2026-12-07, the same machine, `benchmarks/linear_rows.py`, the 211 products with the LM
# head, in turns): 18.7 / 19.5 / 24.1 / 39.1 ms for 1 / 2 / 4 / 8 rows against 22.0 /
# 26.1 / 32.1 / 49.3 as stored and PyTorch's 25.4 / 43.2 / 77.5 / 150.2: a second row now
# costs 4% of the first (19%). AVX512 without BF16 and float32 are not measured
# in whole runs, so they keep PyTorch's products.
AUTO_LINEAR_PATHS = ("amx", "avx512-bf16", "avx2")


def linears_by_default(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model of ``dtype`` on ``device`` runs its products of a few rows through
    :func:`few_rows_linear`. ``TOKENSWIFT_LINEARS``: ``kernel`` wherever it serves the
    dtype (float32, bfloat16), ``torch`` never, ``auto`` (default): bfloat16 models on
    the paths of :data:`AUTO_LINEAR_PATHS`. Measured there (bfloat16, SmolLM2-135M's 210
    products of a forward): 10.0 vs 21-24 ms for one row on a Sapphire Rapids (AMX),
    12.5 vs 19.4 ms on an AMD EPYC Zen 4 (AVX512-BF16), 11-12 vs 14-17 ms on an AMD
    EPYC Zen 3 (AVX2), and faster up to 32 rows."""
    choice = os.environ.get(LINEARS_ENV, "auto").strip().lower()
    if choice not in ("auto", "kernel", "torch"):
        raise ValueError(f"{LINEARS_ENV}={choice!r}: expected auto, kernel or torch")
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or choice == "torch":
        return False
    if choice == "kernel":
        return available()
    return dtype == torch.bfloat16 and linear_path() in AUTO_LINEAR_PATHS


def linear_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`few_rows_linear` takes ``F.linear(x, weight)``, given that the
    kernels are :func:`available` (checked by whoever turns them on: this runs inside
    traced code, which cannot call the cached build)."""
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.dim() == 2
        and x.numel() <= MAX_LINEAR_ROWS * x.shape[-1]
    )


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [..., K] of a few rows, weight [O, K], in
    float32 or bfloat16: accumulated in float32, each row's result the same whatever
    other rows share the call. Returns [..., O] in x's dtype."""
    return torch.ops.tokenswift_cpu.few_rows_linear(x, weight, bias)


def packs_weights() -> bool:
    """Whether the built kernels keep packed copies of the bfloat16 weights they multiply
    (AVX512-BF16 without AMX, AVX2, and on AMX machines the shapes the tiles do not take)."""
    return linear_path() in ("avx512-bf16", "amx", "avx2")


def packed_size(weight: torch.Tensor) -> int:
    """Bytes the packed copy of ``weight`` [O, K] takes once :func:`few_rows_linear` has
    multiplied by it on this build (0: it is multiplied as it is; the kernel's own
    dispatch decides)."""
    return int(torch.ops.tokenswift_cpu.packed_size(weight)) if available() else 0


def packed_weight_bytes() -> int:
    """Bytes of the packed weight copies held now (those of weights still alive)."""
    return int(torch.ops.tokenswift_cpu.packed_weight_bytes()) if available() else 0


def forget_packed_weights() -> None:
    """Drop every packed weight copy (the next product packs again). Needed only where
    a weight was changed through ``.data``, which PyTorch's version counter does not
    see; other in-place changes are noticed."""
    if available():
        torch.ops.tokenswift_cpu.forget_packed_weights()
