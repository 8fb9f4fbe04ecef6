"""Training draft heads on a frozen base model.

Head i learns, with cross-entropy, the token i+1 places after the LM head's: from the
final hidden state of token t it predicts token t+i+1. The base model (and its LM
head, shared by the heads) stays frozen. TokenSwift's recipe: AdamW, lr 5e-3, weight
decay 0.1, cosine schedule with warmup.

Text comes from a JSON Lines file (one object per line with a ``text`` key, as
``shared/data/pg_books.jsonl``); whole books named by ``holdout`` are kept out of
training and used for the final per-head top-1/top-3 accuracy.

**Self-distillation.** Given a :class:`FeatureCache` (the target's own generations
with their cached final-norm features and greedy next tokens, made by
``train-drafter``'s first phase), the heads learn what the *target* would write, not
the book: head i at position t takes ``soft_weight`` times the cross-entropy from the
target's next-token distribution at position t + i + 1 (its LM head on the cached
feature, after the contextual penalty: what verification draws from) plus
``hard_weight`` times the cross-entropy on the target's greedy token there, and no
base forward runs per step.
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
    # Self-distillation only (a FeatureCache given): the loss's weights, and the
    # contextual penalty of the target distribution the soft loss compares with.
    soft_weight: float = attrs.field(default=1.0, validator=attrs.validators.ge(0))
    hard_weight: float = attrs.field(default=0.5, validator=attrs.validators.ge(0))
    penalty: float = attrs.field(default=1.2, validator=attrs.validators.ge(1.0))


@attrs.frozen(kw_only=True)
class FeatureCache:
    """The target's cached windows of its own text: windows [N, T] ids, features
    [N, T, hidden] (its final-norm hidden states), greedy [N, T] (its greedy next token
    after each position, contextual penalty applied)."""

    windows: torch.Tensor
    features: torch.Tensor
    greedy: torch.Tensor

    def __attrs_post_init__(self) -> None:
        n, t = self.windows.shape
        if self.features.shape[:2] != (n, t) or self.greedy.shape != (n, t):
            raise TokenswiftError(
                f"feature cache shapes disagree: windows {tuple(self.windows.shape)}, "
                f"features {tuple(self.features.shape)}, greedy {tuple(self.greedy.shape)}"
            )


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


@torch.no_grad()
def base_features(model, windows: torch.Tensor, layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] ids -> the frozen model's final-norm hidden states [B, T, H] and the
    outputs of decoder ``layers`` (transformers' ``hidden_states[k]``) side by side,
    [B, T, len(layers) * H] (None without layers): the parts of
    :func:`tokenswift.model.runner.features`."""
    if not layers:
        return base_hidden(model, windows), None
    out = model.get_decoder()(input_ids=windows, use_cache=False, output_hidden_states=True)
    return out.last_hidden_state, torch.cat([out.hidden_states[k] for k in layers], -1)


# -- the target's processed next-token distribution (shared with drafter training) --


