"""The bundled public-domain prompt: the first 180K characters of *Wuthering Heights*
(Emily Brontë, 1847; Project Gutenberg text via ``shared/data/pg_books.jsonl``),
~43K tokens of the demo model: enough for the long-context benchmark's 32K prompts.

The shipped heads were trained with this book held out, so demos and benchmarks run
on text the heads have never seen.
"""

from __future__ import annotations

from importlib import resources

from tokenswift.errors import TokenswiftError

BUNDLED_FILE = "wuthering_heights_opening.txt"


def bundled_text() -> str:
    return resources.files("tokenswift.data").joinpath(BUNDLED_FILE).read_text(encoding="utf-8")


def demo_prompt(max_chars: int = 8000) -> str:
    """The opening, cut at the last paragraph break before ``max_chars`` (~2K tokens)."""
    text = bundled_text()[:max_chars]
    return text[: text.rfind("\n\n")].strip() + "\n\n"


def prompt_ids(tokenizer, num_tokens: int) -> list[int]:
    """Exactly ``num_tokens`` token ids from the start of the bundled text."""
    ids = tokenizer(bundled_text(), add_special_tokens=False)["input_ids"]
    if num_tokens > len(ids):
        raise ValueError(f"the bundled prompt has {len(ids)} tokens; {num_tokens} were asked for")
    return ids[:num_tokens]


def chat_template_text(tokenizer, messages: list[dict]) -> str:
    """``messages`` ([{"role": ..., "content": ...}, ...]) through the tokenizer's own
    chat template, the assistant's turn opened: the text to continue. A tokenizer
    without a template is a clear error."""
    if not getattr(tokenizer, "chat_template", None):
        raise TokenswiftError(
            f"the tokenizer of {getattr(tokenizer, 'name_or_path', 'this model')!r} has no chat template; "
            "pass a plain prompt instead"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
