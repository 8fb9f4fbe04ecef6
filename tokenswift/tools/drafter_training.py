"""Training the ``eagle`` drafter's network on a frozen target model.

Two phases, both resumable:

1. **Features.** The frozen target runs once over ``windows`` random training windows
   of ``seq_len`` tokens; their final-norm hidden states are cached to disk (bfloat16,
   in chunks of :data:`CHUNK` windows, ``features/chunk-NNNN.safetensors``), and with
   ``fused_layers`` (EAGLE-3's fused features) the outputs of those decoder layers
   beside them (``layers``). On a CPU this is the expensive part, and every epoch
   reuses it.
   Beside them, ``targets-NNNN.safetensors`` holds the target's greedy next token at
   every position (its whole-vocabulary argmax after the contextual penalty).
2. **The network**, EAGLE-3's way by default: ``depth`` draft levels unrolled as the
   drafter runs them, each fed the previous level's own output ("training-time
   test"), level k weighted ``decay ** (k - 1)``. Per level: ``cls_weight`` times the
   soft cross-entropy from the target's processed next-token distribution (its LM head
   on the true feature, after the penalty, over the draft vocabulary) to the draft's,
   plus ``hard_weight`` times the cross-entropy on the target's greedy token; positions
   whose greedy token lies outside the draft vocabulary are masked out of both (the
   draft can never propose it). ``feature_weight`` > 0 adds EAGLE-1/2's smooth-L1
   regression onto the true next feature (EAGLE-3 dropped it: it ties the layer to
   features it cannot reproduce). The input features of level 1 get uniform noise
   (``noise``). AdamW with a cosine schedule; bfloat16 autocast where the CPU has
   native bfloat16 (``autocast``).

The held-out books give, per draft level, how often the draft's top-1 (and top-3) is
the target's own top-1 there (on the true text): the acceptance rate of a greedy chain.
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
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tokenswift.drafters.feature_net import FeatureNet, draft_vocabulary, find_shipped_drafter
from tokenswift.errors import TokenswiftError
from tokenswift.machine import native_bfloat16
from tokenswift.model.configs import text_config
from tokenswift.tools.training import (
    Corpus, FeatureCache, TrainingState, base_features, first_seen, greedy_tokens, lr_factor, penalize, sample_windows,
)

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
RECORD = "training.json"
CHUNK = 8  # windows per feature file


@attrs.frozen(kw_only=True)
class DrafterTrainConfig:
    windows: int = attrs.field(default=512, validator=attrs.validators.ge(1))
    seq_len: int = attrs.field(default=512, validator=attrs.validators.ge(8))
    steps: int = attrs.field(default=300, validator=attrs.validators.ge(1))
    batch: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    depth: int = attrs.field(default=5, validator=attrs.validators.ge(1))
    # Positions per window whose next-token loss is taken (0: all): the draft-vocabulary
    # LM head costs more than the layer, the feature loss covers every position anyway.
    positions: int = attrs.field(default=128, validator=attrs.validators.ge(0))
    draft_vocab: int = attrs.field(default=8192, validator=attrs.validators.ge(2))
    lr: float = attrs.field(default=1e-3, validator=attrs.validators.gt(0))
    weight_decay: float = 0.0
    warmup: int = attrs.field(default=20, validator=attrs.validators.ge(0))
    noise: float = attrs.field(default=0.1, validator=attrs.validators.ge(0))
    cls_weight: float = attrs.field(default=1.0, validator=attrs.validators.ge(0))
    hard_weight: float = attrs.field(default=0.5, validator=attrs.validators.ge(0))
    feature_weight: float = attrs.field(default=0.0, validator=attrs.validators.ge(0))
    decay: float = attrs.field(default=0.8, validator=[attrs.validators.gt(0), attrs.validators.le(1)])
    # bfloat16 autocast of the network's products: "auto" (where the CPU has native
    # bfloat16, and on CUDA), "on", "off".
    autocast: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "on", "off")))
    # The next-token loss compares distributions after the presets' contextual penalty
    # (each token seen earlier in the window: positive logits / penalty, negative x
    # penalty), since verification draws from those; 1.0: the raw distributions.
    penalty: float = attrs.field(default=1.2, validator=attrs.validators.ge(1.0))
    seed: int = 0
    checkpoint_every: int = attrs.field(default=25, validator=attrs.validators.ge(1))
    eval_windows: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    eval_depth: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    holdout: tuple[str, ...] = ("wuthering_heights",)
    # Start from a trained network (a directory from train-drafter, or "shipped": the one
    # shipped for the model) instead of a fresh one; its draft vocabulary is kept.
    init: str | None = None
    # Inner decoder layers fused with the final-norm state (EAGLE-3; transformers'
    # hidden_states numbering); (): those of --init, or none.
    fused_layers: tuple[int, ...] = attrs.field(default=(), converter=tuple)


# -- phase 1: the target's features ---------------------------------------------------


def cache_features(
    model,
    corpus: Corpus,
    directory: str | os.PathLike,
    config: DrafterTrainConfig,
    progress: Callable[[int], None] | None = None,
    layers: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The cached windows [windows, seq_len], final-norm features [windows, seq_len, H]
    and, with ``layers``, those decoder layers' outputs [windows, seq_len, len(layers) * H]
    (bfloat16; else None), computing the chunks that are missing. Chunk i holds the
    windows drawn with seed ``config.seed * 1000 + i``, so an interrupted run continues
    exactly; a chunk made without the layers asked for is computed again."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    chunks = math.ceil(config.windows / CHUNK)
    tokens, features, states = [], [], []
    for i in range(chunks):
        path = directory / f"chunk-{i:04d}.safetensors"
        count = min(CHUNK, config.windows - i * CHUNK)
        stored = _read_chunk(path, count, config.seq_len, layers)
        if stored is None:
            generator = torch.Generator().manual_seed(config.seed * 1000 + i)
            windows = sample_windows(corpus.train, count, config.seq_len, generator)
            hidden, inner = base_features(model, windows.to(device), layers)
            stored = (windows, hidden.to("cpu", torch.bfloat16), None if inner is None else inner.to("cpu", torch.bfloat16))
            tensors = {"tokens": windows.contiguous(), "features": stored[1].contiguous()}
            if inner is not None:
                tensors["layers"] = stored[2].contiguous()
            tmp = path.with_suffix(".tmp")
            save_file(tensors, tmp, metadata={"layers": json.dumps(list(layers))})
            os.replace(tmp, path)  # atomic: a killed run never leaves half a chunk
        tokens.append(stored[0])
        features.append(stored[1])
        states.append(stored[2])
        if progress is not None:
            progress(i + 1)
    return torch.cat(tokens), torch.cat(features), torch.cat(states) if layers else None


def _read_chunk(
    path: Path, count: int, seq_len: int, layers: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """A stored chunk (tokens, features, layers' outputs or None); None where it must
    be computed (missing, unreadable, or without the ``layers`` asked for)."""
    if not path.is_file():
        return None
    try:
        data = load_file(path)
        with safe_open(path, "pt") as handle:
            stored_layers = tuple(json.loads((handle.metadata() or {}).get("layers", "[]")))
    except Exception:  # a foreign or damaged file: compute it again
        logger.warning("recomputing the unreadable feature chunk %s", path)
        return None
    if tuple(data["tokens"].shape) != (count, seq_len):
        raise TokenswiftError(f"{path} holds windows of another shape {tuple(data['tokens'].shape)}; use a new --features folder")
    if not layers:
        return data["tokens"], data["features"], None
    if stored_layers != layers:
        logger.info("%s holds layers %s, not %s: computing it again", path.name, list(stored_layers), list(layers))
        return None
    return data["tokens"], data["features"], data["layers"]


def cache_targets(
    model, windows: torch.Tensor, features: torch.Tensor, directory: str | os.PathLike, penalty: float
) -> torch.Tensor:
    """[windows, seq_len] long: the target's greedy next token after every position (the
    whole-vocabulary argmax of its logits, after the contextual penalty over the window
    so far), computing the chunks that are missing (``targets-NNNN.safetensors``)."""
    directory = Path(directory)
    lm_head = model.get_output_embeddings()
    dtype = torch.bfloat16 if native_bfloat16(lm_head.weight.device) else torch.float32
    weight = lm_head.weight.detach().to(dtype)
    out = []
    for i in range(math.ceil(len(windows) / CHUNK)):
        path = directory / f"targets-{i:04d}.safetensors"
        rows = slice(i * CHUNK, (i + 1) * CHUNK)
        stored = load_file(path)["greedy"] if path.is_file() else None
        if stored is None or tuple(stored.shape) != tuple(windows[rows].shape):
            stored = torch.stack([
                greedy_tokens(window, hidden.to(weight.device, dtype) @ weight.T, penalty)
                for window, hidden in zip(windows[rows], features[rows])
            ]).cpu()
            tmp = path.with_suffix(".tmp")
            save_file({"greedy": stored.contiguous()}, tmp)
            os.replace(tmp, path)
        out.append(stored)
    return torch.cat(out)


def load_feature_cache(model, directory: str | os.PathLike, penalty: float) -> FeatureCache:
    """Every complete chunk of a feature folder made by :func:`cache_features`, with the
    target's greedy tokens (:func:`cache_targets`, computed where missing), e.g. to
    train draft heads on the target's own text (``train-heads --features``)."""
    directory = Path(directory)
    paths = sorted(directory.glob("chunk-*.safetensors"))
    if not paths:
        raise TokenswiftError(
            f"no cached features in {directory} (make them with `tokenswift train-drafter --features {directory}`)"
        )
    tokens, features = [], []
    for path in paths:
        try:
            data = load_file(path)
        except Exception as exc:
            raise TokenswiftError(f"cannot read the feature chunk {path}: {exc}") from None
        tokens.append(data["tokens"])
        features.append(data["features"])
    windows, features = torch.cat(tokens), torch.cat(features)
    hidden = model.get_output_embeddings().weight.shape[1]
    if features.shape[-1] != hidden:
        raise TokenswiftError(f"{directory} holds features of size {features.shape[-1]}, this model's are {hidden}")
    greedy = cache_targets(model, windows, features, directory, penalty)
    return FeatureCache(windows=windows, features=features, greedy=greedy)


