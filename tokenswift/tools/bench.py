"""Side-by-side benchmark: transformers' generate (plain and prompt lookup) and our
presets, on one loaded model, one prompt and one sampling setting, in one process.

Speed is reported as ratios to transformers ``generate()`` measured in the same run.
transformers' repetition penalty has no window, so its baselines get the pipelines'
own penalty as a ``LogitsProcessor`` (:class:`PenaltyProcessor`, through the same
:class:`~tokenswift.scoring.Scorer`): every method samples from the same distribution.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import torch
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from tokenswift.memory import peak_rss_mib, reset_peak_rss
from tokenswift.scoring import Scorer

logger = logging.getLogger(__name__)

HF_METHODS = ("hf-generate", "hf-prompt-lookup")
PRESET_METHODS = ("ar", "tokenswift", "medusa", "eagle", "prompt-lookup")


def prompt_tokens_for(tokenizer, num_tokens: int, prompt_file: str | None) -> list[int]:
    """The first ``num_tokens`` tokens of ``prompt_file`` (UTF-8), or of the bundled
    held-out prompt when None."""
    from pathlib import Path

    from tokenswift.prompts import prompt_ids

    if prompt_file is None:
        return prompt_ids(tokenizer, num_tokens)
    return prompt_ids(tokenizer, num_tokens, Path(prompt_file).read_text(encoding="utf-8"), f"--prompt-file {prompt_file}")


def drafter_overrides(preset: str, heads: str) -> dict:
    """The drafter options a benchmark gives ``preset``: ``heads`` for the head drafters;
    for ``eagle``, random weights when the heads are random (measuring the machinery),
    else its shipped ones."""
    if preset in ("tokenswift", "medusa"):
        return {"heads": heads}
    if preset == "eagle":
        return {"weights": "random" if heads == "random" else "auto"}
    return {}


def preset_pipeline(preset: str, model, tokenizer, *, heads: str = "auto", overrides: dict | None = None):
    """``preset`` on ``model`` with ``overrides`` (spec sections) and the drafter options
    a benchmark gives it (:func:`drafter_overrides`)."""
    from tokenswift import Pipeline

    spec = dict(overrides or {})
    given = drafter_overrides(preset, heads)
    if given:  # the caller's drafter options win (an ablation's depth or tree must not be dropped)
        spec["drafter"] = {**given, **spec.get("drafter", {})}
    return Pipeline.from_spec(preset, model, tokenizer, overrides=spec)


BLOCK = 1000


@attrs.frozen(kw_only=True)
class BenchConfig:
    model: str = "smollm2"
    dtype: str = "auto"
    device: str = "cpu"
    rope: dict | None = None  # RoPE-scaling override, for runs past the trained context
    heads: str = "auto"
    prompt_tokens: int = 2048
    prompt_file: str | None = None  # UTF-8 text whose first prompt_tokens tokens are the prompt (default: the bundled one)
    new_tokens: int = 6144
    greedy: bool = False
    temperature: float = 1.0
    min_p: float = 0.1
    penalty: float = 1.2
    window: int = 1024
    seed: int = 0
    methods: tuple[str, ...] = HF_METHODS + PRESET_METHODS


@attrs.frozen(kw_only=True)
class MethodResult:
    method: str
    new_tokens: int
    seconds: float
    tokens_per_second: float
    speedup: float | None  # vs hf-generate in the same run
    tokens_per_step: float | None
    acceptance_rate: float | None
    peak_rss_mib: float
    peak_gpu_mib: float | None  # CUDA runs: torch's peak allocation on the GPU
    block_ms_per_token: list[float]  # per successive 1K-token block
    identical_to_ar: float | None  # greedy runs: fraction of tokens equal to the ar run
    distinct: list[float]  # distinct-1..4
    curve: list[tuple[int, float]]  # (generated, cumulative tokens/s)
    error: str | None = None
    decisions: dict | None = None  # presets: verified vs proposed nodes, predicted vs realised tokens per step


class PenaltyProcessor(LogitsProcessor):
    """A scorer's penalty (with its window) as a transformers ``LogitsProcessor``, for
    ``generate()``; transformers then applies its own sampling warpers."""

    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer

    def __call__(self, input_ids, scores):
        window = self.scorer.window
        return self.scorer.penalize(input_ids[:, -window:] if window else input_ids[:, :0], scores)


class _TokenClock(BaseStreamer):
    """Timestamps each token transformers' generate emits (and reports them to ``on_tokens``)."""

    def __init__(self, on_tokens: Callable[[int], None] | None = None) -> None:
        self.times: list[float] = []
        self._prompt_seen = False
        self._on_tokens = on_tokens

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        count = int(value.numel())
        self.times.extend([time.perf_counter()] * count)
        if self._on_tokens is not None:
            self._on_tokens(count)

    def end(self):
        pass


