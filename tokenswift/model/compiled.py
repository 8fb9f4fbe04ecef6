"""Compiled one-token forwards: the same model, without eager PyTorch's cost per operator.

A one-token forward of SmolLM2-135M in eager PyTorch runs ~1,000 operators, and on a
2-core CPU their fixed costs (Python in transformers, dispatch, small kernels) take about
as long as streaming the weights. :class:`CompiledForward` traces the decoder once with
``torch.compile`` (inductor: fused C++ loops on a CPU, Triton on CUDA) for one new
token, with static shapes:

* the KV store stays outside the graph: each layer's attention is the opaque operator
  ``tokenswift::attend`` (:mod:`tokenswift.model.attention`), which writes the new
  keys/values where the forward's view says and attends in eager code. So the graph
  depends on nothing but the token count, every cache policy's view and the attention
  recorder work unchanged, and the context length never recompiles anything;
* on a CPU, every one-row linear product is traced as a multiply-and-sum in float32
  (:class:`OneRowProducts`): inductor fuses it into one pass over the weight at memory
  speed, where the BLAS kernel for one row of bfloat16 is compute-bound on CPUs without
  native bfloat16 (measured on a 2-core AMD EPYC, all 211 products of a step: 12.6 ms
  against 18.8 ms);
* the LM head's row is compiled likewise (:meth:`CompiledForward.logits`).

The compiled graph computes the same function in another order of operations, so its
results differ from eager ones by rounding only (float32 logits within 1e-4 in the
tests). Tree verify forwards can run compiled too, at a few padded sizes (each a graph
of its own; :meth:`tokenswift.model.runner.Runner.use_compiled_trees`); prompt chunks
stay eager. For the decoders whose layers are all alike (:func:`layered_problem`),
a tree size's graph, and the one-token graph of a run too short to repay the whole
decoder's, is one of a *run of layers* (:class:`LayeredForward`), traced once and called
for every run of the stack: tracing and compiling it costs a fifth of the whole
decoder's, so a run can afford the trees it verifies. Whether a run
compiles is decided in :mod:`tokenswift.compiling`; compiling the demo model takes ~2
minutes the first time on the 2-core CPU and ~15 s once inductor's cache (kept under
``$TOKENSWIFT_CACHE/inductor``) holds the kernels. ``docs/compiled.md`` has the measurements.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import time
import types
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tokenswift import compile_costs
from tokenswift.model import graph_store
from tokenswift.model.attention import layers_from
from tokenswift.model.linear import KernelLinears, linear_arguments
from tokenswift.model.plan import EXTERNAL_KV_KWARG
from tokenswift.paths import cache_dir

logger = logging.getLogger(__name__)


class CompileUnavailable(RuntimeError):
    """torch.compile cannot run here (no C++ compiler, an unsupported model, ...)."""


class OneRowProducts(TorchFunctionMode):
    """While tracing: ``F.linear`` of a single row as ``(x * W).sum(-1)`` accumulated in
    float32 (float64 for float64 models), cast back to the input's dtype as the product
    would be. Other linears are left alone."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = linear_arguments(args, kwargs)
            if x.dim() >= 1 and x.numel() == x.shape[-1]:
                wide = torch.float64 if x.dtype == torch.float64 else torch.float32
                out = (x.reshape(1, -1).to(wide) * weight.to(wide)).sum(-1)  # [out_features]
                if bias is not None:
                    out = out + bias.to(wide)
                return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)


def compiler_problem(device: torch.device) -> str | None:
    """Why torch.compile cannot run on ``device`` here (None: it can)."""
    if device.type == "cpu":
        compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
        if compiler is None:
            return "no C++ compiler (g++, c++ or clang++) on PATH; inductor needs one for CPU code"
        return None
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed; inductor needs it for CUDA code"
        return None
    return f"compiled forwards are not supported on {device.type}"


