"""Checkpoints of a generation: enough to continue it exactly.

A checkpoint holds the prompt, the tokens generated so far, the seed and the spec (and
the random generator's state, which only the inverse-CDF sampler reads). Because each
token's draw depends only on its scores and (seed, position), and drafts only change
speed, a resumed run emits exactly what the uninterrupted run would have (in
float32/float64), whatever state the drafter, retriever or cache had (they are rebuilt
from the tokens). A checkpoint written before the coupled sampler (format 1) resumes
with the inverse-CDF sampler it was drawn with, one written before the keyed sampler
(format 2) with the coupled one.
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

FORMAT = "tokenswift-checkpoint/3"
# Written before the coupled sampler: their runs drew by inverse CDF, and resume so.
INVERSE_CDF_FORMATS = ("tokenswift-checkpoint/1",)
# Written before the keyed sampler: a run whose spec names no sampler drew with the coupled one.
COUPLED_FORMATS = ("tokenswift-checkpoint/2",)


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
        try:
            with tmp.open("w", encoding="utf-8") as f:
                json.dump(data, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:  # e.g. ``path`` is a directory: no half-written file left beside it
            tmp.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> Checkpoint:
        """Read a checkpoint, every field checked (types, lengths, the seed's range, the
        generator state); anything else is a one-line :class:`TokenswiftError` naming
        the file and the field. Token ids are checked against a model's vocabulary by
        ``Pipeline.check_resume``."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise TokenswiftError(f"no checkpoint at {path}") from None
        except IsADirectoryError:
            raise TokenswiftError(f"checkpoint {path} is a directory, not a checkpoint file") from None
        except (ValueError, RecursionError) as exc:  # JSON, UTF-8, an integer of too many digits
            raise TokenswiftError(f"checkpoint {path} is not readable: {exc}") from None
        if not isinstance(data, dict):
            raise TokenswiftError(f"{path} is not a tokenswift checkpoint ({FORMAT}): a JSON {type(data).__name__}, not an object")
        written = data.pop("format", None)
        if written not in (FORMAT, *INVERSE_CDF_FORMATS, *COUPLED_FORMATS):
            raise TokenswiftError(f"{path} is not a tokenswift checkpoint ({FORMAT})")
        _check_fields(path, data)
        if written in (*INVERSE_CDF_FORMATS, *COUPLED_FORMATS):
            sampling = data["spec"].setdefault("sampling", {})
            if isinstance(sampling, dict) and not sampling.get("greedy"):
                sampling.setdefault("sampler", "inverse-cdf" if written in INVERSE_CDF_FORMATS else "coupled")
        try:
            data["rng_state"] = base64.b64decode(data["rng_state"], validate=True)
            checkpoint = cls(**data)
            checkpoint.generator()
        except (ValueError, RuntimeError) as exc:
            raise TokenswiftError(f"checkpoint {path}: rng_state is not a generator state ({exc})") from None
        return checkpoint


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fields(path: Path, data: dict[str, Any]) -> None:
    """Each field of a checkpoint's JSON of the type the run needs, or a one-line error."""
    from tokenswift.validation import check_seed

    fields = {field.name for field in attrs.fields(Checkpoint)}
    required = {field.name for field in attrs.fields(Checkpoint) if field.default is attrs.NOTHING}
    if missing := sorted(required - data.keys()):
        raise TokenswiftError(f"checkpoint {path} is incomplete: it has no {missing}")
    if unknown := sorted(data.keys() - fields):
        raise TokenswiftError(f"checkpoint {path} has unknown fields {unknown}; a checkpoint has {sorted(fields)}")

    def bad(field: str, valid: str) -> TokenswiftError:
        return TokenswiftError(f"checkpoint {path}: {field} must be {valid}, got {data[field]!r:.80}")

    if not isinstance(data["spec"], dict):
        raise bad("spec", "an object (the run's spec)")
    for field in ("prompt_tokens", "tokens"):
        if not isinstance(data[field], list) or not all(_is_int(t) and t >= 0 for t in data[field]):
            raise bad(field, "a list of token ids (integers >= 0)")
    if not data["prompt_tokens"]:
        raise bad("prompt_tokens", "a non-empty list of token ids")
    if not _is_int(data["max_new_tokens"]) or data["max_new_tokens"] <= 0:
        raise bad("max_new_tokens", "a positive integer")
    if len(data["tokens"]) > data["max_new_tokens"]:
        raise TokenswiftError(
            f"checkpoint {path}: it holds {len(data['tokens'])} generated tokens, more than its "
            f"max_new_tokens ({data['max_new_tokens']})"
        )
    try:
        check_seed(data["seed"], f"checkpoint {path}: seed")
    except ValueError as exc:
        raise TokenswiftError(str(exc)) from None
    if not isinstance(data["rng_state"], str):
        raise bad("rng_state", "a base64 string")
    if not isinstance(data["ignore_eos"], bool):
        raise bad("ignore_eos", "true or false")
    if data.get("finish_reason") is not None and not isinstance(data["finish_reason"], str):
        raise bad("finish_reason", "a string or null")
