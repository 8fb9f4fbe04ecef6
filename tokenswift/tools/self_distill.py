"""A self-distillation corpus: what the target itself writes, for training drafters on.

Drafters meet the target's own text at inference, not books: EAGLE trains on the
target's answers, Medusa-2 self-distils. :func:`distill` writes shards of the target's
continuations of prompts drawn from a JSON Lines corpus (random windows of its books,
the held-out ones excluded), half the shards decoded greedily and half with the
presets' sampling (temperature 1, min-p 0.1), both with the presets' contextual penalty,
in batches through transformers' ``generate`` (speed matters more than losslessness
here: this is training data). Each shard is a JSON Lines file ``shard-NNNN.jsonl``
(``id``, ``text``: prompt and continuation, ``decoding``, ``prompt_tokens``,
``new_tokens``) written whole or not at all; a run that stops resumes at the first
missing shard, and shard i's prompts and seed depend on i alone. ``tokenswift
train-drafter --data DIR`` (or ``train-heads``) reads the shards.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import torch
from transformers import LogitsProcessorList

from tokenswift.penalties.contextual import ContextualPenalty
from tokenswift.scoring import Scorer
from tokenswift.spec import SamplingSpec
from tokenswift.tools.bench import PenaltyProcessor
from tokenswift.tools.training import read_corpus, sample_windows

logger = logging.getLogger(__name__)

RECORD = "distill.json"


@attrs.frozen(kw_only=True)
class DistillConfig:
    shards: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    batch: int = attrs.field(default=32, validator=attrs.validators.ge(1))  # sequences per shard, generated together
    prompt_tokens: int = attrs.field(default=128, validator=attrs.validators.ge(1))
    new_tokens: int = attrs.field(default=384, validator=attrs.validators.ge(1))
    penalty: float = attrs.field(default=1.2, validator=attrs.validators.ge(1.0))
    penalty_window: int = attrs.field(default=1024, validator=attrs.validators.ge(1))
    min_p: float = attrs.field(default=0.1, validator=attrs.validators.ge(0.0))
    seed: int = 0
    holdout: tuple[str, ...] = ("wuthering_heights",)


def shard_path(out_dir: str | os.PathLike, index: int) -> Path:
    return Path(out_dir) / f"shard-{index:04d}.jsonl"


def shard_decoding(index: int) -> str:
    """Even shards greedy, odd ones sampled."""
    return "greedy" if index % 2 == 0 else "sampled"


@torch.inference_mode()
def distill(
    model, tokenizer, data: str | os.PathLike, out_dir: str | os.PathLike, config: DistillConfig,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Write the missing shards of the corpus into ``out_dir``; returns the run's record
    (also written as ``distill.json``). ``progress(n)``: n more tokens generated."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = read_corpus(data, tokenizer, config.holdout)
    device = next(model.parameters()).device
    penalty = ContextualPenalty(ContextualPenalty.Options(value=config.penalty, window=config.penalty_window), None)
    processors = LogitsProcessorList([PenaltyProcessor(Scorer(penalty, SamplingSpec(greedy=True)))])
    started, written, generated = time.perf_counter(), [], 0
    for index in range(config.shards):
        path = shard_path(out_dir, index)
        if path.is_file():
            continue
        generator = torch.Generator().manual_seed(config.seed * 1000 + index)
        prompts = sample_windows(corpus.train, config.batch, config.prompt_tokens, generator).to(device)
        decoding = shard_decoding(index)
        kwargs = {"do_sample": False} if decoding == "greedy" else {"do_sample": True, "temperature": 1.0, "min_p": config.min_p, "top_k": 0}
        torch.manual_seed(config.seed * 1000 + index)  # transformers samples from the global generator
        out = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=config.new_tokens,
            min_new_tokens=config.new_tokens, logits_processor=processors, pad_token_id=tokenizer.eos_token_id, **kwargs,
        )
        lines = []
        for row, ids in enumerate(out.tolist()):
            lines.append(json.dumps({
                "id": f"distill-{index:04d}-{row:02d}", "text": tokenizer.decode(ids, skip_special_tokens=True),
                "decoding": decoding, "prompt_tokens": config.prompt_tokens, "new_tokens": len(ids) - config.prompt_tokens,
            }))
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        tmp.replace(path)
        written.append(path.name)
        generated += config.batch * config.new_tokens
        if progress is not None:
            progress(config.batch * config.new_tokens)
        logger.info("shard %d (%s) written", index, decoding)
    record = {
        "config": attrs.asdict(config),
        "shards": sorted(p.name for p in out_dir.glob("shard-*.jsonl")),
        "written_this_run": written,
        "tokens_generated_this_run": generated,
        "seconds_this_run": round(time.perf_counter() - started, 1),
        "train_books": list(corpus.train_ids),
        "held_out_books": list(corpus.held_out_ids),
    }
    (out_dir / RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def read_shards(directory: str | os.PathLike) -> list[dict]:
    """Every record of the corpus's shards, in shard order."""
    records = []
    for path in sorted(Path(directory).glob("shard-*.jsonl")):
        records.extend(json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return records
