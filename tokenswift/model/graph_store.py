"""Compiled graphs kept on disk, so that every later process loads them in milliseconds.

A warm ``torch.compile`` (inductor's kernels already cached) still traces the model
through Dynamo in every new process: on a 2-core AMD EPYC Zen 4 (SmolLM2-135M, 2026-12-06)
7.7-9.2 s for the one-token forward and 1.9-2.0 s for the layered tree forward, ~70% of
it Dynamo's bytecode tracing. A run of a few hundred tokens cannot repay that, so
``compile = "auto"`` left such runs' trees eager and speculation earned nothing in them.

:class:`StoredGraph` compiles a graph *ahead of time* at its first call
(``torch.compile(...).aot_compile``: Dynamo's output, its guards and inductor's code,
serialized) and writes it under ``$TOKENSWIFT_CACHE/graphs/<identity>/``; a later process
loads the file (~20 ms) and calls it without tracing anything. The model's weights are
inputs of every graph (read from the live modules at each call), so a stored graph
serves any checkpoint of the same architecture; what a graph bakes in is in its
:func:`graph_identity`: the model's config (less what only buffers carry: the RoPE
factor and base), every parameter's shape and dtype, the device, torch and transformers, the
model's transformers source, tokenswift's own graph code, and the CPU's feature flags.
Anything else means another directory, hence a compile, never a wrong graph; a file
that fails to load (another torch, a truncated write) is compiled again and replaced.
A loaded graph checks its guards (input shapes, strides, dtypes, grad mode) at its first
call (:meth:`StoredGraph.refusal`) and is compiled afresh where they refuse.

``TOKENSWIFT_GRAPH_STORE=0`` turns the store off (every process compiles, as before).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch

from tokenswift.paths import cache_dir

logger = logging.getLogger(__name__)

STORE_ENV = "TOKENSWIFT_GRAPH_STORE"
# Bumped when what a stored graph is changes in a way its identity does not show
STORE_FORMAT = 1
# Config fields no graph reads: names, token ids, and what the rotary embedding keeps in
# buffers (inv_freq, attention_scaling: tokenswift.model.compiled.rope_scaling_as_input),
# so a RoPE factor not seen before finds its graphs stored
UNTRACED_CONFIG_FIELDS = frozenset({
    "_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "use_cache", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
})
# ... unless the RoPE type recomputes its frequencies from the sequence length in the forward
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
# tokenswift's modules whose code a graph traces or calls
GRAPH_SOURCES = ("compiled.py", "attention.py", "linear.py", "plan.py", "kv.py")


def enabled() -> bool:
    """Whether compiled graphs are stored and loaded (``TOKENSWIFT_GRAPH_STORE`` not "0")."""
    return os.environ.get(STORE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


_prepared = False


def prepare() -> float:
    """Import what loading a stored graph needs (torch's compiler stack), once per
    process; the seconds it took (0.0 after the first call). Timed apart from each
    graph's load (~0.8-1.2 s of a process's first one on a 2-core Zen 4), so that the
    graph loaded first does not look dearer than the others: what compiling costs a run
    is priced as this, once, plus each graph's own load."""
    global _prepared
    if _prepared:
        return 0.0
    started = time.perf_counter()
    import torch._dynamo.aot_compile  # noqa: F401
    import torch._functorch._aot_autograd.aot_autograd_result  # noqa: F401
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.output_code  # noqa: F401

    _prepared = True
    return time.perf_counter() - started


def prepared() -> bool:
    """:func:`prepare` has run in this process."""
    return _prepared


def store_root() -> Path:
    return cache_dir() / "graphs"


def _rope_type(config) -> str:
    scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    return str(scaling.get("rope_type") or scaling.get("type") or "default") if isinstance(scaling, dict) else "default"


def _config_identity(model: torch.nn.Module) -> dict:
    """The config fields a graph of ``model`` may bake in. The RoPE type and factor only
    where the type recomputes its frequencies from the length in the forward: every
    other type's rotary embedding runs the same code over its buffers (a 16K prompt with
    YaRN at a factor not seen before loads the graphs stored without it)."""
    config = getattr(model, "config", None)
    if config is None:
        return {"class": type(model).__qualname__}
    fields = config.to_dict()
    rope = _rope_type(config)
    if any(kind in rope for kind in LENGTH_DEPENDENT_ROPE):
        return {"rope_type": rope, **fields}
    return {k: v for k, v in fields.items() if k not in UNTRACED_CONFIG_FIELDS}


