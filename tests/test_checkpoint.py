"""Checkpoints: an interrupted generation resumes exactly where it stopped."""

import attrs
import pytest

from tokenswift import Pipeline, get_plugin_manager, hookimpl
from tokenswift.checkpoint import Checkpoint
from tokenswift.errors import TokenswiftError
from tokenswift.testing import looping_model, tiny_model_for

SPEC = {"preset": "tokenswift", "drafter": {"heads": "random", "tree": [2, 2, 1]}, "cache": {"budget": 16, "sink": 2, "recent": 4}}


class StopAt:
    """Raises KeyboardInterrupt (as Ctrl-C would) once ``limit`` tokens exist."""

    def __init__(self, limit):
        self.limit = limit

    @hookimpl
    def tokenswift_step_end(self, pipeline, step):
        if step.generated >= self.limit:
            raise KeyboardInterrupt


@pytest.mark.parametrize("sampling", [{"greedy": True}, {"temperature": 1.0, "min_p": 0.1}])
@pytest.mark.parametrize("model_name", ["llama-gqa", "looping"])
def test_interrupt_and_resume_equals_the_uninterrupted_run(tmp_path, sampling, model_name):
    model = looping_model() if model_name == "looping" else tiny_model_for(model_name)
    spec = {**SPEC, "sampling": sampling}
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    full = Pipeline.from_spec(spec, model).generate(prompt, 60, seed=5, ignore_eos=True)

    pm = get_plugin_manager()
    pm.register(StopAt(23))
    path = tmp_path / "run.ckpt"
    cut = Pipeline.from_spec(spec, model, plugin_manager=pm).generate(
        prompt, 60, seed=5, ignore_eos=True, checkpoint=path, checkpoint_every=10
    )
    assert cut.stats.finish_reason == "interrupted" and 23 <= len(cut.tokens) < 60
    saved = Checkpoint.load(path)
    assert saved.tokens == cut.tokens == full.tokens[: len(cut.tokens)] and not saved.done

    resumed = Pipeline.from_spec(saved.spec, model).generate(None, 0, resume=saved, checkpoint=path)
    assert resumed.tokens == full.tokens
    assert Checkpoint.load(path).finish_reason == "length" and Checkpoint.load(path).tokens == full.tokens
    # the resumed run's rates count what its own steps emitted, not the checkpoint's tokens
    stats = resumed.stats
    assert stats.resumed_tokens == len(saved.tokens) and stats.new_tokens == 60
    emitted = sum(count * tokens for tokens, count in stats.tokens_per_step_histogram.items())
    assert stats.tokens_per_step == pytest.approx(emitted / stats.steps) == pytest.approx((60 - len(saved.tokens)) / stats.steps)


def test_periodic_checkpoints_are_written(tmp_path):
    path = tmp_path / "run.ckpt"
    seen = []

    class Watch:
        @hookimpl
        def tokenswift_step_end(self, pipeline, step):
            if path.exists():
                seen.append(len(Checkpoint.load(path).tokens))

    pm = get_plugin_manager()
    pm.register(Watch())
    Pipeline.from_spec("ar", tiny_model_for("llama-mha"), plugin_manager=pm).generate(
        [1, 2], 35, seed=0, ignore_eos=True, checkpoint=path, checkpoint_every=10
    )
    assert sorted(set(seen)) == [10, 20, 30]
    final = Checkpoint.load(path)
    assert final.done and len(final.tokens) == 35


def test_resuming_a_finished_run_generates_nothing_more(tmp_path):
    path = tmp_path / "run.ckpt"
    pipe = Pipeline.from_spec("ar", tiny_model_for("llama-mha"))
    first = pipe.generate([1, 2], 12, seed=0, ignore_eos=True, checkpoint=path)
    again = pipe.generate(None, 0, resume=Checkpoint.load(path))
    assert again.tokens == first.tokens and again.stats.steps == 0


def test_bad_checkpoints(tmp_path):
    with pytest.raises(TokenswiftError, match="no checkpoint at"):
        Checkpoint.load(tmp_path / "missing")
    bad = tmp_path / "bad.ckpt"
    bad.write_text("{not json")
    with pytest.raises(TokenswiftError, match="is not readable"):
        Checkpoint.load(bad)
    bad.write_text('{"format": "other"}')
    with pytest.raises(TokenswiftError, match="is not a tokenswift checkpoint"):
        Checkpoint.load(bad)


def test_a_checkpoint_save_that_fails_leaves_nothing_beside_it(tmp_path):
    pipe = Pipeline.from_spec("ar", tiny_model_for("llama-mha"))
    path = tmp_path / "run.ckpt"
    pipe.generate([1, 2], 4, seed=0, ignore_eos=True, checkpoint=path)
    saved = Checkpoint.load(path)
    path.unlink()
    path.mkdir()  # os.replace cannot put a file there
    with pytest.raises(OSError):
        saved.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["run.ckpt"] and path.is_dir()