def rope_scaling_as_input(model: torch.nn.Module) -> int:
    """Make every rotary embedding's ``attention_scaling`` (a Python float: 1.0, or
    YaRN's ``0.1 ln(factor) + 1``) a 0-d float32 buffer, so a compiled graph reads it
    as an input, like ``inv_freq``, instead of baking it in as a constant: a RoPE factor
    not seen before then finds every graph in inductor's cache. (A new factor compiled
    every graph cold: ~75 s a tree size on a 2-core Sapphire Rapids, in the middle of a
    16K-prompt run.) The product is the same: the rotary angles are float32 and a float
    scalar multiplies a float32 tensor in float32. Returns how many modules it changed."""
    changed = 0
    for module in model.modules():
        scaling = getattr(module, "attention_scaling", None)
        if isinstance(scaling, (int, float)) and not isinstance(scaling, bool) and hasattr(module, "inv_freq"):
            del module.attention_scaling
            device = module.inv_freq.device
            module.register_buffer("attention_scaling", torch.tensor(float(scaling), dtype=torch.float32, device=device),
                                   persistent=False)
            changed += 1
    return changed


def use_inductor_cache() -> None:
    """Keep inductor's compiled kernels under ``$TOKENSWIFT_CACHE/inductor`` (unless the
    user chose a place with ``TORCHINDUCTOR_CACHE_DIR``), so later processes reuse them."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


# Graphs of a run of layers cover this share of the stack: a fifth (:func:`layer_run_length`).
LAYER_RUNS = 5
# Decoders whose forward is embed_tokens -> rotary_emb -> layers -> norm and nothing
# else (no embedding scale, no per-layer attention kinds), so that LayeredForward computes
# what the model's own forward does.
LAYERED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def layer_run_length(layers: int) -> int:
    """The layers of one run: the smallest divisor of ``layers`` that is at least
    ``layers / LAYER_RUNS`` (30 layers: runs of 6), so every run is alike and one graph
    serves them all."""
    least = max(1, -(-layers // LAYER_RUNS))
    return next(size for size in range(least, layers + 1) if layers % size == 0)


def layered_problem(model: torch.nn.Module, decoder: torch.nn.Module) -> str | None:
    """Why ``decoder``'s forwards cannot be compiled a run of layers at a time (None: they can)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in LAYERED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {LAYERED_MODEL_TYPES}"
    if not all(hasattr(decoder, name) for name in ("embed_tokens", "rotary_emb", "layers", "norm")):
        return "the decoder lacks embed_tokens, rotary_emb, layers or norm"
    if len({type(layer) for layer in decoder.layers}) != 1:
        return "the decoder's layers are not all of one class"
    kinds = getattr(config, "layer_types", None)
    if kinds is not None and len(set(kinds)) > 1:
        return f"the layers attend in several ways ({sorted(set(kinds))})"
    return None