def distinct_n(tokens: list[int], n: int) -> float:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def _agreement(tokens: list[int], reference: list[int]) -> float:
    """Fraction of positions where ``tokens`` equals ``reference``."""
    return sum(a == b for a, b in zip(tokens, reference)) / max(len(reference), 1)


def _timing(stamps: list[float], start: float) -> tuple[list[float], list[tuple[int, float]]]:
    blocks, curve = [], []
    previous = start
    for b in range(0, len(stamps), BLOCK):
        block = stamps[b : b + BLOCK]
        blocks.append(round(1000 * (block[-1] - previous) / len(block), 2))
        previous = block[-1]
    step = max(1, len(stamps) // 64)
    for i in range(step - 1, len(stamps), step):
        curve.append((i + 1, round((i + 1) / max(stamps[i] - start, 1e-9), 3)))
    return blocks, curve


def _sampling_spec(config: BenchConfig) -> dict:
    return {"greedy": True} if config.greedy else {"temperature": config.temperature, "min_p": config.min_p}


def run_bench(
    config: BenchConfig,
    progress: Callable[[str, int], None] | None = None,
    *,
    model=None,
    tokenizer=None,
    on_method: Callable[[list[MethodResult], dict], None] | None = None,
) -> tuple[list[MethodResult], dict]:
    """Run every method in turn on the same model and prompt; return results and run info.
    ``model``/``tokenizer`` replace loading ``config.model`` (tests). ``on_method`` gets
    the results so far after each method (a long run interrupted keeps what it measured)."""
    from tokenswift import Pipeline, hookimpl
    from tokenswift.model.loading import load_model
    from tokenswift.spec import ModelSpec

    if model is None:
        model, tokenizer = load_model(ModelSpec(path=config.model, dtype=config.dtype, device=config.device, rope=config.rope))
    device = next(model.parameters()).device
    prompt = prompt_tokens_for(tokenizer, config.prompt_tokens, config.prompt_file)
    info = {"config": attrs.asdict(config), "torch": torch.__version__, "threads": torch.get_num_threads()}
    penalty = {"name": "contextual", "value": config.penalty, "window": config.window}
    # transformers' methods get the penalty of an ar pipeline with the same settings.
    ar_pipe = Pipeline.from_spec({"preset": "ar", "penalty": penalty, "sampling": _sampling_spec(config)}, model, tokenizer)
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    results: list[MethodResult] = []
    outputs: dict[str, list[int]] = {}
    for method in config.methods:
        reset_peak_rss()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        stamps: list[float] = []
        stats = None
        error = None
        try:
            if method in HF_METHODS:
                clock = _TokenClock(on_tokens=(lambda n, m=method: progress(m, n)) if progress else None)
                torch.manual_seed(config.seed)
                ids = torch.tensor([prompt], device=device)
                kwargs = dict(
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=config.new_tokens,
                    min_new_tokens=config.new_tokens,
                    do_sample=not config.greedy,
                    logits_processor=LogitsProcessorList([PenaltyProcessor(ar_pipe.scorer)]),
                    streamer=clock,
                    pad_token_id=tokenizer.eos_token_id,
                )
                if not config.greedy:
                    kwargs.update(temperature=config.temperature, min_p=config.min_p, top_k=0, top_p=1.0)
                if method == "hf-prompt-lookup":
                    kwargs["prompt_lookup_num_tokens"] = 10
                with torch.inference_mode():
                    out = model.generate(ids, **kwargs)
                tokens = out[0, len(prompt) :].tolist()
                stamps = clock.times
            else:
                spec = {"preset": method, "penalty": penalty, "sampling": _sampling_spec(config)}
                if drafter_overrides(method, config.heads):
                    spec["drafter"] = drafter_overrides(method, config.heads)
                pipe = Pipeline.from_spec(spec, model, tokenizer)

                class Clock:
                    @hookimpl
                    def tokenswift_step_end(self, pipeline, step):
                        stamps.extend([time.perf_counter()] * len(step.emitted))
                        if progress:
                            progress(method, len(step.emitted))

                pipe.plugin_manager.register(Clock())
                started = time.perf_counter()
                result = pipe.generate(prompt, config.new_tokens, seed=config.seed, ignore_eos=True)
                tokens, stats = result.tokens, result.stats
        except Exception as exc:  # a baseline that transformers refuses is reported, not fatal
            logger.warning("%s failed: %s", method, exc)
            error = f"{type(exc).__name__}: {exc}"
            tokens = []
        seconds = time.perf_counter() - started
        outputs[method] = tokens
        blocks, curve = _timing(stamps, started) if stamps else ([], [])
        results.append(
            MethodResult(
                method=method,
                new_tokens=len(tokens),
                seconds=round(seconds, 2),
                tokens_per_second=round(len(tokens) / seconds, 3) if tokens else 0.0,
                speedup=None,
                tokens_per_step=round(stats.tokens_per_step, 3) if stats else None,
                acceptance_rate=round(stats.acceptance_rate, 3) if stats else None,
                peak_rss_mib=round(peak_rss_mib(), 1),
                peak_gpu_mib=round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else None,
                block_ms_per_token=blocks,
                identical_to_ar=None,
                distinct=[round(distinct_n(tokens, n), 4) for n in (1, 2, 3, 4)],
                curve=curve,
                error=error,
                decisions=stats.decisions() if stats else None,
            )
        )
        if on_method is not None:
            on_method(_compared(results, outputs, config), info)
    return _compared(results, outputs, config), info


def _compared(results: list[MethodResult], outputs: dict[str, list[int]], config: BenchConfig) -> list[MethodResult]:
    """``results`` with the speed-up over hf-generate and (greedy) the identity with ar filled in."""
    base = next((r for r in results if r.method == "hf-generate" and r.tokens_per_second), None)
    if base is not None:
        results = [attrs.evolve(r, speedup=round(r.tokens_per_second / base.tokens_per_second, 3)) for r in results]
    reference = outputs.get("ar")
    if config.greedy and reference:
        results = [
            attrs.evolve(r, identical_to_ar=round(_agreement(outputs[r.method], reference), 4)) if outputs[r.method] else r
            for r in results
        ]
    return results


def markdown_table(results: list[MethodResult]) -> str:
    gpu = any(r.peak_gpu_mib is not None for r in results)
    memory = "peak RSS MiB" + (" / GPU MiB" if gpu else "")
    head = f"| method | tok/s | vs generate | tok/step | accept | {memory} | ms/tok per 1K block | same as ar | distinct-1/2/3/4 |"
    lines = [head, "|" + "---|" * 9]
    for r in results:
        fmt = lambda v: "–" if v is None else str(v)  # noqa: E731
        peak = f"{r.peak_rss_mib} / {fmt(r.peak_gpu_mib)}" if gpu else str(r.peak_rss_mib)
        lines.append(
            f"| {r.method} | {r.tokens_per_second} | {fmt(r.speedup)} | {fmt(r.tokens_per_step)} | "
            f"{fmt(r.acceptance_rate)} | {peak} | {' / '.join(map(str, r.block_ms_per_token))} | "
            f"{fmt(r.identical_to_ar)} | {' / '.join(map(str, r.distinct))} |"
            + (f" error: {r.error}" if r.error else "")
        )
    return "\n".join(lines) + "\n"


def print_and_write_table(lines: list[str], note: str, out_dir: str | Path, name: str) -> Path:
    """A benchmark script's markdown table (``lines``) and the note under it (machine,
    settings): printed, and written to ``out_dir/name`` (the folder made if needed)."""
    text = "\n".join(lines) + "\n" + note
    print(text)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(text)
    return out / name


def write_reports(results: list[MethodResult], info: dict, out_dir: str | Path) -> dict[str, Path]:
    """bench.json, bench.md and bench.png in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "bench.json", "markdown": out_dir / "bench.md", "plot": out_dir / "bench.png"}
    paths["json"].write_text(json.dumps({**info, "results": [attrs.asdict(r) for r in results]}, indent=2) + "\n")
    paths["markdown"].write_text(markdown_table(results))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        if r.curve:
            xs, ys = zip(*r.curve)
            ax.plot(xs, ys, label=r.method)
    cfg = info["config"]
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("tokens / s (cumulative)")
    where = info.get("gpu", "CPU")
    ax.set_title(f"{cfg['model']} {cfg['dtype']} on {where}, {cfg['prompt_tokens']}-token prompt, {'greedy' if cfg['greedy'] else 'sampling'}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths["plot"], dpi=110)
    plt.close(fig)
    return paths
