"""The Gumbel-max samplers (keyed, the default: noise by (seed, position, token);
coupled: a Philox vector by (seed, position)), drafts ranked with the same noise. Identical to autoregressive decoding by construction (tested here for
drafters that see the noise, adversarial ones included), independent across positions,
and coupled for real: a drafter that knows the target's distribution is always right."""

import json

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from tokenswift import Pipeline, get_plugin_manager, hookimpl
from tokenswift.checkpoint import Checkpoint
from tokenswift.interfaces import Drafter
from tokenswift.sampling import CoupledSampler, KeyedSampler, keyed_bits
from tokenswift.testing import assert_lossless, tiny_model_for
from tokenswift.tree import Branch

SAMPLING = {"temperature": 1.0, "min_p": 0.05}


GUMBEL_SAMPLERS = [CoupledSampler, KeyedSampler]


@pytest.mark.parametrize("sampler_class", GUMBEL_SAMPLERS)
def test_the_noise_is_fixed_by_seed_and_position_alone(sampler_class):
    a, b = sampler_class(7), sampler_class(7)
    assert torch.equal(a.noise(12, 100), b.noise(12, 100))  # two samplers, one noise
    assert not torch.equal(a.noise(12, 100), a.noise(13, 100))  # another position
    assert not torch.equal(a.noise(12, 100), sampler_class(8).noise(12, 100))  # another seed
    many = torch.cat([sampler_class(seed).noise(0, 1000) for seed in range(20)])
    # standard Gumbel: over 20,000 draws the mean's sd is ~0.009, the variance's ~0.032
    assert abs(float(many.mean()) - 0.5772) < 0.04 and abs(float(many.var()) - 1.6449) < 0.13
    ids = torch.tensor([99, 0, 41, 41, 7])
    assert torch.equal(a.noise_at(12, ids, 100), a.noise(12, 100)[ids])  # a token's noise, however asked for


def splitmix64(key: int, step: int) -> int:
    """The reference: SplitMix64's output at ``step`` from state ``key``, in Python integers."""
    z = (key + step * 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


@settings(max_examples=40, deadline=None)
@given(key=st.integers(0, 2**64 - 1), ids=st.lists(st.integers(0, 2**31), min_size=1, max_size=20))
def test_the_keyed_noise_is_splitmix64_of_the_key_at_each_token(key, ids):
    """The vectorised int64 words wrap and shift as unsigned 64-bit arithmetic does (a
    sign-extending shift or a carry lost would change them)."""
    words = keyed_bits(key, torch.tensor(ids)).tolist()
    assert [w % 2**64 for w in words] == [splitmix64(key, i + 1) for i in ids]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), position=st.integers(0, 10**9))
def test_keyed_noise_is_independent_across_tokens_positions_and_seeds(seed, position):
    """Neighbouring tokens, positions and seeds give unrelated noise (noise shifted
    along the vocabulary, or shared by two positions, would correlate)."""
    a = KeyedSampler(seed).noise(position, 4000)
    others = [a[1:], KeyedSampler(seed).noise(position + 1, 4000)[:-1], KeyedSampler(seed ^ 1).noise(position, 4000)[:-1]]
    for other in others:
        assert abs(float(torch.corrcoef(torch.stack([a[:-1], other]))[0, 1])) < 0.1  # 4000 pairs: sd ~0.016
    assert bool(torch.isfinite(a).all())


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1), position=st.integers(0, 10**6), vocab=st.integers(1, 300),
    kept=st.floats(0.0, 1.0), ties=st.booleans(), sampler_class=st.sampled_from(GUMBEL_SAMPLERS),
)
def test_a_draw_over_the_kept_tokens_is_the_argmax_over_the_whole_vocabulary(seed, position, vocab, kept, ties, sampler_class):
    """The draw sums noise and scores for the tokens the warpers kept only: the same
    token as ``argmax(scores + G)`` over every token (filtered ones at -inf, a tie to the
    lowest id), whatever is kept."""
    generator = torch.Generator().manual_seed(position)
    scores = torch.randn(vocab, generator=generator, dtype=torch.float64)
    if ties:
        scores = scores.round()  # equal scores: only the noise tells them apart
    filtered = torch.rand(vocab, generator=generator) >= kept
    filtered[int(torch.randint(vocab, (1,), generator=generator))] = False  # at least one kept
    scores[filtered] = -float("inf")
    sampler = sampler_class(seed)
    expected = int((scores + sampler.noise(position, vocab)).argmax())
    assert sampler.draw(scores, position) == expected
    assert sampler.draw(scores.float(), position) == int((scores.float().double() + sampler.noise(position, vocab)).argmax())


