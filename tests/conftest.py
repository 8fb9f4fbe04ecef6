import os
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Converted demo models go to a per-session cache, not the user's.
os.environ["TOKENSWIFT_CACHE"] = tempfile.mkdtemp(prefix="tokenswift-test-cache-")
# The CPU kernels are built once (~40 s on two cores) into the user's kernel cache, keyed
# by their source, torch and the CPU, and reused by every test and subprocess, including
# those that point TOKENSWIFT_CACHE at a folder of their own.
os.environ.setdefault("TOKENSWIFT_KERNEL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "tokenswift", "kernels"))
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Compiled graphs are compiled in each test, not loaded from the graph store that an
# earlier test filled (tokenswift.model.graph_store); tests/test_graph_store.py turns it on.
os.environ["TOKENSWIFT_GRAPH_STORE"] = "0"
# A run's first calibration is measured in the run's process, not in a child process of
# its own (a fresh interpreter: ~6-9 s on a 2-core CPU, each model and dtype a test runs
# first); tests/test_calibrate_apart.py sets the default back.
os.environ["TOKENSWIFT_CALIBRATE"] = "here"


@pytest.fixture(autouse=True)
def _no_plugins(monkeypatch):
    """Tests see the built-ins only, unless a test installs plugins itself."""
    monkeypatch.setenv("TOKENSWIFT_DISABLE_PLUGINS", "all")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A saved tiny Llama (GQA, float32) with a word-level tokenizer, for CLI runs."""
    from tokenswift.testing import tiny_model_for, word_tokenizer

    path = tmp_path_factory.mktemp("tiny")
    tiny_model_for("llama-gqa", "float32").save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_conversion(tmp_path_factory):
    """The packaged demo model's GGUF file converted once a session (~25-35 s on two
    cores), in a cache of its own with the file's parses counted, then linked into the
    session's cache, where every later load of ``smollm2`` finds it. Returns (parses,
    tensor-name maps built, converted directory). Tests that load the model use it, so that the suite converts
    once, not once per test file."""
    import gguf

    from tokenswift.model import loading

    parses, name_maps = [], []

    class CountedReader(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            parses.append(args)
            super().__init__(*args, **kwargs)

    def counted_name_map(*args, original=gguf.get_tensor_name_map):
        name_maps.append(args)
        return original(*args)

    own = tmp_path_factory.mktemp("smollm2-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", CountedReader)
        patch.setattr(gguf, "get_tensor_name_map", counted_name_map)
        patch.setenv("TOKENSWIFT_CACHE", str(own))
        converted = loading._converted_gguf(loading.PACKAGED_MODELS["smollm2"].locate())
    assert converted is not None
    shared = loading.cache_dir() / "models" / converted.name
    if not shared.exists():
        shared.parent.mkdir(parents=True, exist_ok=True)
        shared.symlink_to(converted, target_is_directory=True)
    return len(parses), len(name_maps), converted
