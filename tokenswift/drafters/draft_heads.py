"""TokenSwift's draft heads: chained residual blocks over the last hidden state.

    h_0 = hidden(t)                        # final-norm hidden state of token t
    h_i = h_{i-1} + W_i · RMSNorm_i(h_{i-1})   for i = 1..k
    logits_i = lm_head(RMSNorm'_i(h_i))    # head i predicts token t+i+1

The LM head is the base model's own (shared, frozen, not saved with the heads).
Saved as ``model.safetensors`` + ``config.json``; the config records the base model's
fingerprint so that heads are never silently used with another model.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import attrs
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tokenswift.distributed import full_tensor
from tokenswift.errors import ModelLoadError
from tokenswift.model.configs import text_config

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT = "tokenswift-heads/1"


def model_fingerprint(model: nn.Module) -> str:
    """A short hash of a causal LM's identity: its type, shapes and the first rows of
    its output embedding rounded to bfloat16 (stable across float32/bfloat16 loads)."""
    config = model.config
    weight = full_tensor(model.get_output_embeddings().weight.detach())  # whole, also when sharded
    digest = hashlib.sha256()
    digest.update(
        json.dumps(
            [config.model_type, config.hidden_size, weight.shape[0], config.num_hidden_layers], sort_keys=True
        ).encode()
    )
    digest.update(weight[:64].to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def shipped_heads_root() -> Path:
    """Where heads shipped inside the package live: ``tokenswift/heads/<name>/``."""
    return Path(__file__).resolve().parent.parent / "heads"


def save_module(module: nn.Module, directory: str | os.PathLike, format: str) -> None:
    """Save a draft module's weights (``model.safetensors``) and its attrs ``config``
    (``config.json``) in ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in module.state_dict().items()}
    save_file(tensors, directory / WEIGHTS_NAME, metadata={"format": format})
    (directory / CONFIG_NAME).write_text(json.dumps(attrs.asdict(module.config), indent=2) + "\n")


def find_shipped_heads(model: nn.Module) -> Path | None:
    """The shipped heads directory made for ``model`` (same fingerprint), if any."""
    return find_made_for(shipped_heads_root(), model)


def find_made_for(root: Path, model: nn.Module) -> Path | None:
    """The folder under ``root`` whose ``config.json`` names ``model``'s fingerprint."""
    if not root.is_dir():
        return None
    fingerprint = model_fingerprint(model)
    for config_path in sorted(root.glob(f"*/{CONFIG_NAME}")):
        try:
            if json.loads(config_path.read_text()).get("fingerprint") == fingerprint:
                return config_path.parent
        except (OSError, json.JSONDecodeError):
            continue
    return None


@attrs.frozen(kw_only=True)
class HeadsConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int
    rms_norm_eps: float = 1e-5
    fingerprint: str | None = None
    format: str = FORMAT


class DraftHeads(nn.Module):
    """k chained residual heads; ``forward`` returns hidden states, ``logits`` applies
    the shared LM head."""

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.config = config
        size = config.hidden_size
        self.blocks = nn.ModuleList(nn.Linear(size, size, bias=False) for _ in range(config.num_heads))
        self.block_norms = nn.ModuleList(nn.RMSNorm(size, eps=config.rms_norm_eps) for _ in range(config.num_heads))
        self.out_norms = nn.ModuleList(nn.RMSNorm(size, eps=config.rms_norm_eps) for _ in range(config.num_heads))
        for block in self.blocks:
            nn.init.zeros_(block.weight)  # start as the LM head's own next-token guess

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., hidden_size] -> [..., num_heads, hidden_size] (normed head outputs)."""
        outputs = []
        h = hidden
        for block, norm, out_norm in zip(self.blocks, self.block_norms, self.out_norms):
            h = h + block(norm(h))
            outputs.append(out_norm(h))
        return torch.stack(outputs, dim=-2)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """hidden: [..., hidden_size] -> [..., num_heads, vocab]."""
        return lm_head(self(hidden))

    # -- construction ---------------------------------------------------------------

    @classmethod
    def for_model(cls, model: nn.Module, num_heads: int = 3) -> DraftHeads:
        """Fresh heads (identity-initialised) matching ``model``."""
        config = text_config(model)
        heads = cls(
            HeadsConfig(
                hidden_size=config.hidden_size,
                vocab_size=model.get_output_embeddings().weight.shape[0],
                num_heads=num_heads,
                rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-5)),
                fingerprint=model_fingerprint(model),
            )
        )
        param = next(model.parameters())
        return heads.to(device=param.device, dtype=param.dtype)

    @classmethod
    def random(cls, model: nn.Module, num_heads: int = 3, seed: int = 0, std: float = 0.02) -> DraftHeads:
        """Seeded random heads (tests, and measuring the machinery's own cost)."""
        heads = cls.for_model(model, num_heads)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for block in heads.blocks:
                block.weight.copy_(torch.randn(block.weight.shape, generator=generator, dtype=torch.float32) * std)
        return heads

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        save_module(self, directory, FORMAT)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, model: nn.Module | None = None) -> DraftHeads:
        """Load heads; with ``model``, refuse heads made for another model."""
        directory = Path(directory)
        try:
            raw = json.loads((directory / CONFIG_NAME).read_text())
            config = HeadsConfig(**raw)
        except FileNotFoundError:
            raise ModelLoadError(f"no draft heads at {directory} (expected {CONFIG_NAME} and {WEIGHTS_NAME})") from None
        except (json.JSONDecodeError, TypeError) as exc:
            raise ModelLoadError(f"malformed heads config {directory / CONFIG_NAME}: {exc}") from None
        heads = cls(config)
        if model is not None:
            cls._check_match(config, model, directory)
        try:
            state = load_file(directory / WEIGHTS_NAME)
        except (FileNotFoundError, OSError) as exc:
            raise ModelLoadError(f"cannot read head weights {directory / WEIGHTS_NAME}: {exc}") from None
        try:
            heads.load_state_dict(state)
        except RuntimeError as exc:
            raise ModelLoadError(f"head weights in {directory} do not match their config: {exc}") from None
        if model is not None:
            param = next(model.parameters())
            heads = heads.to(device=param.device, dtype=param.dtype)
        return heads

    @staticmethod
    def _check_match(config: HeadsConfig, model: nn.Module, directory: Path) -> None:
        model_config = text_config(model)
        vocab = model.get_output_embeddings().weight.shape[0]
        problems = []
        if config.hidden_size != model_config.hidden_size:
            problems.append(f"hidden size {config.hidden_size} != model's {model_config.hidden_size}")
        if config.vocab_size != vocab:
            problems.append(f"vocabulary {config.vocab_size} != model's {vocab}")
        if not problems and config.fingerprint is not None and config.fingerprint != model_fingerprint(model):
            problems.append(f"fingerprint {config.fingerprint} != model's {model_fingerprint(model)}")
        if problems:
            raise ModelLoadError(f"draft heads at {directory} were made for another model: " + "; ".join(problems))