@pytest.mark.parametrize("sampler_class", GUMBEL_SAMPLERS)
def test_draws_at_different_positions_are_independent(sampler_class):
    """Reused noise (the same G at every position) would make the two draws equal."""
    scores = torch.zeros(4, dtype=torch.float64)  # uniform over 4 tokens
    runs = 4000
    joint = torch.zeros(4, 4)
    for seed in range(runs):
        sampler = sampler_class(seed)
        joint[sampler.draw(scores, 10), sampler.draw(scores, 11)] += 1
    expected = runs / 16
    chi2 = float(((joint - expected) ** 2 / expected).sum())
    assert chi2 < 40.8  # 15 degrees of freedom, p < 2e-4


def test_a_drafter_that_knows_the_target_is_always_right_under_sampling():
    """tokenswift's depth 1 over the full cache is the target's own distribution: ranked
    with the draw's noise, its best candidate is the draw itself, at every step."""
    spec = {"preset": "tokenswift", "cache": {"name": "full"}, "drafter": {"heads": "random"},
            "retriever": {"name": "none"}, "sampling": SAMPLING, "speculation": {"tree": "fixed"}}
    pipe = Pipeline.from_spec(spec, tiny_model_for("llama-gqa", "float32"))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    result = assert_lossless(pipe, prompt, 40, seed=5)
    records = list(pipe.steps(prompt, 40, seed=5, ignore_eos=True))
    assert all(len(record.emitted) >= 2 for record in records[:-1])  # the last one may be cut at 40
    legacy = Pipeline.from_spec({**spec, "sampling": {**SAMPLING, "sampler": "inverse-cdf"}}, pipe.model)
    independent = assert_lossless(legacy, prompt, 40, seed=5)
    assert independent.stats.steps > result.stats.steps  # drafts not coupled to the draw: fewer accepted


class NoiseChaser(Drafter):
    """An adversary that sees the noise: at each depth it proposes the tokens the noise
    favours most, whatever the model says (and the least favoured, for good measure)."""

    @property
    def max_tree_nodes(self):
        return 8

    def propose(self, state, inputs):
        branches = []
        noise = [inputs.noise(depth) for depth in (1, 2, 3)]
        if noise[0] is None:
            return []
        best = [int(n.argmax()) for n in noise]
        worst = [int(n.argmin()) for n in noise]
        branches.append(Branch(best, [0.9, 0.9, 0.9]))
        branches.append(Branch(worst[:2], [0.5, 0.5]))
        branches.append(Branch([best[0], worst[1], best[2]], [0.9, 0.5, 0.5]))
        return branches


class Adversary:
    @hookimpl
    def tokenswift_register_components(self, registrar):
        registrar.add("drafter", "noise-chaser", NoiseChaser)


@settings(max_examples=12, deadline=None)
@given(
    dtype=st.sampled_from(["float32", "float64"]),
    drafter=st.sampled_from(["noise-chaser", "eagle", "eagle-pass", "tokenswift", "medusa"]),
    tree=st.sampled_from(["auto", "fixed"]),
    seed=st.integers(0, 2**40),
)
def test_drafts_that_see_the_noise_never_change_a_token(dtype, drafter, tree, seed):
    pm = get_plugin_manager()
    if "adversary" not in {name for name, _ in pm.list_name_plugin()}:
        pm.register(Adversary(), name="adversary")
    drafters = {"noise-chaser": {"name": "noise-chaser"}, "eagle": {"name": "eagle", "weights": "random", "threshold": 0.0},
                "eagle-pass": {"name": "eagle", "weights": "random", "threshold": 0.0, "root_pass": True},
                "tokenswift": {"name": "tokenswift", "heads": "random"}, "medusa": {"name": "medusa", "heads": "random"}}
    spec = {"preset": "ar", "drafter": drafters[drafter], "sampling": SAMPLING, "speculation": {"tree": tree},
            "cache": {"name": "dynamic", "budget": 14, "sink": 2, "recent": 4} if drafter in ("tokenswift", "eagle-pass") else {"name": "full"}}
    pipe = Pipeline.from_spec(spec, tiny_model_for("llama-gqa", dtype), plugin_manager=pm)
    assert_lossless(pipe, [5, 6, 7, 8, 5, 6, 7], 24, seed=seed)