def serializable_guards(guard_filter):
    """``guard_filter`` less the guards a stored graph cannot keep: those
    :data:`CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES` names, and those on
    module globals (checked against the globals of the process that traced it, where
    Dynamo had added entries a later process lacks; the graph store's identity covers
    the code those globals belong to instead)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES

    def serializable(entries) -> list[bool]:
        keep = guard_filter(entries)
        return [kept and not entry.is_global and entry.guard_type not in unsupported for entry, kept in zip(entries, keep)]

    return serializable


def _skip_module_and_global_guards(entries) -> list[bool]:
    """The guard filter of a run-of-layers graph: no guards on the model's modules (as
    every graph here) nor on module globals (~300 checks of the kernels' and
    transformers' module constants, at each of a step's five calls: ~0.8 ms a step of
    SmolLM2 on a 2-core AMD EPYC Zen 4). Its inputs' and the grad mode's guards stay."""
    keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    return [kept and not entry.is_global for entry, kept in zip(entries, keep)]


# The token counts one graph of a run of layers verifies trees of (traced with the count
# symbolic: LayeredForward.tokens): every padded tree size (tokenswift.compiling.TREE_SIZES)
# and no more rows than the few-rows kernel takes. On a 2-core AMD EPYC Zen 4 (SmolLM2,
# 2K positions, in turns) it compiled in 1.8 s warm against 1.0 s for a graph of one size,
# and its 4- and 8-token forwards took what those of one size did (15.7-16.2 / 18.5-19.6
# ms against 15.5-15.9 / 18.7-19.3): a run that verifies two sizes or more compiles less.
TREE_TOKENS = (2, 32)
# The compile ledger's name for what loading the first stored graph of a process costs
# besides the graph (graph_store.prepare)
STORE_IMPORTS = "store-imports"
# The size under which the compile ledger and the ready graphs note a graph of every size
ANY_SIZE = 0


def tokens_symbolic(graph, tensors, tokens: tuple[int, int]) -> None:
    """Before ``graph``'s first call: its token count (dimension 1 of ``tensors``)
    traced symbolic over ``tokens`` (least, most), so that the call's count stands for
    every one in range; nothing where the graph loads from the store (traced by the
    process that stored it)."""
    if hasattr(graph, "load") and graph.load():
        return
    least, most = tokens
    for tensor in tensors:
        torch._dynamo.mark_dynamic(tensor, 1, min=least, max=most)


class LayeredForward:
    """A forward of n new tokens as the decoder computes it, its layers in runs of
    :func:`layer_run_length`, each run one call of one compiled graph (the run's modules
    are its inputs: every run is the same code over other weights); the embedding, the
    rotary angles and the final norm, a few operations, run eagerly around them.

    A graph bakes in the layer indices of the run it was traced on (torch.compile
    specialises a module's int attributes), so each run's call says which layers it
    is (:func:`tokenswift.model.attention.layers_from`) and ``tokenswift::attend``
    joins the KV of those, in the order the graph attends."""

    def __init__(self, decoder: torch.nn.Module, graph, tokens: tuple[int, int] | None = None) -> None:
        self.decoder = decoder
        size = layer_run_length(len(decoder.layers))
        self.runs = [(i, tuple(decoder.layers[i : i + size])) for i in range(0, len(decoder.layers), size)]
        self.graph = graph
        # (least, most) new tokens one graph serves (traced with the token count
        # symbolic), or None: the graph is of the count it was first called with
        self.tokens = tokens
        self._traced = tokens is None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [1, n] long -> [n, hidden_size] final-norm hidden states
        decoder = self.decoder
        hidden = decoder.embed_tokens(input_ids)  # [1, n, hidden_size]
        cos, sin = decoder.rotary_emb(hidden, positions)
        if not self._traced:
            tokens_symbolic(self.graph, (hidden, cos, sin, positions), self.tokens)
        for first, layers in self.runs:
            with layers_from(first):
                hidden = self.graph(layers, hidden, cos, sin, positions)
        self._traced = True
        return decoder.norm(hidden)[0]


class SymbolicTokens:
    """The whole decoder's graph of every tree size (:data:`TREE_TOKENS`): traced at its
    first call with the token count symbolic (unless it loads from the graph store,
    traced by the process that stored it). Called as the graph: the decoder's modules,
    then input_ids and positions, [1, n] long."""

    def __init__(self, graph) -> None:
        self.graph = graph
        self._traced = False

    def __call__(self, *args):
        if not self._traced:
            tokens_symbolic(self.graph, args[-2:], TREE_TOKENS)  # input_ids, positions
        out = self.graph(*args)
        self._traced = True
        return out


def store_identity(model: torch.nn.Module, logits_dtype: torch.dtype, kernel_linears: bool) -> str | None:
    """The graph store's name for the graphs :class:`CompiledForward` compiles of
    ``model`` so (None: the store is off)."""
    if not graph_store.enabled():
        return None
    device = next(model.parameters()).device
    options = {"kernel_linears": bool(kernel_linears), "one_row": device.type == "cpu", "cpp_wrapper": device.type == "cpu",
               "logits_dtype": str(logits_dtype), "tree_tokens": TREE_TOKENS, "layer_runs": LAYER_RUNS}
    return graph_store.graph_identity(model, options=options)


def stored_graph(model: torch.nn.Module, logits_dtype: torch.dtype, kernel_linears: bool, name: str, tokens: int) -> bool:
    """Graph ``name`` of ``tokens`` new tokens (:meth:`CompiledForward.graph_tokens`) of
    ``model`` is in the graph store: a process loads it in milliseconds."""
    identity = store_identity(model, logits_dtype, kernel_linears)
    return identity is not None and graph_store.graph_path(identity, name, tokens).exists()


class CompiledForward:
    """The compiled one-token forward and LM-head row of one model (shared by every
    runner of the model: :meth:`for_model`). Compiles on first call."""

    def __init__(
        self, model: torch.nn.Module, decoder: torch.nn.Module, lm_head: torch.nn.Module, logits_dtype: torch.dtype,
        kernel_linears: bool = False,
    ) -> None:
        device = next(model.parameters()).device
        problem = compiler_problem(device)
        if problem is not None:
            raise CompileUnavailable(problem)
        use_inductor_cache()
        rope_scaling_as_input(model)
        one_row = device.type == "cpu"
        mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
        self.kernel_linears = kernel_linears

        def products():
            # kernel_linears: every product of a few rows is tokenswift's operator
            # (tokenswift.model.linear.KernelLinears), an opaque call in the graph
            if kernel_linears:
                return KernelLinears()
            return OneRowProducts() if one_row else contextlib.nullcontext()

        def forward(decoder, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            # input_ids, positions: [1, n] long -> [n, hidden_size] final-norm hidden states
            # (one graph per n: one token, or a padded tree size). The modules of every
            # graph are its inputs, not closed over, so that a stored graph
            # (graph_store) is called with the modules of the process that loads it.
            with products():
                out = decoder(
                    input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False,
                    **{EXTERNAL_KV_KWARG: True},
                )
            return out.last_hidden_state[0]

        def run_of_layers(layers, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor):
            # a run of alike decoder layers (LayeredForward): hidden [1, n, hidden_size] -> the same
            with products():
                for layer in layers:
                    out = layer(
                        hidden, attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin),
                        use_cache=False, **{EXTERNAL_KV_KWARG: True},
                    )
                    hidden = out[0] if isinstance(out, tuple) else out
            return hidden

        def stack(embed, rotary, norm, layers, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            # the decoder's forward as LayeredForward computes it, all in one graph: the
            # whole decoder's graph where the layers allow (layered_problem), whose
            # modules are all inputs (the model's own forward guards the key order of its
            # layers' dict, which a stored graph cannot rebuild in a later process)
            hidden = embed(input_ids)  # [1, n, hidden_size]
            cos, sin = rotary(hidden, positions)
            return norm(run_of_layers(layers, hidden, cos, sin, positions))[0]

        def logits(lm_head, hidden: torch.Tensor) -> torch.Tensor:
            # hidden: [1, hidden_size] -> [1, vocab] in logits_dtype
            with products():
                return lm_head(hidden).to(logits_dtype)

        options = {
            # The model's modules and parameters are fixed for the life of this object
            # (whose functions are its own: see own_code), so checking them on every
            # call, ~1 ms a step on a small CPU, is skipped.
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
            # A C++ wrapper calls the ~500 kernels of a step without Python in between.
            "cpp_wrapper": device.type == "cpu",
        }
        # a copy each time: torch.compile pops "guard_filter_fn" out of the options it is
        # given, so a second graph compiled from the same dict checked every module's
        # guards (5,000 of them: 1.2 ms a call for the tree graphs, a 2-core AMD EPYC Zen 4)
        # Graphs are stored on disk once compiled and loaded by later processes
        # (tokenswift.model.graph_store), where the store is on; a stored graph keeps
        # no guard that cannot be serialized (on the identity of this object's own
        # closures and functions, which its identity covers instead).
        self.layered_problem = layered_problem(model, decoder)
        self.store_identity = store_identity(model, logits_dtype, kernel_linears) if self.layered_problem is None else None

        def compile_fn(fn, guards=options["guard_filter_fn"]):
            if self.store_identity is not None:
                guards = serializable_guards(guards)
            return torch.compile(own_code(fn), dynamic=False, fullgraph=True, options={**options, "guard_filter_fn": guards})

        self._compile = compile_fn
        self._forward = forward if self.layered_problem is not None else stack
        self._run_of_layers = run_of_layers
        self._decoder = decoder
        # the modules the whole decoder's graphs and the head's take before their tensors
        self._decoder_modules = (
            (decoder,) if self.layered_problem is not None
            else (decoder.embed_tokens, decoder.rotary_emb, decoder.norm, tuple(decoder.layers))
        )
        self._head_modules = (lm_head,)
        # Graphs of a run of layers where the decoder allows (LayeredForward): on a
        # 2-core AMD EPYC Zen 4, SmolLM2's tree graphs compiled in ~1 s with inductor's
        # cache warm and ~7-8 s cold, against ~5 s and ~85-94 s for the whole decoder's,
        # and ran 0.7-1.0 ms (~5%) slower (4- and 8-token trees at 2K positions, in turns:
        # Dynamo's prologue and wrapper, ~170 us at each of a forward's five calls).
        # Whether tree forwards, and one-token forwards, run through graphs of a run of
        # layers (where the decoder allows) or of the whole decoder: the run decides
        # (tokenswift.compiling.decide).
        self.layered_trees = True
        self.layered_steps = False
        # Whether the layered tree graph is one for every size (TREE_TOKENS) or one per
        # size (where tracing with the token count symbolic failed: said once)
        self.one_tree_graph = True
        self._graphs = {
            "forward": self._stored(self._compile(self._forward), "forward", 1),
            "logits": self._stored(self._compile(logits), "logits", 1),
        }
        # Trees: the same forward, one code object per padded size (made at its first
        # call), each holding one graph: no recompile limit to raise, and a call's cache
        # lookup checks that graph's guards only. (Inductor's "freezing", weights packed once for
        # oneDNN, measured no clear gain on Sapphire Rapids: 4 / 8 / 16 / 32 tokens 43.1
        # / 46.5 / 51.7 / 60.3 ms frozen against 40.1 / 48.5 / 48.0 / 68.9 not, single
        # runs, bfloat16, 2K positions.)
        self._sized_graphs: dict[tuple[str, int], object] = {}  # (graph name, new tokens) -> its forward, made at its first call
        self._ready: set[tuple[str, int]] = set()  # (graph, new tokens) compiled
        self.compile_seconds = 0.0  # what compiling the graphs took (first calls)
        self.graph_seconds: dict[tuple[str, int], float] = {}  # (graph, new tokens) -> its compile's seconds
        # the machine key under which compiles are noted in the compile ledger
        # (:mod:`tokenswift.compile_costs`; set by :func:`tokenswift.compiling.decide`), None: not noted
        self.ledger_machine: str | None = None
        self.failure: CompileUnavailable | None = None  # why compiling failed, once it has
        self.device = device

    @classmethod
    def for_model(cls, model: torch.nn.Module, decoder, lm_head, logits_dtype, kernel_linears: bool = False) -> CompiledForward:
        graphs = _COMPILED.setdefault(model, {})
        compiled = graphs.get(kernel_linears)
        if compiled is None:
            compiled = graphs[kernel_linears] = cls(model, decoder, lm_head, logits_dtype, kernel_linears)
        return compiled

    @classmethod
    def ready_for(cls, model: torch.nn.Module) -> bool:
        """``model``'s graphs are compiled in this process already."""
        return any(compiled.compiled for compiled in _COMPILED.get(model, {}).values())

    @property
    def compiled(self) -> bool:
        """Both one-token graphs have been compiled (the forward of either kind)."""
        return ("logits", 1) in self._ready and bool({("forward", 1), ("layered-forward", 1)} & self._ready)

    @property
    def step_graph_name(self) -> str:
        """Which graph one-token forwards run through now, by its name in the compile
        ledger: ``"layered-forward"`` (a run of layers' graph, where the decoder allows
        and :attr:`layered_steps` asks) or ``"forward"`` (the whole decoder's)."""
        return "layered-forward" if self.layered_steps and self.layered_problem is None else "forward"

    @property
    def tree_graph_name(self) -> str:
        """Which tree graphs verify forwards run through now, by their name in the
        compile ledger: ``"layered-tree"`` (a run of layers' graph, where the decoder
        allows and :attr:`layered_trees` asks) or ``"tree"`` (the whole decoder's)."""
        return "layered-tree" if self.layered_trees and self.layered_problem is None else "tree"

    def _sized_graph(self, name: str, tokens: int):
        """A forward of ``tokens`` new tokens (:data:`ANY_SIZE`: of every tree size): a
        run of layers' graph over every run, or the whole decoder's."""
        if name.startswith("layered-"):
            graph = self._stored(self._compile(self._run_of_layers, _skip_module_and_global_guards), name, tokens)
            return LayeredForward(self._decoder, graph, TREE_TOKENS if tokens == ANY_SIZE else None)
        graph = self._stored(self._compile(self._forward), name, tokens)
        return SymbolicTokens(graph) if tokens == ANY_SIZE else graph

    def _stored(self, compiled, name: str, tokens: int):
        """``compiled`` as a graph of the store (loaded at its first call, inside the
        compile time a run counts, where stored), or as it is where the store is off."""
        if self.store_identity is None:
            return compiled
        return graph_store.StoredGraph(compiled, graph_store.graph_path(self.store_identity, name, tokens))

    def _count_compile(self, seconds: float) -> None:
        """Count ``seconds`` spent compiling outside a graph's first call (the graph
        store's imports): in this model's compile seconds and the process's."""
        global _compiling_seconds
        self.compile_seconds += seconds
        _compiling_seconds += seconds
        if seconds > 0 and self.ledger_machine is not None:
            compile_costs.record(compile_costs.graph_key(self.ledger_machine, STORE_IMPORTS, 0), seconds, True, stored=True)

    def stored(self, name: str, tokens: int) -> bool:
        """Graph ``name`` of ``tokens`` new tokens (:meth:`graph_tokens`) is in the store
        (or was loaded from it in this process)."""
        return self.store_identity is not None and graph_store.graph_path(self.store_identity, name, tokens).exists()

    def ready(self, name: str, tokens: int) -> bool:
        """Graph ``name`` of ``tokens`` new tokens (:meth:`graph_tokens`) has been
        compiled or loaded in this process."""
        return (name, tokens) in self._ready

    def graph_tokens(self, name: str, tokens: int) -> int:
        """The size under which graph ``name``'s forward of ``tokens`` new tokens is
        compiled and noted in the ledger: :data:`ANY_SIZE` where one graph serves every
        tree size (:data:`TREE_TOKENS`), else ``tokens``."""
        if name in ("layered-tree", "tree") and self.one_tree_graph and TREE_TOKENS[0] <= tokens <= TREE_TOKENS[1]:
            return ANY_SIZE
        return tokens

    def has_tree_graph(self, tokens: int) -> bool:
        """The forward of ``tokens`` (> 1) new tokens has been compiled in this process
        (as the tree graphs now in use: :attr:`tree_graph_name`)."""
        name = self.tree_graph_name
        return (name, self.graph_tokens(name, tokens)) in self._ready

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [1, n] long; the caller makes the plan active
        (:func:`tokenswift.model.attention.attending`). Returns [n, hidden_size]. Each
        n is a graph of its own, compiled at its first call."""
        return self._call(self.step_graph_name if input_ids.shape[-1] == 1 else self.tree_graph_name, input_ids, positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [1, hidden_size] final-norm state -> [1, vocab] logits."""
        return self._call("logits", hidden)

    def _call(self, name: str, *args) -> torch.Tensor:
        key = (name, self.graph_tokens(name, args[0].shape[-1]) if name != "logits" else 1)
        graph = self._graphs.get(name) or self._sized_graphs.get(key)
        if graph is None:  # a tree size, or a run of layers' one-token forward
            graph = self._sized_graphs[key] = self._sized_graph(name, key[1])
        tensors = args
        if not name.startswith("layered-"):  # the whole decoder's graphs and the head's take their modules first
            args = (*(self._head_modules if name == "logits" else self._decoder_modules), *args)
        if key in self._ready:
            return graph(*args)
        if self.failure is not None:
            raise self.failure
        stored = bool(getattr(graph, "on_disk", False) or getattr(getattr(graph, "graph", None), "on_disk", False))
        if stored:
            pass  # loaded from the store at this call, said below
        elif not self._ready:  # said once: the wait is the first step's
            logger.warning("compiling the one-token forward (once per process: seconds with inductor's cache warm, "
                           "up to ~2 minutes cold on a small CPU)")
        elif key[1] == ANY_SIZE:
            logger.warning("compiling the tree forward of %d-%d tokens (once per process)", *TREE_TOKENS)
        elif key[1] > 1:
            logger.warning("compiling the %d-token tree forward (once per process and size)", key[1])
        if stored:  # the compiler stack's imports, once a process: counted, but not as this graph's load
            self._count_compile(graph_store.prepare())
        hits, misses = compile_costs.cache_counts()
        try:
            out, seconds = first_compiled_call(graph, args)
        except graph_store.RefusedGraph:  # made again, compiled this time
            self._sized_graphs.pop(key, None)
            return self._call(name, *tensors)
        except CompileUnavailable as exc:
            if key[1] == ANY_SIZE:  # a graph per size instead
                logger.warning("tree forwards compile a graph per size: %s", exc)
                self.one_tree_graph = False
                del self._sized_graphs[key]
                return self._call(name, *tensors)
            self.failure = exc
            raise
        self.compile_seconds += seconds
        self.graph_seconds[key] = seconds
        self._ready.add(key)
        # loaded, as it was on disk (a file that did not load was compiled after all)
        stored = bool(getattr(graph, "loaded", False) or getattr(getattr(graph, "graph", None), "loaded", False))
        if self.ledger_machine is not None:
            now_hits, now_misses = compile_costs.cache_counts()
            warm = now_hits > hits and now_misses == misses
            compile_costs.record(compile_costs.graph_key(self.ledger_machine, name, key[1]), seconds, warm,
                                 stored=stored)
        what = f"{TREE_TOKENS[0]}-{TREE_TOKENS[1]}-token tree forward" if key[1] == ANY_SIZE else (
            f"{key[1]}-token {'forward' if key[1] > 1 else name}")
        logger.info("%s the %s in %.2f s", "loaded the stored graph of" if stored else "compiled", what, seconds)
        return out


_compiling_seconds = 0.0  # what every first compiled call of this process took


def compiling_seconds() -> float:
    """The seconds this process has spent in first compiled calls so far (a clock that
    only moves while compiling): what a step took less what compiling took in it is
    what the step would take again."""
    return _compiling_seconds


def first_compiled_call(graph, args: tuple, what: str = "") -> tuple[object, float]:
    """Call ``graph`` for the first time (it compiles now): its output and the seconds
    it took. A failure raises :class:`CompileUnavailable` naming ``what`` was compiled."""
    global _compiling_seconds
    started = time.perf_counter()
    try:
        out = graph(*args)
    except graph_store.RefusedGraph:  # the caller makes it again
        raise
    except Exception as exc:  # inductor fails in many ways; each means "no compiled path here"
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        raise CompileUnavailable(f"torch.compile{what} failed: {type(exc).__name__}: {first_line}") from exc
    finally:
        seconds = time.perf_counter() - started
        _compiling_seconds += seconds
    return out, seconds


_copies = itertools.count()


def own_code(fn):
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs per code
    object and, with the module guards skipped, would hand one model's graph to another
    model's closure of the same function."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_copies)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {kernel_linears: CompiledForward}
