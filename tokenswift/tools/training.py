"""Training draft heads on a frozen base model.

Head i learns, with cross-entropy, the token i+1 places after the LM head's: from the
final hidden state of token t it predicts token t+i+1. The base model (and its LM
head, shared by the heads) stays frozen. TokenSwift's recipe: AdamW, lr 5e-3, weight
decay 0.1, cosine schedule with warmup.

Text comes from a JSON Lines file (one object per line with a ``text`` key, as
``shared/data/pg_books.jsonl``); whole books named by ``holdout`` are kept out of
training and used for the final per-head top-1/top-3 accuracy.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F

from tokenswift.drafters.draft_heads import DraftHeads, find_shipped_heads
from tokenswift.errors import TokenswiftError

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
RECORD = "training.json"


@attrs.frozen(kw_only=True)
class TrainConfig:
    steps: int = attrs.field(default=600, validator=attrs.validators.ge(1))
    seq_len: int = attrs.field(default=512, validator=attrs.validators.ge(8))
    # Positions per window that the loss is taken on (0: all). The LM-head products of
    # the heads cost more than the base forward, so a subset trains more per second.
    positions: int = attrs.field(default=128, validator=attrs.validators.ge(0))
    batch: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    lr: float = attrs.field(default=5e-3, validator=attrs.validators.gt(0))
    weight_decay: float = 0.1
    warmup: int = attrs.field(default=30, validator=attrs.validators.ge(0))
    num_heads: int = attrs.field(default=3, validator=attrs.validators.ge(1))
    seed: int = 0
    checkpoint_every: int = attrs.field(default=50, validator=attrs.validators.ge(1))
    eval_windows: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    holdout: tuple[str, ...] = ("wuthering_heights",)
    # Start from trained heads (a train-heads directory, or "shipped": the ones shipped
    # for the model) instead of fresh ones; their number of heads is kept.
    init: str | None = None


@attrs.frozen(kw_only=True)
class Corpus:
    """train: [N] token ids of the training books, concatenated; held_out likewise."""

    train: torch.Tensor
    held_out: torch.Tensor
    train_ids: tuple[str, ...]
    held_out_ids: tuple[str, ...]


def read_corpus(path: str | os.PathLike, tokenizer, holdout: tuple[str, ...]) -> Corpus:
    """Tokenize every book (of a JSON Lines file, or of every ``*.jsonl`` file in a
    directory: a self-distillation corpus's shards, :mod:`tokenswift.tools.self_distill`);
    the ones whose ``id`` is in ``holdout`` go to ``held_out`` (when none matches, the
    last 5% of the text is held out instead)."""
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise TokenswiftError(f"training data not found: {path} (a JSON Lines file, or a directory of them)")
    train, held, train_ids, held_ids = [], [], [], []
    for file in files:
        _read_books(file, tokenizer, holdout, (train, held, train_ids, held_ids))
    if not train:
        raise TokenswiftError(f"{path}: no training text left after holding out {list(holdout)}")
    train_tokens = torch.cat(train)
    if held:
        held_tokens = torch.cat(held)
    else:
        cut = int(len(train_tokens) * 0.95)
        train_tokens, held_tokens = train_tokens[:cut], train_tokens[cut:]
        held_ids = ["last 5%"]
    return Corpus(train=train_tokens, held_out=held_tokens, train_ids=tuple(train_ids), held_out_ids=tuple(held_ids))


def _read_books(path: Path, tokenizer, holdout: tuple[str, ...], into) -> None:
    train, held, train_ids, held_ids = into
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text = record["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise TokenswiftError(f"{path}:{number}: expected a JSON object with a 'text' key") from None
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            name = str(record.get("id", number))
            (held if name in holdout else train).append(torch.tensor(ids, dtype=torch.long))
            (held_ids if name in holdout else train_ids).append(name)


def sample_windows(tokens: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[count, length] random windows of ``tokens``."""
    starts = torch.randint(0, len(tokens) - length, (count,), generator=generator)
    return torch.stack([tokens[s : s + length] for s in starts.tolist()])


@torch.no_grad()
def base_hidden(model, windows: torch.Tensor) -> torch.Tensor:
    """[B, T] ids -> [B, T, hidden] final-norm hidden states of the frozen model."""
    return model.get_decoder()(input_ids=windows, use_cache=False).last_hidden_state


def head_losses(heads: DraftHeads, lm_head, hidden: torch.Tensor, windows: torch.Tensor, positions: torch.Tensor):
    """Per-head cross-entropy and top-1 accuracy at ``positions`` ([P], each below
    T - num_heads - 1). Head i (0-based) at position t is scored against token t + i + 2."""
    outputs = heads(hidden[:, positions].to(next(heads.parameters()).dtype))  # [B, P, k, H]
    losses, accuracies = [], []
    for i in range(heads.num_heads):
        logits = lm_head(outputs[:, :, i].to(lm_head.weight.dtype)).float()  # [B, P, V]
        target = windows[:, positions + i + 2]
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)))
        accuracies.append((logits.argmax(-1) == target).float().mean())
    return torch.stack(losses), torch.stack(accuracies)


