"""The runner: forwards of an unmodified transformers causal LM over a preallocated KV store.

Every forward is a set of new tokens with a boolean ``tree_mask`` among themselves
(causal for a prompt chunk, ancestor-or-self for a token tree) and per-token
``depths``; token i sits at position ``committed_length + depths[i]`` and attends to
all committed positions (or to a :class:`~tokenswift.model.kv.KVView` of them) plus
the new tokens its row of ``tree_mask`` allows.

A verify forward (``view=None``) stages the new tokens' keys/values after the
committed ones; :meth:`Runner.commit` keeps a chosen subset, compacted in place. A
forward over a view (drafting) leaves the committed KV untouched. Where keys and values
go is decided in :mod:`tokenswift.model.kv` alone.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time

import attrs
import torch

from tokenswift import kernels
from tokenswift.distributed import tensor_parallel_size
from tokenswift.model.attention import attending, register_attention
from tokenswift.model.compiled import ANY_SIZE, CompiledForward, CompileUnavailable
from tokenswift.model.configs import text_config
from tokenswift.model.hf_cache import StoreCache
from tokenswift.model.kv import KVStore, KVView, Staging
from tokenswift.model.linear import KernelLinears, PackedLinears, packing_available
from tokenswift.model.plan import PLAN_KWARG, AttentionRecorder, ForwardPlan
from tokenswift.stats import model_time

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True, eq=False, repr=False)
class ForwardOutput:
    """logits: [m, vocab] for the rows asked for (float32, or float64 for float64 models);
    hidden: [m, hidden_size], the final-norm hidden states of the same rows;
    attention: with ``record_attention``, per layer the last query's attention
    probabilities per KV head, [kv_heads, K] float32; features: with ``layers``, the
    same rows' :func:`features` [m, (len(layers) + 1) * hidden_size] (else ``hidden``)."""

    logits: torch.Tensor | None
    hidden: torch.Tensor
    attention: dict[int, torch.Tensor] | None = None
    layer_states: torch.Tensor | None = None  # [m, len(layers) * hidden_size]

    @property
    def features(self) -> torch.Tensor:
        return features(self.layer_states, self.hidden)

    def __repr__(self) -> str:
        shape = None if self.logits is None else tuple(self.logits.shape)
        return f"ForwardOutput(logits={shape}, hidden={tuple(self.hidden.shape)})"


@attrs.frozen(kw_only=True, eq=False, repr=False)
class PrefilledPrompt:
    """A prompt's prefill, kept to start several runs from it without computing it again
    (the long-context benchmark: one 16K-token prefill for every method).

    tokens: the prompt ids, whose first ``len(tokens) - 1`` positions are prefilled (the
    last token is the first step's root); keys/values: per layer [1, kv_heads, P, D]
    copies of those positions; hidden: [m, hidden_size], the final-norm hidden states of
    the last m of them, preceded by the outputs of decoder ``layers`` (:func:`features`);
    model: the model they were computed with.
    """

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hidden: torch.Tensor | None
    model: torch.nn.Module
    seconds: float
    layers: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return f"PrefilledPrompt(tokens={len(self.tokens)}, hidden={None if self.hidden is None else tuple(self.hidden.shape)})"

    @property
    def positions(self) -> int:
        return len(self.tokens) - 1