@pytest.mark.parametrize("preset", ["tokenswift", "eagle", "medusa"])
def test_same_seed_runs_emit_the_tokens_of_ar_in_float32(preset):
    model = tiny_model_for("qwen2", "float32")
    drafter = {"eagle": {"weights": "random"}}.get(preset, {"heads": "random"})
    for seed in (0, 1, 2**33 + 5):
        fast = Pipeline.from_spec(preset, model, overrides={"drafter": drafter}).generate([9, 8, 7, 9, 8], 30, seed=seed, ignore_eos=True)
        plain = Pipeline.from_spec("ar", model).generate([9, 8, 7, 9, 8], 30, seed=seed, ignore_eos=True)
        assert fast.tokens == plain.tokens


def test_a_checkpoint_from_before_the_coupled_sampler_resumes_with_its_own(tmp_path):
    """Format 1 had no sampler in its spec and drew by inverse CDF: it resumes so."""
    model = tiny_model_for("llama-gqa", "float32")
    spec = {"preset": "tokenswift", "drafter": {"heads": "random"}, "sampling": {"temperature": 1.0}}
    legacy = {**spec, "sampling": {"temperature": 1.0, "sampler": "inverse-cdf"}}
    full = Pipeline.from_spec(legacy, model).generate([1, 2, 3, 4], 30, seed=4, ignore_eos=True)
    path = tmp_path / "run.ckpt"
    Pipeline.from_spec(legacy, model).generate([1, 2, 3, 4], 30, seed=4, ignore_eos=True, checkpoint=path, checkpoint_every=8)
    data = json.loads(path.read_text())
    cut = 12
    data["format"] = "tokenswift-checkpoint/1"
    data["spec"]["sampling"].pop("sampler")
    data["tokens"], data["finish_reason"] = data["tokens"][:cut], "interrupted"
    # the generator as it was after the first 12 draws
    generator = torch.Generator().manual_seed(4)
    for _ in range(cut):
        torch.rand((), generator=generator, dtype=torch.float64)
    import base64

    data["rng_state"] = base64.b64encode(bytes(generator.get_state().tolist())).decode()
    path.write_text(json.dumps(data))
    saved = Checkpoint.load(path)
    assert saved.spec["sampling"]["sampler"] == "inverse-cdf"
    resumed = Pipeline.from_spec(saved.spec, model).generate(None, 0, resume=saved)
    assert resumed.tokens == full.tokens


def test_a_checkpoint_from_before_the_keyed_sampler_resumes_with_the_coupled_one(tmp_path):
    """Format 2 was written while the coupled sampler was the default: a spec that names
    no sampler drew with it, and resumes so (with the keyed one its tokens would differ)."""
    model = tiny_model_for("llama-gqa", "float32")
    spec = {"preset": "eagle", "drafter": {"weights": "random"}, "sampling": SAMPLING}
    coupled = {**spec, "sampling": {**SAMPLING, "sampler": "coupled"}}
    full = Pipeline.from_spec(coupled, model).generate([1, 2, 3, 4], 30, seed=4, ignore_eos=True)
    keyed = Pipeline.from_spec(spec, model).generate([1, 2, 3, 4], 30, seed=4, ignore_eos=True)
    assert keyed.tokens != full.tokens  # the two samplers draw differently from one seed
    path = tmp_path / "run.ckpt"
    Pipeline.from_spec(coupled, model).generate([1, 2, 3, 4], 30, seed=4, ignore_eos=True, checkpoint=path, checkpoint_every=8)
    data = json.loads(path.read_text())
    assert data["format"] == "tokenswift-checkpoint/3"
    data["format"] = "tokenswift-checkpoint/2"
    data["spec"]["sampling"].pop("sampler")
    data["tokens"], data["finish_reason"] = data["tokens"][:12], "interrupted"
    path.write_text(json.dumps(data))
    saved = Checkpoint.load(path)
    assert saved.spec["sampling"]["sampler"] == "coupled"
    assert Pipeline.from_spec(saved.spec, model).generate(None, 0, resume=saved).tokens == full.tokens
