"""A self-distillation corpus: what the target itself writes, for training drafters on.

Drafters meet the target's own text at inference, not books: EAGLE trains on the
target's answers, Medusa-2 self-distils. :func:`distill` writes shards of the target's
continuations of prompts drawn from a JSON Lines corpus (random windows of its books,
the held-out ones excluded), half the shards decoded greedily and half with the
presets' sampling (temperature 1, min-p 0.1), both with the presets' contextual penalty,
in batches through transformers' ``generate`` (speed matters more than losslessness
here: this is training data). Each shard is a JSON Lines file ``shard-NNNN.jsonl``
(``id``, ``text``: prompt and continuation, ``decoding``, ``prompt_tokens``,
``new_tokens``, ``prompt``: ``book`` or ``chat``) written whole or not at all; a run that stops resumes at the first
missing shard, and shard i's prompts and seed depend on i alone. ``tokenswift
train-drafter --data DIR`` (or ``train-heads``) reads the shards.

With ``chat``, the shards' prompts are instructions, as users drive an Instruct model:
the tokenizer's own chat template around one of :data:`INSTRUCTIONS` (chosen by the
shard's index) and a book excerpt; the target answers until its end of turn (at most
``new_tokens``).
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
from tokenswift.prompts import run_end_ids
from tokenswift.scoring import Scorer
from tokenswift.spec import SamplingSpec
from tokenswift.tools.bench import PenaltyProcessor
from tokenswift.tools.training import read_corpus, sample_windows

logger = logging.getLogger(__name__)

RECORD = "distill.json"
EXCERPT = "\x00EXCERPT\x00"  # where the book excerpt goes in an instruction
INSTRUCTIONS = (
    "Continue this passage from a novel, in the same style:\n\n" + EXCERPT,
    "Here is the opening of a story. Write what happens next, at length:\n\n" + EXCERPT,
    "Summarize the following passage, then explain what it tells us about its characters:\n\n" + EXCERPT,
    "Rewrite this passage as a modern short story:\n\n" + EXCERPT,
    "Write a detailed essay about the themes of this passage:\n\n" + EXCERPT,
)


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
    chat: bool = False


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
    # the penalty as the pipelines score (the ids that end a run exempt), so the corpus is what they write
    scorer = Scorer(penalty, SamplingSpec(greedy=True), exempt=run_end_ids(model, tokenizer))
    processors = LogitsProcessorList([PenaltyProcessor(scorer)])
    started, written, generated = time.perf_counter(), [], 0
    for index in range(config.shards):
        path = shard_path(out_dir, index)
        if path.is_file():
            continue
        generator = torch.Generator().manual_seed(config.seed * 1000 + index)
        prompts = sample_windows(corpus.train, config.batch, config.prompt_tokens, generator)
        if config.chat:
            prompts = chat_prompts(tokenizer, prompts, INSTRUCTIONS[index % len(INSTRUCTIONS)])
        prompts = prompts.to(device)
        decoding = shard_decoding(index)
        kwargs = {"do_sample": False} if decoding == "greedy" else {"do_sample": True, "temperature": 1.0, "min_p": config.min_p, "top_k": 0}
        torch.manual_seed(config.seed * 1000 + index)  # transformers samples from the global generator
        out = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=config.new_tokens,
            min_new_tokens=1 if config.chat else config.new_tokens, logits_processor=processors, pad_token_id=tokenizer.eos_token_id,
            # a preallocated cache: the default one is concatenated anew every step (40% of a
            # batch-64 step on a 2-core Sapphire Rapids; 315 -> 420 tokens/s in all)
            cache_implementation="static", **kwargs,
        )
        lines = []
        width = prompts.shape[1]
        for row, ids in enumerate(out.tolist()):
            new = ids[width:]
            if tokenizer.eos_token_id in new:  # a chat answer ends at its end of turn
                new = new[: new.index(tokenizer.eos_token_id) + 1]
            lines.append(json.dumps({
                "id": f"distill-{index:04d}-{row:02d}", "text": tokenizer.decode(ids[:width] + new, skip_special_tokens=not config.chat),
                "decoding": decoding, "prompt": "chat" if config.chat else "book", "prompt_tokens": width,
                "new_tokens": len(new),
            }))
            generated += len(new)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        tmp.replace(path)
        written.append(path.name)
        if progress is not None:
            progress(config.batch * config.new_tokens)  # the bar counts the shard's budget; chat answers may end sooner
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


def chat_prompts(tokenizer, excerpts: torch.Tensor, instruction: str) -> torch.Tensor:
    """excerpts: [B, n] book-token windows -> [B, m] ids: each excerpt inside
    ``instruction`` (at :data:`EXCERPT`), as a user turn of the tokenizer's chat
    template with the assistant's turn opened. All rows have one length (the template's
    tokens around each excerpt are the same)."""
    from tokenswift.prompts import chat_template_text

    before, after = chat_template_text(tokenizer, [{"role": "user", "content": instruction}]).split(EXCERPT)
    prefix = tokenizer(before, add_special_tokens=False)["input_ids"]
    suffix = tokenizer(after, add_special_tokens=False)["input_ids"]
    b = excerpts.shape[0]
    return torch.cat([torch.tensor([prefix] * b), excerpts, torch.tensor([suffix] * b)], dim=1)


def read_shards(directory: str | os.PathLike) -> list[dict]:
    """Every record of the corpus's shards, in shard order."""
    records = []
    for path in sorted(Path(directory).glob("shard-*.jsonl")):
        records.extend(json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return records
