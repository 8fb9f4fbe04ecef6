"""The bundled public-domain prompt: the first 180K characters of *Wuthering Heights*
(Emily Brontë, 1847; Project Gutenberg text via ``shared/data/pg_books.jsonl``),
~43K tokens of the demo model: enough for the long-context benchmark's 32K prompts.

The shipped heads were trained with this book held out, so demos and benchmarks run
on text the heads have never seen.
"""

from __future__ import annotations

from importlib import resources

from tokenswift.errors import PromptError, TokenswiftError

BUNDLED_FILE = "wuthering_heights_opening.txt"


def bundled_text() -> str:
    return resources.files("tokenswift.data").joinpath(BUNDLED_FILE).read_text(encoding="utf-8")


def demo_prompt(max_chars: int = 8000) -> str:
    """The opening, cut at the last paragraph break before ``max_chars`` (~2K tokens)."""
    text = bundled_text()[:max_chars]
    return text[: text.rfind("\n\n")].strip() + "\n\n"


def prompt_ids(tokenizer, num_tokens: int, text: str | None = None, source: str = "the bundled prompt") -> list[int]:
    """Exactly ``num_tokens`` token ids from the start of the bundled text (or of
    ``text``, called ``source`` in errors)."""
    ids = tokenizer(bundled_text() if text is None else text, add_special_tokens=False)["input_ids"]
    if num_tokens > len(ids):
        hint = "" if text is not None else "; give a longer text with --prompt-file"
        raise ValueError(f"{source} has {len(ids)} tokens; {num_tokens} were asked for{hint}")
    return ids[:num_tokens]


def check_text(text: str, name: str = "the prompt") -> str:
    """``text`` if it is valid Unicode (UTF-8 encodable), else a :class:`PromptError`
    naming ``name`` and the first lone surrogate (what JSON's ``"\\ud800"`` or a
    command-line argument that is not UTF-8 decodes to); a tokenizer would refuse it
    with its own internals."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(
            f"{name} is not valid Unicode text: it has a lone surrogate {text[exc.start]!r} at character {exc.start} "
            "(text must be encodable as UTF-8)"
        ) from None
    return text


# Counting a long text's tokens in pieces (see tokens_at_least).
COUNT_CHUNK_CHARS = 8192
CUT_SLACK_TOKENS = 8  # tokens one cut between two pieces may add (a word split in two)


def tokens_at_least(tokenizer, text: str, limit: int, chunk_chars: int = COUNT_CHUNK_CHARS) -> tuple[int, int] | None:
    """Whether ``text`` has at least ``limit`` tokens, told without tokenizing all of a
    long text (a 20 MB prompt took 25 s and 4 GB to tokenize whole): pieces of at most
    ``chunk_chars`` characters, cut at whitespace where there is some, are counted in
    turn until their count, less :data:`CUT_SLACK_TOKENS` per piece, reaches ``limit``.
    Returns ``(that lower bound, characters counted)`` then; None where the text ends
    first (it may then still have a few tokens more than ``limit``: count it whole,
    which is cheap now that it is known to be about ``limit`` tokens at most)."""
    counted, start, pieces = 0, 0, 0
    while start < len(text):
        end = min(start + chunk_chars, len(text))
        if end < len(text):
            cut = max(text.rfind(c, start + chunk_chars // 2, end) for c in " \n\t")
            end = cut if cut > start else end
        counted += len(tokenizer(text[start:end], add_special_tokens=False)["input_ids"])
        pieces += 1
        start = end
        if start < len(text) and counted - CUT_SLACK_TOKENS * pieces >= limit:
            return counted - CUT_SLACK_TOKENS * pieces, start
    return None


ROLES = ("system", "user", "assistant", "tool", "developer")


def check_messages(messages) -> list[dict]:
    """``messages`` as a list of {"role", "content"} dicts with string contents, or a
    clear error naming the bad one (``messages[i].field``) and what is valid."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TokenswiftError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}}, got {messages!r:.80}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TokenswiftError(f"messages[{i}] must be an object with 'role' and 'content', got {message!r:.80}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise TokenswiftError(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r:.80}")
        if not isinstance(content, str):
            raise TokenswiftError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        checked.append({"role": role, "content": content})
    return checked


def chat_messages(prompt: str, system: str | None = None) -> list[dict]:
    """One user turn (``prompt``), after a system turn where ``system`` is given."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": prompt}]


def chat_template_text(tokenizer, messages: list[dict]) -> str:
    """``messages`` ([{"role": ..., "content": ...}, ...]) through the tokenizer's own
    chat template, the assistant's turn opened: the text to continue. A tokenizer
    without a template is a clear error."""
    if not getattr(tokenizer, "chat_template", None):
        raise TokenswiftError(
            f"the tokenizer of {getattr(tokenizer, 'name_or_path', 'this model')!r} has no chat template; "
            "pass a plain prompt instead"
        )
    return tokenizer.apply_chat_template(check_messages(messages), tokenize=False, add_generation_prompt=True)


_SENTINEL = "\u2063tokenswift\u2063"  # invisible separators around a word: text no template writes itself


def end_of_turn_ids(tokenizer) -> set[int]:
    """The special token the chat template closes an assistant turn with (ChatML's
    ``<|im_end|>``, Llama 3's ``<|eot_id|>``, ...): the first token after the turn's
    content in a rendered conversation, where that is a special token; empty without
    a template or where the template closes turns with plain text."""
    if not getattr(tokenizer, "chat_template", None):
        return set()
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}], tokenize=False
        )
    except Exception:  # noqa: BLE001 - a template that refuses this conversation closes turns somehow else
        return set()
    after = text.partition(_SENTINEL)[2]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    special |= {i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(token, "special", False)}
    return {ids[0]} if ids and ids[0] in special else set()


def run_end_ids(model, tokenizer) -> set[int]:
    """The ids that end a run: the model's generation config's and the tokenizer's EOS,
    and the token the chat template closes an assistant turn with."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else list(value))
    if tokenizer is not None:
        ids |= end_of_turn_ids(tokenizer)
    return ids
