"""Measurements kept between runs: one format for every cached record.

A record (:class:`~tokenswift.calibration.Calibration`,
:class:`~tokenswift.compiling.CompileCalibration`) is a frozen attrs class measured once
per machine and model shape (:func:`machine_key`) and cached as JSON under
``$TOKENSWIFT_CACHE/calibration/``, written whole or not at all. A record that is
missing is measured; one that cannot be read is ignored with a warning (and measured
again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import ClassVar, TypeVar

import attrs
import torch

from tokenswift import kernels
from tokenswift.machine import machine_name
from tokenswift.paths import cache_dir

logger = logging.getLogger(__name__)

# Part of every key: a new format measures anew. 2: forwards timed over written KV
# (KVStore.occupy fills it), not over a fresh store's zero pages, which priced trees low.
CALIBRATION_FORMAT = "tokenswift-calibration/2"


def model_shape(runner) -> dict:
    """What a model's costs depend on (not its weights)."""
    config = runner.config
    return {
        "model_type": getattr(config, "model_type", None),
        "hidden_size": config.hidden_size,
        "intermediate_size": getattr(config, "intermediate_size", None),
        "layers": runner.num_layers,
        "heads": config.num_attention_heads,
        "kv_heads": runner.kv_heads,
        "vocab": runner.vocab_size,
    }


def attention_path(device: torch.device) -> str:
    """"kernel <build key>" where tokenswift's CPU decode kernel serves this device's
    one- and two-token steps (building it, at the first call, if it can be), else
    "pytorch"."""
    if device.type == "cpu" and kernels.available():
        return f"kernel {kernels.build_key()} up to {kernels.max_tokens()} tokens"
    return "pytorch"


def machine_key(runner) -> str:
    """The key of ``runner``'s measurements: machine, threads, torch, device, dtype, model shape."""
    identity = {
        "machine": machine_name(runner.device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": runner.device.type,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "model": model_shape(runner),
        "format": CALIBRATION_FORMAT,
        # which attention decode steps run through: measurements of one are no guide to the other
        "attention": attention_path(runner.device),
        # and which products: tokenswift's few-rows kernel or PyTorch's
        "linears": "kernel" if getattr(runner, "kernel_linears", False) else "pytorch",
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


R = TypeVar("R", bound="CachedRecord")


class CachedRecord:
    """Mixin for a frozen attrs record with a ``key`` field: its JSON form and its file.

    FORMAT: the ``format`` field its JSON carries; SUFFIX: after the key in the file
    name; TUPLES: fields held as tuples (JSON has lists), NESTED: tuples of tuples."""

    FORMAT: ClassVar[str]
    SUFFIX: ClassVar[str] = ""
    TUPLES: ClassVar[tuple[str, ...]] = ()
    NESTED: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict:
        return {"format": self.FORMAT, **attrs.asdict(self)}

    @classmethod
    def from_dict(cls: type[R], data: dict) -> R:
        data = dict(data)
        if data.pop("format", None) != cls.FORMAT:
            raise ValueError(f"not a {cls.FORMAT} record")
        for name in cls.TUPLES:
            data[name] = tuple(data[name])
        for name in cls.NESTED:
            data[name] = tuple(tuple(row) for row in data[name])
        return cls(**data)

    @classmethod
    def path(cls, key: str) -> Path:
        return cache_dir() / "calibration" / f"{key}{cls.SUFFIX}.json"

    @classmethod
    def load(cls: type[R], key: str) -> R | None:
        """The cached record under ``key``; None if there is none or it is unreadable."""
        path = cls.path(key)
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as exc:
            logger.warning("ignoring an unreadable cached %s %s (%s)", cls.__name__, path, exc)
            return None

    def save(self) -> Path | None:
        """Write the record whole or not at all (a temporary file, renamed); its path,
        or None where the cache cannot be written (then it is measured again next time)."""
        path = self.path(self.key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
            tmp.replace(path)
        except OSError as exc:
            logger.warning("could not cache %s (%s); it will be measured again next time", path.name, exc)
            return None
        return path
