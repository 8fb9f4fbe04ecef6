"""The ``eagle`` drafter's network: one decoder layer over the target's features.

EAGLE's idea (Li et al., 2024): the target's last hidden state already says most of
what comes next; what it lacks is which token was actually drawn. So the draft layer's
input at position j is the target's final-norm hidden state ``h_j`` (the *feature*
that gave token j+1) fused with the embedding of token j+1:

    x_j     = fc([embed(t_{j+1}), h_j])            # [2H] -> [H]
    out_j   = DecoderLayer(x_j | x_0..x_{j-1})     # one layer of the target's shape
    out_j  ~ h_{j+1}                                # trained to predict the next feature
    logits  = lm_head[draft vocabulary] · out_j     # the target's frozen LM head rows

Deeper drafts feed the layer its own predicted feature: the pair (out_j, t_{j+2}) gives
out_{j+1}, and so on. The layer attends over the pairs of the committed text (true
features) and over the draft's own ancestors.

EAGLE-3's fused features (``fused_layers``): the committed pairs' feature is not the
final-norm state alone but a linear fuse of the outputs of some inner decoder layers
and the final-norm state, ``h_j = reduce([l_j^(a), l_j^(b), ..., h_j^final])``
(``[(L + 1) H] -> [H]``): low and middle layers still hold what the top of the model
has already turned into a next-token guess. Deeper draft levels still feed back the
layer's own output. ``reduce`` starts as "the final-norm block", so a network trained
on final-norm features alone carries over unchanged (:meth:`FeatureNet.with_fused_layers`).

The LM head is restricted to the ``draft_vocab`` most frequent tokens of the training
text (EAGLE-3's reduced vocabulary): for a 135M model the full head is a fifth of the
weights, and reading it at every draft depth would cost more than it earns. Embedding
and LM head are the target's (frozen, not saved). The network runs in float32
whatever the target's dtype: on CPUs without native bfloat16, small bfloat16 products
are several times slower.

Saved as ``model.safetensors`` + ``config.json`` with the target's fingerprint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from tokenswift.drafters.draft_heads import CONFIG_NAME, WEIGHTS_NAME, find_made_for, model_fingerprint, save_module
from tokenswift.errors import ModelLoadError
from tokenswift.model.configs import text_config

FORMAT = "tokenswift-eagle/1"


@attrs.frozen(kw_only=True)
class FeatureNetConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab: int  # rows of the LM head the draft ranks
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    fingerprint: str | None = None
    format: str = FORMAT
    # Inner decoder layers whose outputs are fused with the final-norm state
    # (transformers' ``hidden_states`` numbering); (): the final-norm state alone.
    fused_layers: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    @property
    def feature_size(self) -> int:
        """The width of the target's features the network reads per position."""
        return (len(self.fused_layers) + 1) * self.hidden_size

    @classmethod
    def for_model(cls, model: nn.Module, draft_vocab: int | None = None) -> FeatureNetConfig:
        config = text_config(model)
        heads = config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        vocab = model.get_output_embeddings().weight.shape[0]
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=getattr(config, "intermediate_size", 4 * config.hidden_size),
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=vocab,
            draft_vocab=min(vocab, draft_vocab or vocab),
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-5)),
            fingerprint=model_fingerprint(model),
        )


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (the rotate-half convention). x: [..., T, d];
    positions: [T] (or broadcastable to x's [..., T])."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = positions.to(torch.float32)[..., None] * inv  # [..., T, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class FeatureNet(nn.Module):
    """fc + one pre-norm decoder layer (GQA attention with RoPE, SwiGLU MLP).

    ``draft_tokens``: [draft_vocab] long buffer, the target token ids of the draft LM
    head's rows (most frequent first)."""

    def __init__(self, config: FeatureNetConfig) -> None:
        super().__init__()
        self.config = config
        h, d = config.hidden_size, config.head_dim
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.attention_norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.q = nn.Linear(h, config.num_heads * d, bias=False)
        self.k = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.v = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.o = nn.Linear(config.num_heads * d, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.gate = nn.Linear(h, config.intermediate_size, bias=False)
        self.up = nn.Linear(h, config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, h, bias=False)
        self.register_buffer("draft_tokens", torch.arange(config.draft_vocab), persistent=True)
        self.reduce = nn.Linear(config.feature_size, h, bias=False) if config.fused_layers else None

    # -- the layer ------------------------------------------------------------------

    def feature(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., feature_size] (fused layers' outputs, then the
        final-norm state) -> the feature the layer reads [..., H]."""
        return features if self.reduce is None else self.reduce(features)

    def fuse(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """embeds, features: [..., H] -> the layer's input [..., H]."""
        return self.fc(torch.cat([embeds, features], dim=-1))

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, H] layer inputs -> keys, values [B, kv_heads, T, d] (keys rotated)."""
        b, t, _ = x.shape
        normed = self.attention_norm(x)
        keys = self.k(normed).view(b, t, self.config.num_kv_heads, -1).transpose(1, 2)
        values = self.v(normed).view(b, t, self.config.num_kv_heads, -1).transpose(1, 2)
        return rotate(keys, positions, self.config.rope_theta), values

    def attend(
        self, x: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The layer for inputs x [B, T, H] at ``positions`` [T], attending to ``keys``/
        ``values`` [B, kv_heads, S, d] (their own included) where ``mask`` [T, S] is True.
        Returns the outputs [B, T, H] (the predicted next features)."""
        b, t, _ = x.shape
        config = self.config
        query = self.q(self.attention_norm(x)).view(b, t, config.num_heads, -1).transpose(1, 2)
        query = rotate(query, positions, config.rope_theta)
        # each KV head's query heads read it in place (no repeated copy of the keys)
        attended = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, enable_gqa=config.num_heads != config.num_kv_heads
        )
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, -1))
        normed = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(normed)) * self.up(normed))

    def extend(
        self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, past_keys: torch.Tensor,
        past_values: torch.Tensor, mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One draft forward of T new pairs, as the drafter runs them: ``embeds`` [T, H]
        (the tokens' embeddings) fused with ``features`` [T, H] (the features they follow),
        at ``positions`` [T], attending to ``past_keys``/``past_values`` [1, kv_heads, S, d]
        and to their own keys where ``mask`` [T, S + T] is True. Returns the new pairs'
        keys and values [1, kv_heads, T, d] and their outputs [T, H]."""
        x = self.fuse(embeds, features)[None]  # [1, T, H]
        keys, values = self.keys_values(x, positions)
        out = self.attend(x, positions, torch.cat([past_keys, keys], 2), torch.cat([past_values, values], 2), mask)
        return keys, values, out[0]

    def unrolled(self, embed: nn.Module, features: torch.Tensor, tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Training and evaluation: ``depth`` draft levels over whole windows, as the
        drafter runs them. features: [B, T, feature_size] the target's; tokens: [B, T].

        Level k (1-based) at index j takes (level k-1's output at j, or h_j for k = 1)
        with token j+k, sits at position j+k-1, and attends to level 1's pairs 0..j
        (true features) and to its own ancestors (levels 2..k at index j). Returns per
        level the outputs [B, T, H]; level k's output at j predicts h_{j+k}
        (valid for j + k <= T - 1; later indices see clamped tokens)."""
        b, t, _ = features.shape
        index = torch.arange(t, device=features.device)
        causal = index[None, :] <= index[:, None]  # [T, T]
        diagonal = torch.eye(t, dtype=torch.bool, device=features.device)
        outputs, all_keys, all_values, masks = [], [], [], []
        previous = self.feature(features)
        for k in range(1, depth + 1):
            next_tokens = tokens[:, (index + k).clamp(max=t - 1)]
            x = self.fuse(embed(next_tokens).to(features.dtype), previous)
            positions = index + k - 1
            keys, values = self.keys_values(x, positions)
            all_keys.append(keys)
            all_values.append(values)
            masks.append(causal if k == 1 else diagonal)
            out = self.attend(x, positions, torch.cat(all_keys, 2), torch.cat(all_values, 2), torch.cat(masks, 1))
            outputs.append(out)
            previous = out
        return outputs

    # -- construction ---------------------------------------------------------------

    @classmethod
    def for_model(cls, model: nn.Module, draft_tokens: torch.Tensor | None = None) -> FeatureNet:
        """A fresh network for ``model`` (float32); ``draft_tokens`` [N] chooses the draft
        vocabulary (default: the whole vocabulary)."""
        count = None if draft_tokens is None else int(draft_tokens.numel())
        net = cls(FeatureNetConfig.for_model(model, count))
        if draft_tokens is not None:
            net.draft_tokens.copy_(draft_tokens)
        net.initialise()
        return net

    def initialise(self, seed: int = 0, std: float = 0.02) -> FeatureNet:
        """Seeded small random weights; the residual path starts as the identity of
        the (fused) input. Used for fresh training and for ``weights = "random"``."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
            # fc starts as "the feature": the output then predicts what h_j predicts.
            h = self.config.hidden_size
            self.fc.weight[:, h:] += torch.eye(h)
            self._reduce_to_final()
        return self

    def _reduce_to_final(self) -> None:
        """``reduce`` as "the final-norm block" (the other layers' weights zero)."""
        if self.reduce is not None:
            with torch.no_grad():
                h = self.config.hidden_size
                self.reduce.weight.zero_()
                self.reduce.weight[:, -h:] = torch.eye(h)

    def with_fused_layers(self, layers: tuple[int, ...]) -> FeatureNet:
        """This network reading ``layers``' outputs beside the final-norm state: a copy
        whose ``reduce`` starts as the final-norm block, so it drafts exactly as this
        one until trained. Only from a network that reads the final-norm state alone."""
        layers = tuple(int(k) for k in layers)
        if self.config.fused_layers == layers:
            return self
        if self.config.fused_layers:
            raise ValueError(f"this network fuses layers {list(self.config.fused_layers)} already, not {list(layers)}")
        net = type(self)(attrs.evolve(self.config, fused_layers=layers))
        missing, unexpected = net.load_state_dict(self.state_dict(), strict=False)
        assert not unexpected and missing == ["reduce.weight"], (missing, unexpected)
        net._reduce_to_final()
        return net.to(self.fc.weight.dtype)

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        save_module(self, directory, FORMAT)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, model: nn.Module | None = None) -> FeatureNet:
        """Load a network; with ``model``, refuse one made for another model."""
        directory = Path(directory)
        try:
            raw = json.loads((directory / CONFIG_NAME).read_text())
            if raw.get("format") != FORMAT:
                raise ModelLoadError(f"{directory / CONFIG_NAME} is not an eagle drafter ({raw.get('format')!r})")
            config = FeatureNetConfig(**raw)
        except FileNotFoundError:
            raise ModelLoadError(f"no eagle drafter at {directory} (expected {CONFIG_NAME} and {WEIGHTS_NAME})") from None
        except (json.JSONDecodeError, TypeError) as exc:
            raise ModelLoadError(f"malformed eagle drafter config {directory / CONFIG_NAME}: {exc}") from None
        if model is not None:
            expected = FeatureNetConfig.for_model(model)
            if (config.hidden_size, config.vocab_size) != (expected.hidden_size, expected.vocab_size) or (
                config.fingerprint is not None and config.fingerprint != expected.fingerprint
            ):
                raise ModelLoadError(
                    f"the eagle drafter at {directory} was made for another model "
                    f"(fingerprint {config.fingerprint}, this model's {expected.fingerprint})"
                )
            layers = text_config(model).num_hidden_layers
            if not all(1 <= k < layers for k in config.fused_layers):
                raise ModelLoadError(
                    f"the eagle drafter at {directory} fuses layers {list(config.fused_layers)}; "
                    f"this model's inner layers are 1..{layers - 1}"
                )
        net = cls(config)
        try:
            net.load_state_dict(load_file(directory / WEIGHTS_NAME))
        except (FileNotFoundError, OSError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot load eagle drafter weights from {directory}: {exc}") from None
        return net


def shipped_drafter_root() -> Path:
    """Where drafters shipped inside the package live: ``tokenswift/drafter_weights/<name>/``."""
    return Path(__file__).resolve().parent.parent / "drafter_weights"


def find_shipped_drafter(model: nn.Module) -> Path | None:
    """The shipped eagle drafter made for ``model`` (same fingerprint), if any."""
    return find_made_for(shipped_drafter_root(), model)


def draft_vocabulary(tokens: torch.Tensor, vocab_size: int, size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent ids of ``tokens`` (then the rest by id, if fewer
    occur), and the share of ``tokens`` they cover."""
    counts = torch.bincount(tokens.flatten(), minlength=vocab_size)
    order = torch.argsort(counts, descending=True, stable=True)[:size]
    return order, float(counts[order].sum()) / max(1, int(counts.sum()))

