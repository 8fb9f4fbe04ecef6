"""Checkpoints of a generation: enough to continue it exactly.

A checkpoint holds the prompt, the tokens generated so far, the seed and the spec (and
the random generator's state, which only the inverse-CDF sampler reads). Because each
token's draw depends only on its scores and (seed, position), and drafts only change
speed, a resumed run emits exactly what the uninterrupted run would have (in
float32/float64), whatever state the drafter, retriever or cache had (they are rebuilt
from the tokens). A checkpoint written before the coupled sampler (format 1) resumes
with the inverse-CDF sampler it was drawn with.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import attrs
import torch

from tokenswift.errors import TokenswiftError

FORMAT = "tokenswift-checkpoint/2"
# Written before the coupled sampler: their runs drew by inverse CDF, and resume so.
INVERSE_CDF_FORMATS = ("tokenswift-checkpoint/1",)


@attrs.frozen(kw_only=True)
class Checkpoint:
    spec: dict[str, Any]
    prompt_tokens: list[int]
    tokens: list[int]  # generated so far
    seed: int
    rng_state: bytes  # torch.Generator.get_state() after the draws of ``tokens``
    max_new_tokens: int
    ignore_eos: bool
    finish_reason: str | None = None  # set when the run ended ("length", "eos", "interrupted", ...)

    @property
    def done(self) -> bool:
        return self.finish_reason in ("length", "eos")

    def generator(self) -> torch.Generator:
        generator = torch.Generator(device="cpu")
        generator.set_state(torch.frombuffer(bytearray(self.rng_state), dtype=torch.uint8))
        return generator

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a crash mid-write leaves the previous checkpoint intact."""
        path = Path(path)
        data = attrs.asdict(self)
        data["rng_state"] = base64.b64encode(self.rng_state).decode()
        data["format"] = FORMAT
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("w", encoding="utf-8") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Checkpoint:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise TokenswiftError(f"no checkpoint at {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TokenswiftError(f"checkpoint {path} is not readable: {exc}") from None
        written = data.pop("format", None)
        if written in INVERSE_CDF_FORMATS:
            sampling = data["spec"].setdefault("sampling", {})
            if isinstance(sampling, dict) and not sampling.get("greedy"):
                sampling.setdefault("sampler", "inverse-cdf")
        elif written != FORMAT:
            raise TokenswiftError(f"{path} is not a tokenswift checkpoint ({FORMAT})")
        data["rng_state"] = base64.b64decode(data["rng_state"])
        return cls(**data)