# -- phase 2: the network -------------------------------------------------------------


@torch.no_grad()
def evaluate(net: FeatureNet, model, tokens: torch.Tensor, config: DrafterTrainConfig) -> dict:
    """Per level on held-out windows, how often the draft's top-1 / top-3 (draft
    vocabulary) contains the target's top-1 (whole vocabulary): ``top1``/``top3`` of its
    raw logits, ``greedy_top1`` of its logits after the contextual penalty (the token
    greedy decoding emits; the draft ranked after the same penalty, as the drafter
    ranks); and the share of the target's top-1 that the draft vocabulary holds."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    device = next(model.parameters()).device
    lm_head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    head = lm_head.weight.detach()[net.draft_tokens].float()
    vocab_size = lm_head.weight.shape[0]
    draft_index = torch.full((vocab_size,), len(head), dtype=torch.long, device=device)
    draft_index[net.draft_tokens] = torch.arange(len(head), device=device)
    top1 = torch.zeros(config.eval_depth)
    top3 = torch.zeros(config.eval_depth)
    greedy_top1 = torch.zeros(config.eval_depth)
    covered = 0.0
    batches = math.ceil(config.eval_windows / config.batch)
    for _ in range(batches):
        windows = sample_windows(tokens, config.batch, config.seq_len, generator).to(device)
        features, inner = base_features(model, windows, net.config.fused_layers)
        features = features.float()
        inputs = features if inner is None else torch.cat([inner.float(), features], -1)
        outputs = net.unrolled(embed, inputs, windows, config.eval_depth)
        t = windows.shape[1]
        usable = t - config.eval_depth
        positions = torch.arange(usable, device=device)
        seen = first_seen(windows, draft_index, len(head)) if config.penalty != 1.0 else None
        full = lm_head(features.to(lm_head.weight.dtype)).float()  # [B, T, V]
        raw_all = full.argmax(-1)
        greedy_all = torch.stack([greedy_tokens(w, row, config.penalty) for w, row in zip(windows, full)])
        del full
        for k, out in enumerate(outputs, start=1):
            target = raw_all[:, k : k + usable]
            greedy = greedy_all[:, k : k + usable]
            draft_logits = out[:, :usable] @ head.T
            best = net.draft_tokens[draft_logits.topk(3, dim=-1).indices]  # [B, usable, 3]
            top1[k - 1] += float((best[..., 0] == target).float().mean())
            top3[k - 1] += float((best == target[..., None]).any(-1).float().mean())
            context = None if seen is None else seen[:, None, :] <= (positions + k)[None, :, None]
            ranked = net.draft_tokens[penalize(draft_logits, context, config.penalty).argmax(-1)]
            greedy_top1[k - 1] += float((ranked == greedy).float().mean())
            if k == 1:
                covered += float(torch.isin(target, net.draft_tokens).float().mean())
    return {
        "top1": [round(float(v) / batches, 4) for v in top1],
        "top3": [round(float(v) / batches, 4) for v in top3],
        "greedy_top1": [round(float(v) / batches, 4) for v in greedy_top1],
        "target_top1_in_draft_vocab": round(covered / batches, 4),
    }


def train_drafter(
    model,
    corpus: Corpus,
    out_dir: str | os.PathLike,
    config: DrafterTrainConfig,
    *,
    features_dir: str | os.PathLike | None = None,
    resume: bool = False,
    feature_progress: Callable[[int], None] | None = None,
    progress: Callable[[int, dict], None] | None = None,
) -> dict:
    """Cache the target's features, train the network, save it (with ``training.json``)
    in ``out_dir``; returns the record."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for param in model.parameters():
        param.requires_grad_(False)
    model.eval()
    checkpoint_path = out_dir / CHECKPOINT
    if resume and not checkpoint_path.is_file():
        raise TokenswiftError(f"--resume: no checkpoint at {checkpoint_path}")
    vocab_size = model.get_output_embeddings().weight.shape[0]
    if config.init is None:
        draft_tokens, coverage = draft_vocabulary(corpus.train, vocab_size, config.draft_vocab)
        net = FeatureNet.for_model(model, draft_tokens).float()
        net.initialise(seed=config.seed)
    else:
        source = find_shipped_drafter(model) if config.init == "shipped" else Path(config.init)
        if source is None:
            raise TokenswiftError("--init shipped: no drafter is shipped for this model")
        net = FeatureNet.from_pretrained(source, model).float()
        counts = torch.bincount(corpus.train, minlength=vocab_size)
        coverage = float(counts[net.draft_tokens].sum() / counts.sum())
    if config.fused_layers:
        count = text_config(model).num_hidden_layers
        if not all(1 <= k < count for k in config.fused_layers):
            raise TokenswiftError(f"fused layers {list(config.fused_layers)}: this model's inner layers are 1..{count - 1}")
        try:
            net = net.with_fused_layers(config.fused_layers)
        except ValueError as exc:
            raise TokenswiftError(f"--init {config.init}: {exc}") from None
    layers = net.config.fused_layers
    started_features = time.perf_counter()
    windows, features, inner = cache_features(
        model, corpus, features_dir or out_dir / "features", config, feature_progress, layers
    )
    feature_seconds = time.perf_counter() - started_features
    net.train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
    generator = torch.Generator().manual_seed(config.seed)
    checkpoint = TrainingState("net", net, optimizer, scheduler, generator)
    start_step, elapsed = 0, 0.0
    if resume:
        start_step, elapsed = checkpoint.load(checkpoint_path)

    device = next(model.parameters()).device
    net.to(device)
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings().weight.detach()[net.draft_tokens].float()
    draft_index = torch.full((vocab_size,), len(head), dtype=torch.long, device=device)
    draft_index[net.draft_tokens] = torch.arange(len(head), device=device)
    greedy = cache_targets(model, windows, features, features_dir or out_dir / "features", config.penalty)
    level_weights = torch.tensor([config.decay**k for k in range(config.depth)], device=device)
    autocast = config.autocast == "on" or (config.autocast == "auto" and native_bfloat16(device))
    started = time.perf_counter() - elapsed
    usable = config.seq_len - config.depth
    for step in range(start_step, config.steps):
        batch = torch.randint(0, len(windows), (config.batch,), generator=generator)
        tokens = windows[batch].to(device)
        truth = features[batch].to(device, torch.float32)
        inputs = truth if inner is None else torch.cat([inner[batch].to(device, torch.float32), truth], -1)
        noisy = inputs + (torch.rand(inputs.shape, generator=generator).to(device) * 2 - 1) * config.noise
        if config.positions and config.positions < usable:
            positions = torch.randperm(usable, generator=generator)[: config.positions].sort().values.to(device)
        else:
            positions = torch.arange(usable, device=device)
        seen = first_seen(tokens, draft_index, len(head)) if config.penalty != 1.0 else None
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            feature_loss, soft_loss, hard_loss, agreement = level_losses(
                net, embed, head, noisy, truth, tokens, config.depth, positions, seen, config.penalty,
                greedy[batch].to(device), draft_index,
            )
        per_level = config.feature_weight * feature_loss + config.cls_weight * soft_loss + config.hard_weight * hard_loss
        loss = (level_weights * per_level).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        optimizer.step()
        scheduler.step()
        if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
            checkpoint.save(checkpoint_path, step + 1, time.perf_counter() - started)
        if progress is not None:
            progress(step + 1, {
                "feature": feature_loss.tolist(), "token": soft_loss.tolist(), "hard": hard_loss.tolist(),
                "agree": agreement.tolist(),
            })
    wall = time.perf_counter() - started
    net.eval()
    metrics = evaluate(net, model, corpus.held_out, config)
    net.to("cpu").save_pretrained(out_dir)
    record = {
        "config": attrs.asdict(config),
        "train_books": list(corpus.train_ids),
        "held_out_books": list(corpus.held_out_ids),
        "train_tokens": int(len(corpus.train)),
        "feature_tokens": int(windows.numel()),
        "feature_seconds": round(feature_seconds, 1),
        "draft_vocab_coverage": round(coverage, 4),
        "positions_seen": config.steps * config.batch * config.seq_len,
        "wall_seconds": round(wall, 1),
        "held_out_agreement": metrics,
    }
    (out_dir / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def level_losses(net, embed, head, inputs, truth, tokens, depth, positions, seen=None, penalty=1.0, greedy=None, draft_index=None):
    """Per level: feature loss, soft next-token loss, hard (greedy-token) loss, top-1
    agreement with the target's greedy token. inputs: [B, T, F] float32 level-1 features
    (the network's ``feature_size``; noise added); truth: [B, T, H] the true final-norm features; head: [V', H] the draft
    vocabulary's LM-head rows; positions: [P] indices whose next-token losses are taken
    (each < T - depth); seen: [B, V'] long, where each draft-vocabulary token first
    occurs (:func:`first_seen`, for the penalty); greedy: [B, T] the target's greedy
    next token at each position (:func:`cache_targets`; None: the argmax within the draft
    vocabulary); draft_index: [vocab] target id -> draft row (V' outside it). Positions
    whose greedy token is outside the draft vocabulary are masked out of the token losses."""
    outputs = net.unrolled(embed, inputs, tokens, depth)
    t = truth.shape[1]
    size = head.shape[0]
    feature_losses, soft_losses, hard_losses, agreement = [], [], [], []
    for k, out in enumerate(outputs, start=1):
        target_features = truth[:, k:]
        feature_losses.append(F.smooth_l1_loss(out[:, : t - k].float(), target_features))
        context = None if seen is None else seen[:, None, :] <= (positions + k)[None, :, None]  # [B, P, V'] at j + k
        with torch.no_grad():
            target_logits = penalize(target_features[:, positions] @ head.T, context, penalty)
            target = target_logits.softmax(-1)
            rows = target_logits.argmax(-1) if greedy is None else draft_index[greedy[:, positions + k]]  # [B, P]
            valid = rows < size
            weight = valid.float() / valid.sum().clamp(min=1)
        logits = penalize((out[:, positions] @ head.T).float(), context, penalty)
        log_q = logits.log_softmax(-1)
        soft_losses.append(-((target * log_q).sum(-1) * weight).sum())
        hard = -log_q.gather(-1, rows.clamp(max=size - 1)[..., None])[..., 0]
        hard_losses.append((hard * weight).sum())
        agreement.append(((logits.argmax(-1) == rows).float() * weight).sum())
    return torch.stack(feature_losses), torch.stack(soft_losses), torch.stack(hard_losses), torch.stack(agreement)
