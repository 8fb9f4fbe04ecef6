"""Chat runs: the template's text is the prompt, the ids that end a run are exempt from
the penalty (they are in every chat prompt's window), and the template's end of turn
ends the reply."""

import torch

from tokenswift import Pipeline
from tokenswift.model.loading import tiny_model
from tokenswift.penalties.contextual import ContextualPenalty
from tokenswift.prompts import end_of_turn_ids, run_end_ids
from tokenswift.scoring import Scorer
from tokenswift.spec import SamplingSpec
from tokenswift.testing import FIXED_TREE, TINY_CONFIGS, word_tokenizer

START, END = "w62", "w63"  # words of the tiny vocabulary, made special: ChatML's markers
CHATML = (
    "{% for m in messages %}" + START + " {{ m['role'] }} {{ m['content'] }} " + END + " {% endfor %}"
    "{% if add_generation_prompt %}" + START + " a {% endif %}"
)
MESSAGES = [{"role": "user", "content": "the cat sat on the mat"}]


def chatml_tokenizer():
    tokenizer = word_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [START, END]})
    tokenizer.chat_template = CHATML
    return tokenizer


def test_the_penalty_leaves_the_ids_that_end_a_run_alone():
    penalty = ContextualPenalty(ContextualPenalty.Options(value=2.0, window=8), None)
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    contexts = torch.tensor([[1, 3, 4]])
    plain = Scorer(penalty, SamplingSpec(greedy=True)).penalize(contexts, logits.clone())
    exempt = Scorer(penalty, SamplingSpec(greedy=True), exempt=[3]).penalize(contexts, logits.clone())
    assert plain.tolist() == [[1.0, 1.0, 3.0, 2.0, 2.5]]
    assert exempt.tolist() == [[1.0, 1.0, 3.0, 4.0, 2.5]]  # id 3 as it was; 1 and 4 penalised


def test_the_end_of_turn_token_is_read_from_the_template():
    tokenizer = chatml_tokenizer()
    end = tokenizer.convert_tokens_to_ids(END)
    assert end == 63 and end_of_turn_ids(tokenizer) == {end}
    assert end_of_turn_ids(word_tokenizer()) == set()  # no template
    plain = word_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['content'] }} the end {% endfor %}"
    assert end_of_turn_ids(plain) == set()  # turns closed by plain words: nothing to stop at
    model = tiny_model(TINY_CONFIGS["llama-gqa"], seed=0, dtype="float32")
    pipe = Pipeline.from_spec("ar", model, tokenizer)
    assert end in pipe.eos_token_ids() and run_end_ids(model, tokenizer) == {end}
    assert pipe.scorer.exempt == (end,)


def test_a_reply_ends_at_the_end_of_turn_token_despite_the_penalty():
    """The model is made to prefer the end of turn at its first reply token (its LM-head
    row twice the row of the token it would say); the end of turn sits in the prompt, so
    a penalty of 3 would divide its score by 3 and hide it, were it not exempt."""
    tokenizer = chatml_tokenizer()
    end = tokenizer.convert_tokens_to_ids(END)
    model = tiny_model(TINY_CONFIGS["llama-gqa"], seed=0, dtype="float32")
    greedy = {"sampling": {"greedy": True}}
    first = Pipeline.from_spec("ar", model, tokenizer, overrides=greedy).generate(
        messages=MESSAGES, max_new_tokens=1, ignore_eos=True
    ).tokens[0]
    assert first != end
    with torch.no_grad():
        model.lm_head.weight[end] = 2 * model.lm_head.weight[first]
    penalised = {**greedy, **FIXED_TREE, "penalty": {"name": "contextual", "value": 3.0, "window": 64}}
    for preset in ("ar", "tokenswift"):
        pipe = Pipeline.from_spec(preset, model, tokenizer, overrides=penalised)
        assert pipe.encode(pipe.chat_prompt(MESSAGES)).count(end) == 1  # the end of turn is in the window
        result = pipe.generate(messages=MESSAGES, max_new_tokens=20)
        assert result.tokens == [end] and result.stats.finish_reason == "eos", preset
        assert result.text == ""  # special tokens are not text