def file_digest(path: str | Path | None) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except (OSError, TypeError):
        return "unknown"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and ":" in line:
                return hashlib.sha256(" ".join(sorted(line.split(":", 1)[1].split())).encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor() or platform.machine()


def graph_identity(model: torch.nn.Module, *, options: dict) -> str:
    """The directory name of ``model``'s stored graphs compiled with ``options`` (what
    the caller's graphs depend on besides the model: products kind, wrapper, ...)."""
    import transformers

    parameter = next(model.parameters())
    here = Path(__file__).parent
    identity = {
        "format": STORE_FORMAT,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": _config_identity(model),
        # every parameter's name, shape and dtype: what a graph of the model's modules
        # (inputs whose guards are skipped) assumes of them (the buffers, the rotary
        # tables, follow the config; tokenswift.model.compiled.rope_scaling_as_input
        # adds one as it compiles, which must not change the identity)
        "parameters": hashlib.sha256(repr([
            (name, tuple(tensor.shape), str(tensor.dtype)) for name, tensor in model.named_parameters()
        ]).encode()).hexdigest()[:16],
        "model_source": file_digest(inspect.getsourcefile(type(model))),
        "dtype": str(parameter.dtype),
        "device": parameter.device.type,
        "cpu": _cpu_flags() if parameter.device.type == "cpu" else torch.cuda.get_device_name(parameter.device),
        "tokenswift": [file_digest(here / name) for name in GRAPH_SOURCES],
        "options": options,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:20]


def identity_dir(identity: str) -> Path:
    """Where the graphs of ``identity`` (:func:`graph_identity`) are stored."""
    return store_root() / identity


def graph_path(identity: str, name: str, tokens: int) -> Path:
    return identity_dir(identity) / f"{name}-{int(tokens)}.bin"


class RefusedGraph(RuntimeError):
    """A stored graph's guards refused its first inputs: it was removed from the store;
    the caller makes the graph again (compiled ahead of time and stored anew)."""


def _other_kind(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` that is a plain tensor if it is an inference tensor, and the other way round."""
    with torch.inference_mode(not tensor.is_inference()):
        return tensor.clone()


class StoredGraph:
    """A ``torch.compile``'d function (``compiled``, ``fullgraph=True``) stored at ``path``:
    loaded from it where a process before stored it (:meth:`load`), else compiled ahead
    of time at the first call and stored. ``external``: the modules its code closes over
    (the model's decoder, its LM head), named; they are this process's, never stored.
    Where compiling ahead of time fails, the graph compiles as ``torch.compile`` does
    (said once) and nothing is stored."""

    def __init__(self, compiled, path: Path, external: dict[str, object] | None = None) -> None:
        self.compiled = compiled
        self.path = path
        self.external = dict(external or {})
        self.fn = None  # the callable once loaded or compiled
        self.loaded = False  # fn came from the store
        self._checked = False  # a loaded fn's guards were checked at its first call

    @property
    def on_disk(self) -> bool:
        """Loaded, or stored for this process to load at the first call."""
        return self.loaded or (self.fn is None and self.path.exists())

    def load(self) -> bool:
        """Load the stored graph, if any (True: loaded). A file that does not load is removed."""
        if self.fn is not None or not self.path.exists():
            return self.loaded
        import torch._inductor.config  # imported by every compile already; not by eager runs

        try:
            # The graph's kernels were built and loaded on this machine when it was
            # stored: inductor's probes of which vector ISAs build and load (six
            # subprocesses, ~1.5 s of a process's first load on a 2-core Zen 4) are
            # skipped; the CPU's own flags still choose the ISA.
            with self.path.open("rb") as file, torch._inductor.config.patch({"cpp.vec_isa_ok": True}):
                self.fn = torch.compiler.load_compiled_function(file, external_data=self.external)
        except Exception as exc:  # another torch, a truncated file, ...: compile it again
            logger.warning("the stored graph %s did not load (%s: %s); compiling it again",
                           self.path, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self.path.unlink(missing_ok=True)
            return False
        self.loaded = True
        return True

    def __call__(self, *args):
        if self.fn is None and not self.load():
            self.fn = self._compile_and_store(args)
            if hasattr(self.fn, "disable_guard_check"):  # checked as it was traced from these inputs
                self.fn.disable_guard_check()
        elif self.loaded and not self._checked:
            refused = self.refusal(args)
            if refused is not None:  # stored for other inputs than these: not this process's graph
                logger.warning("the stored graph %s does not take these inputs (%s); compiling it again",
                               self.path, refused[:300])
                self.path.unlink(missing_ok=True)
                self.fn, self.loaded = None, False
                raise RefusedGraph(refused)
            self._checked = True
            self.fn.disable_guard_check()
        return self.fn(*args)

    def refusal(self, args: tuple) -> str | None:
        """Why the loaded graph's guards (shapes, strides, dtypes, grad mode) refuse
        ``args``; None: they take them. Checked once, at its first call: a graph's later
        calls come from the same call site, with the same kinds of tensors (sizes
        within the range a graph of several sizes was traced for: compiled.TREE_TOKENS),
        and checking each call in Python costs more than the C++ guards of a graph
        compiled in the process. Whether a tensor is an inference tensor is not held
        against it: torch 2.13 stores some inference tensors' guards as plain tensors'
        (the graph computes the same for either)."""
        f_locals = self.fn.prepare_f_locals(*args)
        manager = self.fn._artifacts.guard_manager
        flipped = set()
        while not manager.check(f_locals):
            parts = manager.check_verbose(f_locals).verbose_code_parts
            match = re.search(r"tensor 'L\['(\w+)'\]' dispatch key set mismatch", " ".join(parts))
            name = match.group(1) if match else None
            if name is None or name in flipped or not isinstance(f_locals.get(name), torch.Tensor):
                return "; ".join(parts) or "guards failed"
            flipped.add(name)
            f_locals[name] = _other_kind(f_locals[name])
        return None

    def _compile_and_store(self, args: tuple):
        try:
            fn = self.compiled.aot_compile((args, {}))
        except Exception as exc:  # torch.compile may still work where this does not
            logger.warning("compiling %s ahead of time failed (%s: %s); compiling it for this process only",
                           self.path.name, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return self.compiled
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fn.save_compiled_function(str(self.path), external_data=self.external)
        except Exception as exc:
            logger.warning("could not store the compiled graph %s (%s: %s)", self.path, type(exc).__name__, exc)
            self.path.unlink(missing_ok=True)
        return fn
