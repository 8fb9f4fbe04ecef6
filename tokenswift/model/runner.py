"""The runner: forwards of an unmodified transformers causal LM over a preallocated KV store.

Every forward is a set of new tokens with a boolean ``tree_mask`` among themselves
(causal for a prompt chunk, ancestor-or-self for a token tree) and per-token
``depths``; token i sits at position ``committed_length + depths[i]`` and attends to
all committed positions (or to a :class:`~tokenswift.model.kv.KVView` of them) plus
the new tokens its row of ``tree_mask`` allows.

A forward over the full store writes the new tokens' keys/values into staging;
:meth:`Runner.commit` keeps a chosen subset, compacted in place. A forward over a view
writes nothing into the store.
"""

from __future__ import annotations

import logging

import attrs
import torch

from tokenswift.distributed import tensor_parallel_size
from tokenswift.model.attention import ScoreRecorder, register_attention
from tokenswift.model.kv import ForwardPlan, KVStore, KVView, StoreCache

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True, eq=False, repr=False)
class ForwardOutput:
    """logits: [m, vocab] for the rows asked for (float32, or float64 for float64 models);
    hidden: [m, hidden_size], the final-norm hidden states of the same rows."""

    logits: torch.Tensor | None
    hidden: torch.Tensor

    def __repr__(self) -> str:
        shape = None if self.logits is None else tuple(self.logits.shape)
        return f"ForwardOutput(logits={shape}, hidden={tuple(self.hidden.shape)})"


def causal_mask(n: int, device=None) -> torch.Tensor:
    """[n, n] bool lower-triangular mask."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


class Runner:
    """Owns the KV store of one model and runs forwards over it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
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
        self._require_store().commit(torch.as_tensor(kept, dtype=torch.long, device=self.device))

    def truncate(self, length: int) -> None:
        self._require_store().truncate(length)

    def _require_store(self) -> KVStore:
        if self.store is None:
            raise RuntimeError("Runner.allocate(capacity) must be called before forwarding")
        return self.store

    # -- forwards ----------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        *,
        tree_mask: torch.Tensor | None = None,
        depths: torch.Tensor | None = None,
        view: KVView | None = None,
        logits_rows: torch.Tensor | slice | None = slice(None),
        recorder: ScoreRecorder | None = None,
    ) -> ForwardOutput:
        """Forward new tokens over the committed KV (or a view of it).

        tokens: [n] long. tree_mask: [n, n] bool, row i = tokens i may see (itself
        included); default causal. depths: [n] long, default ``arange(n)``.
        logits_rows: which rows get logits (index tensor or slice); None for none.
        """
        store = self._require_store()
        tokens = tokens.to(device=self.device, dtype=torch.long)
        n = int(tokens.numel())
        if tree_mask is None:
            tree_mask = causal_mask(n, self.device)
        if depths is None:
            depths = torch.arange(n, device=self.device)
        positions = (depths.to(self.device, torch.long) + store.length).view(1, n)
        prefix = store.length if view is None else view.size
        if view is None and store.length + n > store.capacity:
            raise RuntimeError(f"KV store overflow: {store.length + n} positions needed, capacity {store.capacity}")
        mask = torch.cat(
            [torch.ones(n, prefix, dtype=torch.bool, device=self.device), tree_mask.to(self.device, torch.bool)], dim=1
        ).view(1, 1, n, prefix + n)
        self.cache.plan = ForwardPlan(view=view)
        extra = {} if recorder is None else {"tokenswift_scores": recorder}
        if n == 1:
            extra["tokenswift_dense"] = True  # a single query sees everything: no mask needed
        out = self.decoder(
            input_ids=tokens.view(1, n),
            attention_mask=mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            **extra,
        )
        if view is None:
            store.staged = n
        hidden = out.last_hidden_state[0]  # [n, hidden_size]
        if logits_rows is None:
            return ForwardOutput(logits=None, hidden=hidden)
        hidden = hidden[logits_rows]
        logits = self.lm_head(hidden).to(self.logits_dtype)
        return ForwardOutput(logits=logits, hidden=hidden)

    def prefill(self, tokens: torch.Tensor, *, chunk_size: int = 512) -> None:
        """Forward a prompt in causal chunks and commit all of it. tokens: [n] long."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        for start in range(0, int(tokens.numel()), chunk_size):
            chunk = tokens[start : start + chunk_size]
            self.forward(chunk, logits_rows=None)
            self.commit(torch.arange(chunk.numel()))
