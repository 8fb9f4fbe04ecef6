"""A machine's first calibrations run in a process of their own, so that what they
allocate is not resident for the whole run (issue 57); where no child can serve, the
run measures in its own process as before."""

import logging

import pytest

from tokenswift import Pipeline, calibrate_apart, calibration, compiling
from tokenswift.calibration import load_calibration
from tokenswift.testing import tiny_model_for


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """An empty calibration cache, for this process and the children it starts, and the
    default setting these tests are about (the rest of the suite calibrates here)."""
    monkeypatch.setenv("TOKENSWIFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENSWIFT_CALIBRATE", "apart")
    return tmp_path / "cache"


def _measured_here(monkeypatch) -> list:
    """Calls of the in-process measurement (each one made for real)."""
    calls = []
    real = calibration.calibrate

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(calibration, "calibrate", counted)
    return calls


def test_a_run_of_a_model_from_a_path_calibrates_in_a_child_process(model_dir, own_cache, monkeypatch):
    here = _measured_here(monkeypatch)
    pipe = Pipeline.from_spec({"preset": "ar", "model": {"path": str(model_dir)}, "penalty": {"value": 1.3}})
    # the dtype the run resolved ("auto" picks per machine), so that the child measures that one
    assert pipe.runner.source["path"] == str(model_dir)
    assert pipe.runner.source["dtype"] == str(pipe.runner.dtype).removeprefix("torch.")
    costs = pipe.costs()
    assert here == []  # measured by the child, which cached it under this run's key
    assert costs is not None and load_calibration(pipe.runner) is not None
    assert pipe.runner.store is None  # nothing of the measurement's KV store in this process
    # and the run goes on with it
    assert len(pipe.generate([1, 2, 3], 8, seed=0, ignore_eos=True).tokens) == 8


def test_a_model_passed_in_calibrates_in_the_run_process(own_cache, monkeypatch):
    here = _measured_here(monkeypatch)
    monkeypatch.setattr(calibrate_apart, "measure_apart", lambda *a: pytest.fail("no child can load a model object"))
    pipe = Pipeline.from_spec("ar", tiny_model_for("llama-gqa", "float32"))
    assert pipe.runner.source is None
    pipe.costs()
    assert len(here) == 1


def test_a_failed_child_falls_back_to_measuring_here(model_dir, own_cache, monkeypatch, caplog):
    here = _measured_here(monkeypatch)
    monkeypatch.setattr(calibrate_apart.sys, "executable", "/bin/false")
    pipe = Pipeline.from_spec({"preset": "ar", "model": {"path": str(model_dir)}})
    with caplog.at_level(logging.WARNING, logger="tokenswift"):
        pipe.costs()
    assert len(here) == 1
    assert "the calibration process failed (exit status 1); measuring in this one" in caplog.text


def test_calibrating_here_is_a_setting(model_dir, own_cache, monkeypatch):
    here = _measured_here(monkeypatch)
    monkeypatch.setenv("TOKENSWIFT_CALIBRATE", "here")
    Pipeline.from_spec({"preset": "ar", "model": {"path": str(model_dir)}}).costs()
    assert len(here) == 1
    monkeypatch.setenv("TOKENSWIFT_CACHE", str(own_cache / "another"))  # nothing cached: the setting is read
    monkeypatch.setenv("TOKENSWIFT_CALIBRATE", "elsewhere")
    with pytest.raises(ValueError, match=r"TOKENSWIFT_CALIBRATE='elsewhere': expected one of \['apart', 'here'\]"):
        Pipeline.from_spec({"preset": "ar", "model": {"path": str(model_dir)}}).costs()


def test_the_compile_calibration_asks_a_child_first(model_dir, own_cache, monkeypatch):
    """The child's record is what the run uses; where it caches none, the run measures."""
    pipe = Pipeline.from_spec({"preset": "ar", "model": {"path": str(model_dir)}})
    asked = []
    record = compiling.CompileCalibration(
        key=compiling.machine_key(pipe.runner), machine="m", contexts=(256, 2048), eager_ms=(2.0, 3.0),
        compiled_ms=(1.0, 1.5), compile_seconds=1.0,
    )

    def child(spec, what):
        asked.append((spec["model"]["path"], what))
        record.save()
        return True

    monkeypatch.setattr(calibrate_apart, "measure_apart", child)
    monkeypatch.setattr(compiling, "measure_compile", lambda runner: pytest.fail("measured here"))
    assert compiling.compile_calibration_for(pipe.runner) == record
    assert asked == [(str(model_dir), "compile")]
