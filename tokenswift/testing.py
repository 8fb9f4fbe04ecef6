"""Test helpers: tiny random models and reference decoding loops.

Importable by plugin authors so that their components go through the same checks:

    from tokenswift.testing import tiny_model_for, reference_generate
    ref = reference_generate(model, prompt, 40, sampling=..., penalty=(1.2, 16), seed=0)
    assert Pipeline.from_spec(my_spec, model).generate(prompt, 40, seed=0, ignore_eos=True).tokens == ref
"""

from __future__ import annotations

import functools

import torch

from tokenswift.model.loading import tiny_model
from tokenswift.penalties.contextual import ContextualPenalty
from tokenswift.penalties.none import NoPenalty
from tokenswift.sampling import make_sampler
from tokenswift.scoring import Scorer
from tokenswift.spec import SamplingSpec

# Random models with the default init have nearly flat logits (argmax near-ties); a
# large initializer_range makes them decisive.
_COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    initializer_range=0.5,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# Spec overrides for tests that assert how many drafted tokens get accepted: the default
# ``tree = "auto"`` sizes each step's tree from this machine's measured costs, so its
# acceptance counts differ between machines (its tokens never do); the paper's fixed tree
# proposes the same candidates everywhere.
FIXED_TREE: dict = {"speculation": {"tree": "fixed"}}

TINY_CONFIGS: dict[str, dict] = {
    "llama-mha": dict(_COMMON, model_type="llama", num_key_value_heads=4),
    "llama-gqa": dict(_COMMON, model_type="llama", num_key_value_heads=2),
    "qwen2": dict(_COMMON, model_type="qwen2", num_key_value_heads=2),
    "mistral": dict(_COMMON, model_type="mistral", num_key_value_heads=2, sliding_window=None),
}


@functools.lru_cache(maxsize=16)
def tiny_model_for(name: str, dtype: str = "float64", seed: int = 0) -> torch.nn.Module:
    """A cached tiny random model from :data:`TINY_CONFIGS` (do not modify it)."""
    return tiny_model(TINY_CONFIGS[name], seed=seed, dtype=dtype)


def word_tokenizer(size: int = 64):
    """A word-level tokenizer for the tiny models: ``<unk> the cat sat on mat a dog``,
    then ``w8``..``w{size-1}``, so that every id a tiny model emits decodes to a word.
    Enough to save beside a tiny model and drive the CLI with text prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "the", "cat", "sat", "on", "mat", "a", "dog"]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(len(words), size)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@functools.lru_cache(maxsize=8)
def looping_model(name: str = "llama-mha", dtype: str = "float64", seed: int = 0) -> torch.nn.Module:
    """A tiny model whose attention output is zeroed, so each next token depends on the
    current token only: greedy decoding falls into a short cycle, and drafts from the
    text so far (n-grams, lookups) are really accepted. Still an unmodified architecture."""
    model = tiny_model(TINY_CONFIGS[name], seed=seed, dtype=dtype)
    with torch.no_grad():
        for layer in model.get_decoder().layers:
            layer.self_attn.o_proj.weight.zero_()
    return model


@torch.inference_mode()
def reference_tokens(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, scorer: Scorer, *, greedy: bool, seed: int) -> list[int]:
    """Plain autoregressive decoding that recomputes the whole sequence every step (no
    KV store, no tree, no drafts), scoring each position with ``scorer`` and drawing
    as the pipeline does. EOS is ignored. This is what every pipeline must emit."""
    sampler = make_sampler(SamplingSpec(greedy=True) if greedy else scorer.sampling, seed=seed)
    param = next(model.parameters())
    dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([tokens], device=param.device)).logits[:, -1].to(dtype)
        scores = scorer(scorer.context(tokens, device=param.device), logits)
        tokens.append(sampler.draw(scores[0], len(tokens)))
    return tokens[len(prompt) :]


def reference_generate(
    model: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    *,
    sampling: SamplingSpec = SamplingSpec(greedy=True),
    penalty: tuple[float, int] | None = None,
    seed: int = 0,
) -> list[int]:
    """:func:`reference_tokens` with the contextual penalty ``(value, window)`` (or
    none) and the warpers of ``sampling``."""
    if penalty is None:
        component = NoPenalty(NoPenalty.Options(), None)
    else:
        component = ContextualPenalty(ContextualPenalty.Options(value=penalty[0], window=penalty[1]), None)
    return reference_tokens(model, prompt, max_new_tokens, Scorer(component, sampling), greedy=sampling.greedy, seed=seed)


def assert_lossless(pipe, prompt: list[int], max_new_tokens: int, seed: int = 0):
    """Generate with ``pipe`` and check every token against :func:`reference_tokens`
    (greedy: the identical sequence; sampling: the identical draws, since each token's
    draw depends only on its scores and (seed, position)). Returns the result."""
    result = pipe.generate(prompt, max_new_tokens, seed=seed, ignore_eos=True)
    expected = reference_tokens(pipe.model, prompt, max_new_tokens, pipe.scorer, greedy=pipe.spec.sampling.greedy, seed=seed)
    if result.tokens != expected:
        first = next(i for i, (a, b) in enumerate(zip(result.tokens, expected)) if a != b)
        raise AssertionError(
            f"{pipe!r} is not lossless: token {first} is {result.tokens[first]}, autoregressive decoding "
            f"gives {expected[first]} (seed {seed}, prompt {prompt}, spec {pipe.spec.to_dict()})"
        )
    return result