@torch.no_grad()
def evaluate(heads: DraftHeads, model, tokens: torch.Tensor, config: TrainConfig) -> dict[str, list[float]]:
    """Per-head top-1 / top-3 accuracy on held-out windows."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    top1 = torch.zeros(heads.num_heads)
    top3 = torch.zeros(heads.num_heads)
    base1 = 0.0
    batches = math.ceil(config.eval_windows / config.batch)
    device = next(model.parameters()).device
    for _ in range(batches):
        windows = sample_windows(tokens, config.batch, config.seq_len, generator).to(device)
        hidden = base_hidden(model, windows)
        outputs = heads(hidden.to(next(heads.parameters()).dtype)).to(hidden.dtype)
        base1 += float((model.get_output_embeddings()(hidden[:, :-1]).argmax(-1) == windows[:, 1:]).float().mean())
        for i in range(heads.num_heads):
            shift = i + 2
            logits = model.get_output_embeddings()(outputs[:, :-shift, i])
            target = windows[:, shift:, None]
            best = logits.topk(3, dim=-1).indices
            top1[i] += float((best[..., :1] == target).any(-1).float().mean())
            top3[i] += float((best == target).any(-1).float().mean())
    return {
        "lm_head_top1": round(base1 / batches, 4),
        "top1": [round(float(v) / batches, 4) for v in top1],
        "top3": [round(float(v) / batches, 4) for v in top3],
    }


def lr_factor(step: int, config) -> float:
    """Linear warmup over ``config.warmup`` steps, then cosine decay to 0 at ``config.steps``."""
    if step < config.warmup:
        return (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train_heads(
    model,
    corpus: Corpus,
    out_dir: str | os.PathLike,
    config: TrainConfig,
    *,
    resume: bool = False,
    progress: Callable[[int, dict], None] | None = None,
) -> dict:
    """Train heads for ``model`` and save them (with ``training.json``) in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for param in model.parameters():
        param.requires_grad_(False)
    model.eval()
    if config.init is None:
        heads = DraftHeads.for_model(model, config.num_heads).float()  # float32 master weights
    else:
        source = find_shipped_heads(model) if config.init == "shipped" else Path(config.init)
        if source is None:
            raise TokenswiftError("--init shipped: no heads are shipped for this model")
        heads = DraftHeads.from_pretrained(source, model).float()
        if heads.num_heads != config.num_heads:
            raise TokenswiftError(f"--init {config.init}: {heads.num_heads} heads there, --num-heads {config.num_heads}")
    heads.train()
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
    generator = torch.Generator().manual_seed(config.seed)
    checkpoint = TrainingState("heads", heads, optimizer, scheduler, generator)
    start_step, elapsed = 0, 0.0
    checkpoint_path = out_dir / CHECKPOINT
    if resume:
        if not checkpoint_path.is_file():
            raise TokenswiftError(f"--resume: no checkpoint at {checkpoint_path}")
        start_step, elapsed = checkpoint.load(checkpoint_path)

    lm_head = model.get_output_embeddings()
    started = time.perf_counter() - elapsed
    device = next(model.parameters()).device
    for step in range(start_step, config.steps):
        windows = sample_windows(corpus.train, config.batch, config.seq_len, generator).to(device)
        hidden = base_hidden(model, windows)
        usable = config.seq_len - config.num_heads - 1
        if config.positions and config.positions < usable:
            positions = torch.randperm(usable, generator=generator)[: config.positions].sort().values
        else:
            positions = torch.arange(usable)
        losses, accuracies = head_losses(heads, lm_head, hidden, windows, positions.to(device))
        optimizer.zero_grad(set_to_none=True)
        losses.mean().backward()
        optimizer.step()
        scheduler.step()
        if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
            checkpoint.save(checkpoint_path, step + 1, time.perf_counter() - started)
        if progress is not None:
            progress(step + 1, {"loss": losses.tolist(), "acc": accuracies.tolist()})
    wall = time.perf_counter() - started
    heads.eval()
    metrics = evaluate(heads, model, corpus.held_out, config)
    heads.save_pretrained(out_dir)
    record = {
        "config": attrs.asdict(config),
        "train_books": list(corpus.train_ids),
        "held_out_books": list(corpus.held_out_ids),
        "train_tokens": int(len(corpus.train)),
        "tokens_seen": config.steps * config.batch * config.seq_len,
        "wall_seconds": round(wall, 1),
        "held_out_accuracy": metrics,
    }
    (out_dir / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


@attrs.define(eq=False)
class TrainingState:
    """What a training checkpoint holds: the trained module (under ``key`` in the file),
    the optimizer, the schedule and the batch generator, plus the step reached and the
    seconds spent so far."""

    key: str
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    generator: torch.Generator

    def save(self, path: Path, step: int, elapsed: float) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save(
            {
                self.key: self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "generator": self.generator.get_state(),
                "step": step,
                "elapsed": elapsed,
            },
            tmp,
        )
        os.replace(tmp, path)  # atomic: an interrupted save leaves the previous checkpoint

    def load(self, path: Path) -> tuple[int, float]:
        """Restore everything from ``path``; returns (step, elapsed seconds)."""
        state = torch.load(path, weights_only=True, map_location="cpu")  # portable across devices
        self.module.load_state_dict(state[self.key])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
        logger.info("resuming at step %d", int(state["step"]))
        return int(state["step"]), float(state["elapsed"])