def features(layer_states: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    """What a drafter reads of the target at a position: the outputs of some decoder
    layers (``layer_states`` [m, L * hidden_size], transformers' ``hidden_states[k]``
    for each chosen k, in order; None for none) followed by the final-norm hidden state
    (``hidden`` [m, hidden_size]): [m, (L + 1) * hidden_size]."""
    return hidden if layer_states is None else torch.cat([layer_states, hidden], -1)


def select_features(rows: torch.Tensor, have: tuple[int, ...], want: tuple[int, ...]) -> torch.Tensor:
    """rows: [m, (len(have) + 1) * H] features of layers ``have`` -> those of ``want``
    (each of which ``have`` holds)."""
    if have == want:
        return rows
    missing = [k for k in want if k not in have]
    if missing:
        raise ValueError(f"the features hold layers {list(have)}, not {missing}")
    size = rows.shape[-1] // (len(have) + 1)
    blocks = rows.view(*rows.shape[:-1], len(have) + 1, size)
    return blocks[..., [have.index(k) for k in want] + [len(have)], :].flatten(-2)


def causal_mask(n: int, device=None) -> torch.Tensor:
    """[n, n] bool lower-triangular mask."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


class Runner:
    """Owns the KV store of one model and runs forwards over it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        config = text_config(model)
        self.config = config
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        if self.decoder is None or self.lm_head is None:
            raise ValueError(f"{type(model).__name__} has no decoder / output embeddings; a causal LM is required")
        self.num_layers = config.num_hidden_layers
        # Under tensor parallelism each rank holds (and caches) its own share of KV heads.
        self.tp_size = tensor_parallel_size(model)
        self.kv_heads = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) // self.tp_size
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.vocab_size = self.lm_head.weight.shape[0]
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.logits_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        self._sliding_window = self._active_sliding_window(config)
        model.set_attn_implementation(register_attention())
        self.store: KVStore | None = None
        self.cache: StoreCache | None = None
        self.packed_linears: PackedLinears | None = None  # see use_packed_linears
        self.packed_from_rows: int | None = None
        self.packed_lm_head = False
        self.compiled: CompiledForward | None = None  # see use_compiled
        # The [model] spec section a fresh process loads this same model from (set by
        # Pipeline.from_spec for a model it loaded from a path; None: a model passed in).
        # The first calibrations run in such a process (tokenswift.calibrate_apart).
        self.source: dict | None = None
        self.compiled_tree_sizes: tuple[int, ...] = ()  # see use_compiled_trees
        # while set (tokenswift.compiling.TreeTrial), tree forwards whose graph is not
        # compiled yet run eagerly, priced as compiled: the run's first speculative steps
        # decide whether compiling them pays
        self.tree_trial = None
        self.prefill_dtype = self.dtype  # see use_prefill_dtype
        self.prefill_min_tokens = 0
        self.kernel_linears = False  # see use_kernel_linears
        self.use_kernel_linears(self.tp_size == 1 and kernels.linears_by_default(self.dtype, self.device))

    # -- how products are computed -------------------------------------------------

    @property
    def can_pack_linears(self) -> bool:
        return self.tp_size == 1 and packing_available(self.dtype, self.device)

    def use_packed_linears(self, from_rows: int | None, lm_head: bool = False) -> None:
        """Run the model's linear layers through oneDNN packed weights (a copy of the
        weights, shared by every runner of the model; see :mod:`tokenswift.model.linear`)
        in forwards of at least ``from_rows`` tokens (None: never), and the LM head
        (``lm_head``) whatever the rows."""
        if (from_rows is not None or lm_head) and self.packed_linears is None:
            if not self.can_pack_linears:
                raise ValueError(f"packed linears need a float32 model on a CPU with oneDNN, not {self.dtype} on {self.device}")
            self.packed_linears = PackedLinears.for_model(self.model)
        self.packed_from_rows = from_rows
        self.packed_lm_head = lm_head

    def packed_bytes(self) -> int:
        """Bytes the few-rows kernel's packed weight copies of this model will take, less
        the copies the kernel holds already (of any model: an estimate for a process with
        one model); 0 where its products are not the kernel's or it packs none
        (:func:`tokenswift.kernels.packed_size`)."""
        if not self.kernel_linears:
            return 0
        weights = {id(m.weight): m.weight for m in self.model.modules() if isinstance(m, torch.nn.Linear)}
        weights[id(self.lm_head.weight)] = self.lm_head.weight
        return max(0, sum(kernels.packed_size(w) for w in weights.values()) - kernels.packed_weight_bytes())

    def use_kernel_linears(self, on: bool) -> None:
        """Run products of up to :data:`tokenswift.kernels.MAX_LINEAR_ROWS` rows (one-token
        steps, trees, LM-head rows; eager and compiled) through tokenswift's few-rows
        kernel (:class:`~tokenswift.model.linear.KernelLinears`) or not. The default is
        :func:`tokenswift.kernels.linears_by_default`. Set it before :meth:`use_compiled`:
        the compiled graphs are made for one setting."""
        if on and not kernels.available():
            raise ValueError("the few-rows linear kernel is not available here (see tokenswift.kernels)")
        if on and self.tp_size != 1:
            raise ValueError("the few-rows linear kernel is not supported under tensor parallelism")
        self.kernel_linears = bool(on)
        if self.compiled is not None and self.compiled.kernel_linears != self.kernel_linears:
            self.use_compiled(True)

    def use_compiled(self, on: bool) -> CompiledForward | None:
        """Run one-token forwards and LM-head rows through the model's compiled graphs
        (:mod:`tokenswift.model.compiled`; compiled on first use) or not. Raises
        :class:`~tokenswift.model.compiled.CompileUnavailable` where torch.compile
        cannot run."""
        if on and self.tp_size != 1:
            raise CompileUnavailable("compiled forwards are not supported under tensor parallelism")
        compiled = (
            CompiledForward.for_model(self.model, self.decoder, self.lm_head, self.logits_dtype, self.kernel_linears)
            if on else None
        )
        if compiled is not None and compiled.failure is not None:  # failed before in this process: never again
            self.compiled = None
            raise compiled.failure
        self.compiled = compiled
        return self.compiled

    def use_compiled_trees(self, sizes) -> None:
        """While one-token forwards run compiled, run verify forwards of 2..max(sizes)
        new tokens compiled too, each padded to the smallest of ``sizes`` that holds it
        (each size a graph of its own, compiled at its first use); () for none.
        Padding tokens see only themselves and are never committed."""
        sizes = tuple(sorted({int(size) for size in sizes}))
        if any(size < 2 for size in sizes):
            raise ValueError(f"compiled tree sizes must be >= 2, got {list(sizes)}")
        self.compiled_tree_sizes = sizes

    def compiled_size(self, tokens: int) -> int | None:
        """The size a verify forward of ``tokens`` new tokens runs compiled at (1 for one
        token): its own where one graph serves every tree size
        (:data:`~tokenswift.model.compiled.TREE_TOKENS`), else the smallest compiled size
        that holds it, padded; or None: eager."""
        if self.compiled is None:
            return None
        if tokens == 1:
            return 1
        padded = next((size for size in self.compiled_tree_sizes if size >= tokens), None)
        if padded is not None and self.compiled.graph_tokens(self.compiled.tree_graph_name, tokens) == ANY_SIZE:
            return tokens  # no padding: the graph is of every size
        return padded

    def use_prefill_dtype(self, dtype: torch.dtype, min_tokens: int = 0) -> None:
        """Compute prompt prefills (:meth:`prefill`) of at least ``min_tokens`` tokens in
        ``dtype`` with a copy of the model made for the prefill and dropped after it
        (shorter ones in the model's dtype); the KV is stored, and the hidden states
        returned, in the model's dtype (see :func:`tokenswift.model.dtypes.prefill_dtype`
        and :func:`~tokenswift.model.dtypes.prefill_min_tokens`)."""
        if dtype != self.dtype and self.tp_size != 1:
            raise ValueError("a prefill dtype other than the model's is not supported under tensor parallelism")
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        self.prefill_dtype = dtype
        self.prefill_min_tokens = int(min_tokens)

    def prefill_copies(self, tokens: int) -> bool:
        """Whether a prefill of ``tokens`` tokens runs on a copy of the model in
        :attr:`prefill_dtype`: where that differs from the model's dtype and the prompt is
        long enough (:attr:`prefill_min_tokens`)."""
        return self.prefill_dtype != self.dtype and tokens >= self.prefill_min_tokens

    def prefill_copy_bytes(self, tokens: int) -> int:
        """Bytes the copy of the model a prefill of ``tokens`` tokens makes (0: it runs on
        the model itself): its parameters and buffers in :attr:`prefill_dtype`."""
        if not self.prefill_copies(tokens):
            return 0
        size = torch.empty((), dtype=self.prefill_dtype).element_size()
        return sum(t.numel() * (size if t.is_floating_point() else t.element_size())
                   for t in (*self.model.parameters(), *self.model.buffers()))

    @contextlib.contextmanager
    def _prefilling(self, tokens: int):
        """Forwards inside (a prefill of ``tokens`` tokens) run on the prefill dtype's copy
        of the model (eager, plain products) where :meth:`prefill_copies`."""
        if not self.prefill_copies(tokens):
            yield
            return
        started = time.perf_counter()
        twin = copy.deepcopy(self.model).to(self.prefill_dtype)
        logger.debug("prefill in %s: a copy of the model made in %.2f s", self.prefill_dtype, time.perf_counter() - started)
        saved = self.decoder, self.compiled, self.packed_from_rows
        self.decoder, self.compiled, self.packed_from_rows = twin.get_decoder(), None, None
        try:
            yield
        finally:
            self.decoder, self.compiled, self.packed_from_rows = saved
            del twin

    def _compile_failed(self, exc: CompileUnavailable) -> None:
        """A compile failed at its first call: eager from now on (what predicts costs
        reads :attr:`compiled`, so it follows)."""
        logger.warning("compiled forwards are unavailable here, decoding eagerly: %s", exc)
        self.compiled = None

    def _products(self, rows: int):
        """The context products of ``rows`` rows run in."""
        if self.packed_from_rows is not None and rows >= self.packed_from_rows:
            return self.packed_linears
        if self.kernel_linears and rows <= kernels.MAX_LINEAR_ROWS:
            return KernelLinears()
        return contextlib.nullcontext()

    @staticmethod
    def _active_sliding_window(config) -> int | None:
        window = getattr(config, "sliding_window", None)
        if window is None or getattr(config, "use_sliding_window", True) is False:
            return None
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None and "sliding_attention" not in layer_types:
            return None
        return int(window)

    # -- storage -----------------------------------------------------------------

    def kv_bytes(self, capacity: int) -> int:
        """Bytes a store of ``capacity`` positions takes."""
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.head_dim * capacity * element

    def allocate(self, capacity: int) -> KVStore:
        """Make sure a store of at least ``capacity`` positions exists; empty it."""
        if self._sliding_window is not None and capacity > self._sliding_window:
            raise ValueError(
                f"this model uses sliding-window attention (window {self._sliding_window}); "
                f"runs longer than the window ({capacity} positions needed) are not supported"
            )
        if self.store is None or self.store.capacity < capacity:
            logger.debug("allocating KV store: %d positions, %.1f MiB", capacity, self.kv_bytes(capacity) / 2**20)
            self.store = self.cache = None
            self.store = KVStore(
                num_layers=self.num_layers,
                kv_heads=self.kv_heads,
                head_dim=self.head_dim,
                capacity=capacity,
                dtype=self.dtype,
                device=self.device,
            )
            self.cache = StoreCache(self.store)
        self.store.reset()
        return self.store

    @property
    def committed_length(self) -> int:
        return 0 if self.store is None else self.store.length

    def commit(self, kept: torch.Tensor | list[int]) -> None:
        """Keep staged tokens ``kept`` (indices into the latest full forward's tokens)."""
        self._require_store().commit(kept)

    def truncate(self, length: int) -> None:
        self._require_store().truncate(length)

    def _require_store(self) -> KVStore:
        if self.store is None:
            raise RuntimeError("Runner.allocate(capacity) must be called before forwarding")
        return self.store

    # -- forwards ----------------------------------------------------------------

    @model_time
    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        *,
        tree_mask: torch.Tensor | None = None,
        depths: torch.Tensor | None = None,
        view: KVView | None = None,
        logits_rows: torch.Tensor | slice | None = slice(None),
        record_attention: bool = False,
        layers: tuple[int, ...] = (),
        compiled_tree: bool = True,
    ) -> ForwardOutput:
        """Forward new tokens over the committed KV (``view=None``: all of it, the new
        tokens staged for :meth:`commit`) or over a drafting ``view`` of it.

        tokens: [n] long. tree_mask: [n, n] bool, row i = tokens i may see (itself
        included); default causal. depths: [n] long, default ``arange(n)``.
        logits_rows: which rows get logits (index tensor or slice); None for none.
        layers: decoder layers whose outputs the result's ``features`` hold
        (transformers' ``hidden_states`` numbering: k = the output of the k-th layer,
        1 <= k < num_layers); such forwards run eagerly. compiled_tree: a verify
        forward of several tokens may run compiled (:meth:`use_compiled_trees`);
        prompt chunks pass False.
        """
        store = self._require_store()
        tokens = tokens.to(device=self.device, dtype=torch.long)
        n = int(tokens.numel())
        if tree_mask is None:
            tree_mask = causal_mask(n, self.device)
        if depths is None:
            depths = torch.arange(n, device=self.device)
        positions = (depths.to(self.device, torch.long) + store.length).view(1, n)
        view = Staging(store) if view is None else view
        tree_mask = tree_mask.to(self.device, torch.bool)
        recorder = AttentionRecorder() if record_attention else None
        plan = ForwardPlan(view=view, tree_mask=tree_mask, recorder=recorder)
        size = None if layers or (n > 1 and not compiled_tree) else self.compiled_size(n)
        if size is not None and n > 1 and self.tree_trial is not None and not self.compiled.has_tree_graph(size):
            size = None  # on trial: eager, nothing compiled
        if size is not None and n > 1 and (
            recorder is not None or not isinstance(view, Staging) or store.length + size > store.capacity
        ):
            size = None  # trees compile for verify forwards (that fit) only; the recorder reads the last row
        if size is not None:
            try:
                padded_tokens, padded_positions, padded_plan = self._padded(tokens, positions, plan, size)
                with attending(padded_plan, store):
                    # copies made here are inference tensors whatever the caller's were:
                    # one graph per size, not one per kind of input tensor
                    hidden = self.compiled.forward(padded_tokens.clone(), padded_positions.clone())[:n]  # [n, hidden_size]
                return self._output(padded_plan, store, hidden, logits_rows, recorder)
            except CompileUnavailable as exc:
                self._compile_failed(exc)  # then the same forward, eager
        self.cache.plan = plan
        try:
            with self._products(n):
                out = self.decoder(
                    input_ids=tokens.view(1, n),
                    # A 4D mask passes through transformers untouched; the attention
                    # function reads the plan instead (no [n, S + n] mask is built).
                    attention_mask=tree_mask.view(1, 1, n, n),
                    position_ids=positions,
                    cache=self.cache,
                    use_cache=True,
                    output_hidden_states=bool(layers),
                    **{PLAN_KWARG: plan},
                )
        finally:
            self.cache.plan = None
        states = None
        if layers:
            if not all(1 <= k < self.num_layers for k in layers):
                raise ValueError(
                    f"layers {list(layers)}: the outputs of this model's decoder layers 1..{self.num_layers - 1} "
                    "can be read (the last one's is the final-norm state, always there)"
                )
            states = torch.cat([out.hidden_states[k][0] for k in layers], -1)  # [n, L * hidden_size]
        return self._output(plan, store, out.last_hidden_state[0], logits_rows, recorder, states)

    @staticmethod
    def _padded(tokens, positions, plan: ForwardPlan, size: int):
        """A forward of n tokens as one of ``size``: the padding repeats the last token
        at its position and sees only itself (the real tokens never see it; it is never
        committed). Returns tokens and positions [1, size] and the padded plan."""
        n = int(tokens.numel())
        if size == n:
            return tokens.view(1, n), positions, plan
        pad = size - n
        mask = torch.eye(size, dtype=torch.bool, device=tokens.device)
        mask[:n, :n] = plan.tree_mask
        padded_tokens = torch.cat([tokens, tokens[-1:].expand(pad)]).view(1, size)
        padded_positions = torch.cat([positions, positions[:, -1:].expand(1, pad)], 1)
        return padded_tokens, padded_positions, ForwardPlan(view=plan.view, tree_mask=mask, recorder=plan.recorder)

    def _output(self, plan: ForwardPlan, store: KVStore, hidden: torch.Tensor, logits_rows, recorder, states=None) -> ForwardOutput:
        """hidden: [n, hidden_size], the forward's final-norm states; states: [n, L * hidden_size]
        the chosen layers' outputs (or None)."""
        plan.view.finish(store, plan.new_tokens)
        attention = recorder.probabilities if recorder is not None else None
        if logits_rows is None:
            return ForwardOutput(logits=None, hidden=hidden, attention=attention, layer_states=states)
        hidden = hidden[logits_rows]
        states = None if states is None else states[logits_rows]
        return ForwardOutput(logits=self.logits(hidden), hidden=hidden, attention=attention, layer_states=states)

    @model_time
    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [m, hidden_size] final-norm states -> [m, vocab] logits in ``logits_dtype``."""
        if self.compiled is not None and hidden.shape[0] == 1:
            try:
                return self.compiled.logits(hidden)
            except CompileUnavailable as exc:
                self._compile_failed(exc)
        products = self.packed_linears if self.packed_lm_head else self._products(hidden.shape[0])
        with products:
            return self.lm_head(hidden).to(self.logits_dtype)

    def prefill_prompt(self, prompt: list[int], *, keep_hidden: int = 1, layers: tuple[int, ...] = ()) -> PrefilledPrompt:
        """Prefill ``prompt`` minus its last token into this runner's store (allocating
        what it needs) and keep a copy to :meth:`restore` runs from (with the features
        of ``layers``, see :meth:`prefill`)."""
        started = time.perf_counter()
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prefill_prompt: the prompt is empty")
        if self.store is None or self.store.capacity < len(prompt):
            self.allocate(len(prompt))
        self.store.reset()
        hidden = self.prefill(torch.tensor(prompt[:-1], dtype=torch.long), keep_hidden=keep_hidden, layers=layers)
        length = self.store.length
        keys = [k[:, :, :length].clone() for k in self.store.keys]
        values = [v[:, :, :length].clone() for v in self.store.values]
        return PrefilledPrompt(
            tokens=tuple(prompt), keys=keys, values=values, hidden=hidden, model=self.model,
            seconds=time.perf_counter() - started, layers=tuple(layers),
        )

    def restore(self, prefilled: PrefilledPrompt) -> None:
        """Make the allocated store hold exactly ``prefilled``'s positions, committed."""
        store = self._require_store()
        if prefilled.model is not self.model:
            raise ValueError("restore: the prefilled prompt was computed with another model")
        length = prefilled.positions
        if length >= store.capacity:
            raise ValueError(f"restore: {length} prefilled positions do not fit a store of {store.capacity}")
        store.load(prefilled.keys, prefilled.values)

    def prefill(
        self, tokens: torch.Tensor, *, chunk_size: int = 512, keep_hidden: int = 1, layers: tuple[int, ...] = ()
    ) -> torch.Tensor | None:
        """Forward a prompt in causal chunks and commit all of it, computing in
        :attr:`prefill_dtype` (see :meth:`use_prefill_dtype`). tokens: [n] long.
        Returns the final-norm hidden states of its last ``keep_hidden`` tokens
        ([min(keep_hidden, n), hidden_size]; None for n = 0), preceded by the outputs
        of decoder ``layers`` (:func:`features`: [m, (len(layers) + 1) * hidden_size])."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        kept = None
        with self._prefilling(int(tokens.numel())):
            for start in range(0, int(tokens.numel()), chunk_size):
                chunk = tokens[start : start + chunk_size]
                out = self.forward(chunk, logits_rows=None, layers=layers, compiled_tree=False)
                self.commit(torch.arange(chunk.numel()))
                tail = out.features[-keep_hidden:].to(self.dtype)
                kept = tail if kept is None else torch.cat([kept, tail])[-keep_hidden:]
                kept = kept.clone()
        return kept