def penalize(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """The contextual penalty on ``logits`` where ``seen`` (same shape, bool) is True."""
    if seen is None or penalty == 1.0:
        return logits
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def first_seen(tokens: torch.Tensor, draft_index: torch.Tensor, size: int) -> torch.Tensor:
    """[B, T] ids -> [B, size] long: the first index at which each draft-vocabulary row
    occurs (T where it does not; ids outside the vocabulary map to ``draft_index``'s
    extra row, dropped). Row v was seen by position t iff ``first[b, v] <= t``."""
    b, t = tokens.shape
    first = torch.full((b, size + 1), t, dtype=torch.long, device=tokens.device)
    index = torch.arange(t, device=tokens.device).expand(b, t)
    return first.scatter_reduce(1, draft_index[tokens], index, reduce="amin")[:, :size]


def greedy_tokens(window: torch.Tensor, logits: torch.Tensor, penalty: float) -> torch.Tensor:
    """window: [T] ids; logits: [T, V] the target's at each position -> [T] its greedy
    next token there, after the contextual penalty over window[: t + 1]."""
    t, vocab = logits.shape
    first = torch.full((vocab,), t, dtype=torch.long, device=logits.device)
    first.scatter_reduce_(0, window.to(logits.device), torch.arange(t, device=logits.device), reduce="amin")
    seen = first[None, :] <= torch.arange(t, device=logits.device)[:, None]  # [T, V]
    return penalize(logits.float(), seen, penalty).argmax(-1)


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


def distilled_head_losses(
    heads: DraftHeads, lm_head, hidden: torch.Tensor, windows: torch.Tensor, greedy: torch.Tensor,
    positions: torch.Tensor, config: TrainConfig,
):
    """Per-head loss and top-1 agreement against the target itself. hidden: [B, T, H]
    the target's cached features; windows: [B, T] its text; greedy: [B, T] its greedy
    next token after each position; positions: [P] (each below T - num_heads - 1).
    Head i (0-based) at position t is compared with the target at position t + i + 1:
    its distribution there (after the contextual penalty over the window so far) and
    its greedy token."""
    vocab = lm_head.weight.shape[0]
    seen = first_seen(windows, torch.arange(vocab, device=windows.device), vocab) if config.penalty != 1.0 else None
    outputs = heads(hidden[:, positions].to(next(heads.parameters()).dtype))  # [B, P, k, H]
    losses, agreement = [], []
    for i in range(heads.num_heads):
        at = positions + i + 1
        with torch.no_grad():
            context = None if seen is None else seen[:, None, :] <= at[None, :, None]  # [B, P, V]
            target = penalize(lm_head(hidden[:, at].to(lm_head.weight.dtype)).float(), context, config.penalty)
            target = target.softmax(-1)
            label = greedy[:, at]  # [B, P]
        log_q = lm_head(outputs[:, :, i].to(lm_head.weight.dtype)).float().log_softmax(-1)  # [B, P, V]
        soft = -(target * log_q).sum(-1).mean()
        hard = -log_q.gather(-1, label[..., None]).mean()
        losses.append(config.soft_weight * soft + config.hard_weight * hard)
        agreement.append((log_q.argmax(-1) == label).float().mean())
    return torch.stack(losses), torch.stack(agreement)


@torch.no_grad()
def evaluate(heads: DraftHeads, model, tokens: torch.Tensor, config: TrainConfig) -> dict[str, list[float]]:
    """Per-head top-1 / top-3 accuracy on held-out windows against the text
    (``top1``/``top3``: head i at t against token t + i + 2) and, as greedy decoding
    accepts it, against the target's own greedy token there given the text so far
    (``greedy_top1``/``greedy_top3``; contextual penalty ``config.penalty``)."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    top1 = torch.zeros(heads.num_heads)
    top3 = torch.zeros(heads.num_heads)
    greedy1 = torch.zeros(heads.num_heads)
    greedy3 = torch.zeros(heads.num_heads)
    base1 = 0.0
    batches = math.ceil(config.eval_windows / config.batch)
    device = next(model.parameters()).device
    lm_head = model.get_output_embeddings()
    for _ in range(batches):
        windows = sample_windows(tokens, config.batch, config.seq_len, generator).to(device)
        hidden = base_hidden(model, windows)
        outputs = heads(hidden.to(next(heads.parameters()).dtype)).to(hidden.dtype)
        full = lm_head(hidden)
        base1 += float((full[:, :-1].argmax(-1) == windows[:, 1:]).float().mean())
        greedy = torch.stack([greedy_tokens(w, row, config.penalty) for w, row in zip(windows, full)])  # [B, T]
        del full
        for i in range(heads.num_heads):
            shift = i + 2
            best = lm_head(outputs[:, :-shift, i]).topk(3, dim=-1).indices
            for target, one, three in ((windows[:, shift:], top1, top3), (greedy[:, shift - 1 : -1], greedy1, greedy3)):
                one[i] += float((best[..., 0] == target).float().mean())
                three[i] += float((best == target[..., None]).any(-1).float().mean())

    def per_head(values):
        return [round(float(v) / batches, 4) for v in values]

    return {
        "lm_head_top1": round(base1 / batches, 4),
        "top1": per_head(top1),
        "top3": per_head(top3),
        "greedy_top1": per_head(greedy1),
        "greedy_top3": per_head(greedy3),
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
    cache: FeatureCache | None = None,
) -> dict:
    """Train heads for ``model`` and save them (with ``training.json``) in ``out_dir``:
    on ``corpus.train``'s text, or, given a ``cache`` of the target's own generations,
    against the target itself (:func:`distilled_head_losses`). Evaluated on
    ``corpus.held_out``."""
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
    seq_len = config.seq_len if cache is None else cache.windows.shape[1]
    usable = seq_len - config.num_heads - 1
    if usable < 1:
        raise TokenswiftError(f"windows of {seq_len} tokens are too short for {config.num_heads} heads")
    for step in range(start_step, config.steps):
        if cache is None:
            windows = sample_windows(corpus.train, config.batch, config.seq_len, generator).to(device)
            hidden = base_hidden(model, windows)
        else:
            rows = torch.randint(0, len(cache.windows), (config.batch,), generator=generator)
            windows = cache.windows[rows].to(device)
            hidden = cache.features[rows].to(device, lm_head.weight.dtype)
        if config.positions and config.positions < usable:
            positions = torch.randperm(usable, generator=generator)[: config.positions].sort().values.to(device)
        else:
            positions = torch.arange(usable, device=device)
        if cache is None:
            losses, accuracies = head_losses(heads, lm_head, hidden, windows, positions)
        else:
            losses, accuracies = distilled_head_losses(
                heads, lm_head, hidden, windows, cache.greedy[rows].to(device), positions, config
            )
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
        "tokens_seen": config.steps * config.batch * seq_len,
        "trained_on": "text" if cache is None else f"the target's own: {cache.windows.numel():,} cached positions",
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