def test_resuming_through_the_python_api_checks_the_checkpoint_against_the_model(tmp_path):
    path = tmp_path / "run.ckpt"
    pipe = Pipeline.from_spec("ar", tiny_model_for("llama-mha"))
    pipe.generate([1, 2], 6, seed=0, ignore_eos=True, checkpoint=path)
    saved = Checkpoint.load(path)
    broken = Checkpoint(**{**attrs.asdict(saved), "tokens": [1, 10**9], "finish_reason": "interrupted"})
    with pytest.raises(ValueError, match=r"generated token ids \[1000000000\] are outside the vocabulary \[0, 64\)"):
        pipe.generate(None, 0, resume=broken)


@pytest.mark.parametrize("sampler", ["coupled", "inverse-cdf"])
def test_an_interrupt_in_the_middle_of_a_step_resumes_exactly(tmp_path, sampler):
    """Ctrl-C can land after a step has drawn but before it committed: the checkpoint
    must resume as of the last committed step (the inverse-CDF sampler: its generator
    as of then; the coupled one needs nothing but the seed)."""
    from tokenswift.verifiers.tree_sampling import TreeSamplingVerifier

    class InterruptedOnce(TreeSamplingVerifier):
        """tree-sampling, but the fifth step is interrupted right after its first draw."""

        calls = 0

        def verify(self, tree, scores, sampler):
            InterruptedOnce.calls += 1
            if InterruptedOnce.calls == 5:
                sampler.draw(scores[0], scores.position(0))
                raise KeyboardInterrupt
            return super().verify(tree, scores, sampler)

    class Plugin:
        @hookimpl
        def tokenswift_register_components(self, registrar):
            registrar.add("verifier", "interrupted-once", InterruptedOnce)

    model = tiny_model_for("llama-gqa")
    spec = {**SPEC, "sampling": {"temperature": 1.0, "sampler": sampler}}
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    full = Pipeline.from_spec(spec, model).generate(prompt, 40, seed=7, ignore_eos=True)
    pm = get_plugin_manager()
    pm.register(Plugin())
    path = tmp_path / "run.ckpt"
    cut = Pipeline.from_spec({**spec, "verifier": {"name": "interrupted-once"}}, model, plugin_manager=pm).generate(
        prompt, 40, seed=7, ignore_eos=True, checkpoint=path
    )
    assert cut.stats.finish_reason == "interrupted" and cut.stats.steps == 4
    saved = Checkpoint.load(path)
    assert saved.tokens == cut.tokens == full.tokens[: len(cut.tokens)]
    resumed = Pipeline.from_spec(spec, model).generate(None, 0, resume=Checkpoint(**{**attrs.asdict(saved), "spec": spec}))
    assert resumed.tokens == full.tokens


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_ctrl_c_during_a_forward_ends_the_run_after_that_step(signame, tmp_path, monkeypatch):
    """SIGINT arriving inside a step's forward: the step completes and is kept, then the
    run ends "interrupted" with its checkpoint written, and Ctrl-C is Python's again.
    (Raised inside the forward, the step was lost; inside a compiled forward the
    interrupt came back from inductor's C++ wrapper as a RuntimeError and the run crashed.)"""
    import signal

    signum = getattr(signal, signame)
    # SIGTERM as `tokenswift generate` handles it; SIGINT as Python sets it up, which it
    # does not where the process started with SIGINT ignored (a background job of a
    # shell without job control: there the test failed, the signal never arriving)
    previous = signal.signal(signum, signal.default_int_handler)
    try:
        interrupted_mid_forward(signum, tmp_path, monkeypatch)
    finally:
        signal.signal(signum, previous)


def interrupted_mid_forward(signum, tmp_path, monkeypatch):
    import signal

    from tokenswift.checkpoint import Checkpoint

    pipe = Pipeline.from_spec("ar", tiny_model_for("llama-gqa", "float32"))
    forward, armed, fired = pipe.runner.forward, [], []

    def forward_then_ctrl_c(*args, **kwargs):
        if armed and not fired:
            fired.append(1)
            signal.raise_signal(signum)  # arrives mid-step
        return forward(*args, **kwargs)

    def stream(chunk):
        if len(streamed := stream.tokens) + len(chunk.tokens) >= 3:
            armed.append(1)
        streamed.extend(chunk.tokens)

    stream.tokens = []
    monkeypatch.setattr(pipe.runner, "forward", forward_then_ctrl_c)
    result = pipe.generate([1, 2, 3], 20, seed=0, checkpoint=tmp_path / "run.ckpt", checkpoint_every=100, stream=stream)
    assert result.stats.finish_reason == "interrupted" and fired
    assert len(result.tokens) == 4  # the step the interrupt came in was kept, no step after it
    assert Checkpoint.load(tmp_path / "run.ckpt").tokens == result.tokens
    assert signal.getsignal(signum) is signal.default_int_handler
