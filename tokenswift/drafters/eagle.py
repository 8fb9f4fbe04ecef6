"""The ``eagle`` drafter: a one-layer network over the target's features (EAGLE-style).

No extra forward of the target. Each step the drafter

1. feeds its layer the pairs (feature, next token) that the last verify forward
   committed: the root's and every accepted node's hidden state (fused with inner
   layers' outputs where the network was trained so: ``fused_layers``), each with the token
   that followed it (the last pair is the one that gave the current root). Their keys
   and values join the draft layer's own cache (the last ``window`` pairs);
2. from the output of the last pair (the predicted feature of the root's position)
   ranks depth 1 over the draft vocabulary;
3. expands level by level: the ``width`` most likely nodes so far (by the product of
   their probabilities along the path) each get their pair (the parent's predicted
   feature, the node's token) forwarded, attending to the committed pairs and to their
   own ancestors, and their ``children`` best next tokens become the next level.

Candidates are ranked as verification will score them (``penalize``: the pipeline's
penalty and warpers over each candidate's context, as the ``tokenswift`` drafter ranks
its depth 1). Every node carries its draft probability as its confidence, so the cost-aware tree
choice can keep the ones that pay. The network: :mod:`tokenswift.drafters.feature_net`;
training: ``tokenswift train-drafter``.
"""

from __future__ import annotations

import collections
import logging
import time
import weakref
from pathlib import Path

import attrs
import torch

from tokenswift.drafters.draft_graphs import CompiledLevel, draft_logits
from tokenswift.drafters.draft_heads import WEIGHTS_NAME
from tokenswift.drafters.feature_net import FeatureNet, find_shipped_drafter
from tokenswift.drafters.head_based import coupled_rating
from tokenswift.errors import SpecError
from tokenswift.interfaces import Drafter
from tokenswift.model.compiled import CompileUnavailable
from tokenswift.model.linear import serve_linears_by_kernel
from tokenswift.speculation import RateChooser
from tokenswift.stats import model_time
from tokenswift.tree import DRAFTER, Branch, SampledChildren
from tokenswift.validation import boolean, int_at_least, integer, weights_source

logger = logging.getLogger(__name__)


# The rows of the draft head a level ranks by default: the network's most frequent
# tokens (it ships 8,192). Half of them cover 93% of a novel's tokens against 98% for
# all (the shipped SmolLM2 network, pg_books.jsonl), and a level reads half the head and
# ranks half the columns: in turns on a 2-core AMD EPYC Zen 4 (2K prompt, greedy,
# compiled, the plain guard off) 1.19x ``ar`` against 1.10x with all 8,192 (1.88 tokens
# a step against 1.99); 2,048 rows 1.12x, 1,024 1.10x (1.69 tokens a step).
DRAFT_VOCAB = 4096


def _threshold(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise SpecError(f"drafter.threshold must be a number in [0, 1), got {value!r}")
    return float(value)


@attrs.define(eq=False)
class _Node:
    """A drafted token: its path from depth 1 (tokens, confidences), the chance of the
    whole path, the predicted feature it is drafted from, and the scratch row of the
    pair whose output drafted it (:attr:`DraftKV.no_pair` at depth 1)."""

    tokens: list[int]
    confidence: list[float]
    chance: float
    feature: torch.Tensor  # [H]
    parent_pair: int


def _breadth(tree) -> int:
    """The widest a verified tree's drafted part is: the most drafted nodes at one depth,
    or children of one node (0: none drafted)."""
    drafted = [node for node in range(1, len(tree)) if tree.sources[node] == DRAFTER]
    levels = collections.Counter(tree.depths[node] for node in drafted)
    families = collections.Counter(tree.parents[node] for node in drafted)
    return max([*levels.values(), *families.values()], default=0)


class DraftKV:
    """The draft layer's keys and values in buffers of fixed size [1, kv_heads, C, d]:
    the last ``window`` committed pairs in a ring (keys rotated when written, so their
    order is nothing to attention), then ``scratch`` rows for the pairs one proposal
    drafts. A forward reads the columns its mask allows, so its shapes never change
    (:mod:`tokenswift.drafters.draft_graphs`).

    ``ancestry[i]``: the scratch rows a pair drafted from scratch row i's output sees
    (its ancestors' pairs and row i itself); row :attr:`no_pair` sees none (depth 1)."""

    def __init__(self, kv_heads: int, head_dim: int, window: int, scratch: int, device) -> None:
        size = window + scratch
        self.window, self.scratch = window, scratch
        self.keys = torch.zeros(1, kv_heads, size, head_dim, device=device)
        self.values = torch.zeros(1, kv_heads, size, head_dim, device=device)
        self.committed = torch.zeros(size, dtype=torch.bool, device=device)  # the ring's filled slots
        self.next_slot = 0
        self.ancestry = torch.zeros(scratch + 1, scratch, dtype=torch.bool, device=device)
        self.drafted = 0  # scratch rows used by this proposal

    @property
    def size(self) -> int:
        return self.window + self.scratch

    @property
    def no_pair(self) -> int:
        return self.scratch

    def start_proposal(self) -> None:
        """A proposal starts: its drafted pairs take the scratch rows from the first."""
        self.drafted = 0

    def commit(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values [1, kv_heads, m, d]: the newest committed pairs (only the last
        ``window`` are kept, replacing the oldest)."""
        m = min(keys.shape[2], self.window)
        slots = (self.next_slot + torch.arange(m, device=keys.device)) % self.window
        self.keys.index_copy_(2, slots, keys[:, :, -m:])
        self.values.index_copy_(2, slots, values[:, :, -m:])
        self.committed[slots] = True
        self.next_slot = (self.next_slot + m) % self.window

    def visible(self, parent_pairs: torch.Tensor) -> torch.Tensor:
        """parent_pairs [n] long -> [n, C]: the columns each new pair attends to besides
        itself (every committed pair, its ancestors' drafted pairs)."""
        scratch = self.ancestry.index_select(0, parent_pairs)  # [n, scratch]
        return torch.cat([self.committed[: self.window].expand(len(parent_pairs), -1), scratch], 1)

    def draft(self, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Keep n drafted pairs' keys, values [1, kv_heads, n, d] (``visible`` [n, C]
        what they saw) in the scratch rows; returns their rows [n]."""
        n = keys.shape[2]
        if self.drafted + n > self.scratch:
            raise ValueError(f"a proposal drafted more than the {self.scratch} pairs its scratch holds")
        rows = torch.arange(self.drafted, self.drafted + n, device=keys.device)
        self.keys.index_copy_(2, rows + self.window, keys)
        self.values.index_copy_(2, rows + self.window, values)
        ancestry = visible[:, self.window:].clone()
        ancestry[torch.arange(n, device=keys.device), rows] = True
        self.ancestry.index_copy_(0, rows, ancestry)
        self.drafted += n
        return rows


class LevelEconomy:
    """Whether drafting one more level can pay, from what the run shows: the share of
    recent steps whose verification accepted at least k drafted tokens (``reach(k)``:
    a node at depth k+1 can only be accepted in those), what a level takes, and what the
    run pays per token. Depth k+1 is drafted while ``reach(k) x CONDITIONAL x seconds a
    token`` exceeds a level's seconds: the most the level can save, if a node at depth
    k+1 is accepted in CONDITIONAL of the steps that reach depth k.

    Measured before this rule (2K held-out prompt, 400 tokens, ``eagle`` compiled, a
    2-core Sapphire Rapids): greedy, reach(1..3) = 0.73 / 0.38 / 0.065 and no step
    accepted 4; with the paper's sampling 0.50 / 0.096 / 0.026. Yet the drafter drafted
    4-5 levels (one past the deepest verified node), each ~2.4 ms of a ~40 ms step.

    The rule prices a level's drafting, not the rows its nodes add to the verify forward
    and its scoring, nor what the tree choice then makes of them. So the speculative
    steps themselves choose between it and drafting depth 1 alone (``shallow``, a
    :class:`~tokenswift.speculation.RateChooser`: each arm's tokens per second from the
    start of a proposal to the end of its step, steps that compiled a graph left out).
    On a 2-core AMD EPYC Zen 4 (``eagle``, compiled, greedy, in turns with ``ar``) depth 1
    alone ran 1.139-1.160x ``ar`` at 2K where the rule ran 0.995-1.059x (two runs), and
    1.080-1.151x at 16K against 1.023-1.039x."""

    CONDITIONAL = 0.5
    STEPS = 32  # the recent steps reach() is taken over
    SMOOTHING = 0.1

    def __init__(self, *, choose_depth: bool = True) -> None:
        self.accepted: collections.deque[int] = collections.deque(maxlen=self.STEPS)
        self.level_seconds: float | None = None
        self.token_seconds: float | None = None
        self._since: float | None = None
        self._tokens = 0
        # True: the proposal drafts depth 1 alone (None: no choice, the rule decides)
        self.shallow = RateChooser(first=False) if choose_depth else None
        self.arm: bool | None = None  # the running proposal's arm
        self._proposal_started: float | None = None

    def proposing(self) -> None:
        """A proposal starts: the time since the last one, over the tokens emitted since,
        is what the run pays per token; its arm is picked."""
        now = time.perf_counter()
        if self._since is not None and self._tokens:
            self.token_seconds = self._average(self.token_seconds, (now - self._since) / self._tokens)
        self._since, self._tokens = now, 0
        self._proposal_started = now
        self.arm = self.shallow.pick() if self.shallow is not None else None

    def observe(self, drafted_accepted: int | None, emitted: int, *, compiled: bool = False) -> None:
        """A step: how many drafted tokens it accepted (None: the drafter proposed none);
        ``compiled``: a graph was compiled in it (its time teaches the arms nothing)."""
        if drafted_accepted is not None and not self.arm:  # what deep drafts reach, from the rule's steps
            self.accepted.append(drafted_accepted)
        self._tokens += emitted
        if self._proposal_started is not None:
            if self.shallow is not None and self.arm is not None and not compiled:
                self.shallow.observe(self.arm, emitted, time.perf_counter() - self._proposal_started)
            self._proposal_started = None

    def level_took(self, seconds: float) -> None:
        self.level_seconds = self._average(self.level_seconds, seconds)

    def reach(self, k: int) -> float:
        return sum(1 for a in self.accepted if a >= k) / len(self.accepted)

    def deepest(self, limit: int) -> int:
        """How deep to draft, at most ``limit`` (all of it until the run has shown enough;
        1 where the running proposal's arm is shallow)."""
        if self.arm:
            return min(limit, 1)
        if len(self.accepted) < self.STEPS // 4 or self.level_seconds is None or self.token_seconds is None:
            return limit
        depth = 1
        while depth < limit and self.reach(depth) * self.CONDITIONAL * self.token_seconds > self.level_seconds:
            depth += 1
        return depth

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.SMOOTHING * (new - old)


class _DraftParts:
    """What every ``eagle`` drafter of one model and one network shares: the network,
    its head, and its compiled level (:class:`~tokenswift.drafters.draft_graphs.CompiledLevel`,
    built at the first compiled proposal). Shared so that the drafters of a process (a
    benchmark builds one per preset and seed) compile the level once."""

    def __init__(self, runner, source: str, seed: int, vocab: int | None) -> None:
        model = runner.model
        if source == "random":
            net = FeatureNet.for_model(model).initialise(seed=seed)
        else:
            net = FeatureNet.from_pretrained(source, model)
        self.net = net.to(device=runner.device, dtype=torch.float32).eval()
        self.embed = model.get_input_embeddings()
        # The draft vocabulary is sorted by frequency: ``vocab`` keeps its first rows.
        self.draft_tokens = self.net.draft_tokens[:vocab]
        # [V', H]: the LM head's rows of the draft vocabulary. Where the runner's products
        # go through the few-rows kernel (bfloat16), the head stays bfloat16 and a level's
        # rows are one kernel call: 57 MB read per level instead of 113 MB of float32
        # through PyTorch (a level's head product measured ~5 ms of the ~22 ms a 4-level
        # proposal took on an AMD EPYC Zen 4). Drafts only choose what is verified.
        head = runner.lm_head.weight.detach()[self.draft_tokens]
        kernel_head = runner.kernel_linears and head.dtype == torch.bfloat16
        head = head.contiguous() if kernel_head else head.to(torch.float32)
        self.head, self.kernel_head = head, kernel_head
        if kernel_head:
            # The layer's products of a few rows through the kernel too, where the
            # runner's go through it, its weights in bfloat16 like the head's (the shipped
            # layer is a bfloat16 copy): float32 through PyTorch they were ~7 ms of a 17 ms
            # proposal (an AMD EPYC Zen 4); float32 through the kernel, 5.8 ms of a 20 ms
            # one (8 products a level, a Sapphire Rapids). Drafts only choose what is verified.
            serve_linears_by_kernel(self.net, torch.bfloat16)

        def head_logits(features: torch.Tensor) -> torch.Tensor:
            """features [n, H] float32 -> [n, V'] float32 logits over the draft vocabulary."""
            return draft_logits(features, head, kernel_head)

        self.head_logits = head_logits
        self.device = runner.device
        self._level: CompiledLevel | None = None
        self._level_problem: str | None = None

    def level(self) -> CompiledLevel | None:
        """The compiled level (built at the first call), or None where torch.compile
        cannot run or failed (said once; eager from then on)."""
        if self._level_problem is not None:
            return None
        if self._level is None:
            try:
                self._level = CompiledLevel(self.net, self.embed, self.head, self.kernel_head, self.device)
            except CompileUnavailable as exc:
                return self._eager_from_now(exc)
        if self._level.failure is not None:
            return self._eager_from_now(self._level.failure)
        return self._level

    def _eager_from_now(self, problem: Exception) -> None:
        logger.warning("the eagle draft levels run eagerly: %s", problem)
        self._level_problem = str(problem)
        return None

    @classmethod
    def shared(cls, runner, source: str, seed: int, vocab: int | None) -> _DraftParts:
        """The parts for ``source`` (a directory, or ``random`` with ``seed``) on
        ``runner``'s model, made once per process (again where the weights on disk
        changed)."""
        stamp = None
        if source != "random":
            weights = Path(source) / WEIGHTS_NAME
            stamp = (weights.stat().st_mtime_ns, weights.stat().st_size) if weights.exists() else None
        key = (str(source), seed if source == "random" else None, vocab, stamp, runner.kernel_linears, str(runner.device))
        by_key = _SHARED_PARTS.setdefault(runner.model, {})
        parts = by_key.get(key)
        if parts is None:
            parts = by_key[key] = cls(runner, source, seed, vocab)
        return parts


_SHARED_PARTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: _DraftParts}


class EagleDrafter(Drafter):
    """A draft decoder layer on the verify pass's features; no extra target forward."""

    name = "eagle"

    @attrs.frozen(kw_only=True)
    class Options:
        weights: str = attrs.field(default="auto", converter=weights_source(
            "drafter.weights", "the drafter shipped for this model", "a directory from `tokenswift train-drafter`"))
        depth: int = attrs.field(default=8, converter=int_at_least("drafter.depth", 1))
        width: int = attrs.field(default=12, converter=int_at_least("drafter.width", 1))
        children: int = attrs.field(default=10, converter=int_at_least("drafter.children", 1))
        threshold: float = attrs.field(default=0.0, converter=_threshold)
        window: int = attrs.field(default=512, converter=int_at_least("drafter.window", 1))
        penalize: bool = attrs.field(default=True, converter=boolean("drafter.penalize"))
        vocab: int = attrs.field(default=DRAFT_VOCAB, converter=int_at_least("drafter.vocab", 2, optional=True))
        seed: int = attrs.field(default=0, converter=integer("drafter.seed"))
        root_pass: bool = attrs.field(default=False, converter=boolean("drafter.root_pass"))

    def __init__(self, options, context) -> None:
        super().__init__(options, context)
        runner = context.runner
        self.runner = runner
        model = runner.model
        source = options.weights
        if source == "auto":
            shipped = find_shipped_drafter(model)
            if shipped is None:
                logger.warning(
                    "no shipped eagle drafter matches this model; using a random one (still lossless, but slow). "
                    "Train one with `tokenswift train-drafter` and pass drafter.weights = DIR."
                )
                source = "random"
            else:
                source = str(shipped)
        parts = _DraftParts.shared(runner, source, options.seed, options.vocab)
        self.parts = parts
        self.net, self.embed, self.head, self.kernel_head = parts.net, parts.embed, parts.head, parts.kernel_head
        self._head_logits = parts.head_logits
        draft_tokens = parts.draft_tokens
        self.draft_tokens = draft_tokens.tolist()
        self.draft_token_ids = draft_tokens.to(runner.device)  # [V'] target ids of the draft vocabulary
        # target id -> row of the draft vocabulary; ids outside it -> the extra last column
        self.draft_index = torch.full((runner.vocab_size,), len(draft_tokens), dtype=torch.long, device=runner.device)
        self.draft_index[draft_tokens] = torch.arange(len(draft_tokens), device=runner.device)
        self.start(None)
        logger.info("eagle drafter: %s, draft vocabulary %d, depth %d", source, len(self.draft_tokens), options.depth)

    @property
    def max_tree_nodes(self) -> int:
        o = self.options
        drafted = o.children + (o.depth - 1) * o.width * o.children
        return drafted if self.proposed is None else min(drafted, self.proposed)

    @property
    def proposed(self) -> int | None:
        """The most candidates a proposal returns (the likeliest ones): a step verifies
        at most ``speculation.max_nodes`` nodes, and every ancestor of a node is at least
        as likely as it, so the likeliest ``max_nodes`` are a subtree holding every
        candidate worth verifying (EAGLE-2's reranking). None: all of them."""
        cap = self.context.spec.speculation.max_nodes if self.context.spec is not None else 0
        return cap if cap > 0 else None

    @property
    def prompt_features(self) -> int:
        return self.options.window

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.net.config.fused_layers

    # -- keeping the draft layer's cache in step with the committed text ---------------

    def start(self, state) -> None:
        config, options = self.net.config, self.options
        # the scratch holds what one proposal drafts: at most ``width`` pairs a level below depth 1
        self.kv = DraftKV(config.num_kv_heads, config.head_dim, options.window, (options.depth - 1) * options.width,
                          self.runner.device)
        self.pending_features: list[torch.Tensor] = []  # [H] each, the pairs not yet in the cache
        self.pending_tokens: list[int] = []
        self.next_position = 0  # the position of the first pending pair
        # What the tree choice verified of the last proposals (fixed trees draft what they
        # are configured to: depth_limit, breadth_limit). A tree choice starts small and
        # grows a level and a node a step while it verifies them: drafting the whole
        # configured tree took ~28 ms of a ~50 ms first step on a 2-core AMD EPYC Zen 4.
        first_depth = options.depth if self._fixed_trees else 2
        self.verified_depths: collections.deque[int] = collections.deque([first_depth], maxlen=8)
        self.verified_breadths: collections.deque[int] = collections.deque([2], maxlen=8)
        self._proposing = False  # a proposal was asked for since the last step
        self._behind = False  # a step without a proposal committed pairs the layer has not seen
        self._catch_up_seconds = 0.0
        self.economy = LevelEconomy(choose_depth=not self._fixed_trees and options.depth > 1)
        self._compile_mark = self._compile_seconds()

    def _compile_seconds(self) -> float:
        """What compiling the target's graphs and the draft level has taken so far."""
        compiled, level = self.runner.compiled, self.parts._level
        return (compiled.compile_seconds if compiled is not None else 0.0) + (level.compile_seconds if level else 0.0)

    def prime(self, state, hidden: torch.Tensor | None) -> None:
        """hidden: [m, F], the prompt's last m positions before the root (each the
        features that gave the token after it)."""
        if hidden is None or len(hidden) == 0:
            return
        m = len(hidden)
        self.next_position = len(state.tokens) - 1 - m
        self.pending_features = list(hidden)
        self.pending_tokens = state.tokens[-m:]
        if m > 1:  # the prompt's pairs now, with the prefill; the last one drafts the first step
            last_feature, last_token = self.pending_features.pop(), self.pending_tokens.pop()
            with torch.inference_mode():
                self._commit_pending()
            self.pending_features, self.pending_tokens = [last_feature], [last_token]

    def observe(self, state, outcome) -> None:
        tree = outcome.tree
        if self._proposing:  # steps that asked for no proposal (plain ones) say nothing of what a tree verifies
            self.verified_depths.append(max((d for d, src in zip(tree.depths, tree.sources) if src == DRAFTER), default=0))
            self.verified_breadths.append(_breadth(tree))
            self._proposing = False
        else:
            self._behind = True
        drafted = any(src == DRAFTER for src in tree.sources[1:])
        accepted = sum(1 for node in outcome.accepted if tree.sources[node] == DRAFTER)
        compiled = self._compile_seconds() != self._compile_mark
        self._compile_mark = self._compile_seconds()
        self.economy.observe(accepted if drafted else None, len(outcome.emitted), compiled=compiled)
        for node, token in zip([0, *outcome.accepted], outcome.emitted):
            self.pending_features.append(outcome.features[node])
            self.pending_tokens.append(token)
        excess = len(self.pending_tokens) - self.options.window  # older pairs would leave the window anyway
        if excess > 0:
            del self.pending_features[:excess], self.pending_tokens[:excess]
            self.next_position += excess

    def _commit_pending(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Run the pending pairs through the layer, keep their keys/values; return the
        last pair's output ([H], the predicted feature of the root's position), its
        logits over the draft vocabulary ([V']) and its position."""
        m = len(self.pending_tokens)
        device = self.runner.device
        features = self.net.feature(torch.stack(self.pending_features).to(device, torch.float32))  # [m, H]
        positions = torch.arange(self.next_position, self.next_position + m, device=device)
        visible = self.kv.committed.expand(m, -1)  # every committed pair, no drafted one
        own = torch.ones(m, m, dtype=torch.bool, device=device).tril()
        keys, values, out, logits = self._forward(self.pending_tokens, features, positions, visible, own, last_logits=True)
        self.kv.commit(keys, values)
        position = self.next_position + m - 1
        self.next_position += m
        self.pending_features, self.pending_tokens = [], []
        return out[-1], logits[-1], position

    @model_time
    def _forward(
        self, tokens: list[int], features: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor, own: torch.Tensor,
        *, last_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer and head on n new pairs: ``tokens`` [n], ``features`` [n, H] (the
        features they follow), ``positions`` [n]; each attends to the cache's columns
        ``visible`` [n, C] allows and to the new pairs ``own`` [n, n] allows. Returns
        their keys and values [1, kv_heads, n, d], outputs [n, H] and logits [n, V']
        (with ``last_logits``, at least the last row's: catching up on the text a run
        of plain steps committed, 100+ rows, only the last is drafted from, and the head
        over every row was most of that forward). Compiled (at a padded row count)
        where the target's tree forwards are (:attr:`levels_compiled`), else eager."""
        n, size, device = len(tokens), self.kv.size, self.runner.device
        level = self.parts.level() if self.levels_compiled else None
        rows = level.rows_for(n) if level is not None else None
        padded = rows or n
        ids = torch.tensor(tokens + tokens[-1:] * (padded - n), device=device)
        mask = torch.zeros(padded, size + padded, dtype=torch.bool, device=device)
        mask[:n, :size] = visible
        mask[:n, size : size + n] = own
        if padded > n:  # padding rows repeat the last pair and see only themselves
            features = torch.cat([features, features[-1:].expand(padded - n, -1)])
            positions = torch.cat([positions, positions[-1:].expand(padded - n)])
            mask[n:, size + n :] = torch.eye(padded - n, dtype=torch.bool, device=device)
        if rows is not None:
            try:
                keys, values, out, logits = level(ids, features, positions, self.kv.keys, self.kv.values, mask)
                return keys[:, :, :n], values[:, :, :n], out[:n], logits[:n]
            except CompileUnavailable:
                self.parts.level()  # says so once; eager from now on
        keys, values, out = self.net.extend(self.embed(ids).to(torch.float32), features, positions, self.kv.keys,
                                            self.kv.values, mask)
        return keys[:, :, :n], values[:, :, :n], out[:n], self._head_logits(out[n - 1 : n] if last_logits else out[:n])

    @property
    def levels_compiled(self) -> bool:
        """Whether the levels run as compiled graphs: where the runner's tree verify
        forwards do (a run whose trees stay eager, as ``compile = "auto"`` leaves a run too
        short to repay their graphs, rarely speculates, and compiling the levels' graphs
        at its first proposals cost it more than they saved: the README's main job, 2,000
        tokens on a 2-core AMD EPYC Zen 4, spent 1.5 s in three proposals, 23 steps
        speculated, 0.91-0.98x ``ar``), nor while the run's trees are on trial
        (:class:`~tokenswift.compiling.TreeTrial`): compiled once it has judged them."""
        runner = self.runner
        return runner.compiled is not None and bool(runner.compiled_tree_sizes) and runner.tree_trial is None

    # -- drafting ----------------------------------------------------------------------

    @property
    def depth_limit(self) -> int:
        """How deep to draft: one level past the deepest drafted node verified in the
        last steps (the tree choice rarely verifies deep levels where nodes are dear,
        and drafting them costs time), at most ``depth``; where the cost model chooses
        the trees, no deeper than the run's acceptance says a level can pay
        (:class:`LevelEconomy`). Fixed trees draft what they are configured to."""
        limit = min(self.options.depth, max(self.verified_depths) + 1)
        return limit if self._fixed_trees else self.economy.deepest(limit)

    @property
    def _fixed_trees(self) -> bool:
        spec = self.context.spec
        return spec is not None and spec.speculation.tree == "fixed"

    @property
    def breadth_limit(self) -> int:
        """How many nodes to expand per level and children to draft per node: one more
        than the widest the tree choice verified in the last steps (the most drafted
        nodes at one depth, or children of one node), so that a choice that wants more
        sees it the next step; ``width`` and ``children`` cap it. Fixed trees verify the
        ``proposed`` likeliest candidates: cut only where that is below the configured width.

        Where the choice verifies ~7 nodes, expanding 12 nodes a level with 10 children
        each (the previous rule: twice the verified nodes plus two) drafted ~100
        candidates a level for a handful verified. In turns on a 2-core AMD EPYC Zen 4
        (2K prompt, greedy, compiled): 12 x 10 0.98x ``ar``, 4 x 4 1.03x; the same with
        at most 4 nodes verified 1.01x and 1.10x."""
        if self._fixed_trees:
            # no level or family of the ``proposed`` likeliest nodes holds more of them
            return max(self.options.width, self.options.children) if self.proposed is None else self.proposed
        return max(self.verified_breadths) + 1

    def _ranked(
        self, logits: torch.Tensor, tail: torch.Tensor, paths: list[list[int]], k: int, noise: torch.Tensor | None = None,
        draw=None,
    ) -> tuple[list[list[int]], list[list[float]], torch.Tensor | None]:
        """logits: [n, V'] the draft head's; tail: [t] the committed tokens the penalty sees; paths: per
        row the drafted tokens after them, before the drafted one (all of one length)
        -> per row the k best draft tokens (target ids) and their
        probabilities, scored as verification will score them: with ``penalize``, the
        pipeline's penalty and warpers over each row's context, applied within the
        draft vocabulary (ids outside it share one extra column). ``noise`` [V']:
        the sampler's noise at the rows' depth for the draft vocabulary's tokens
        (siblings share it); with it, the rows
        are ranked and rated coupled to the target's draw
        (:func:`~tokenswift.drafters.head_based.coupled_rating`). ``draw(q, k)``: draw
        the k tokens from each row's q instead (the rejection verifier's drafts), and
        return the rows' q over the whole vocabulary as well."""
        scorer = self.context.scorer
        if self.options.penalize and scorer is not None:
            extended = torch.cat([logits, logits.new_zeros(len(logits), 1)], dim=1)  # [n, V' + 1]
            window = scorer.window
            # built from the committed tail once per proposal: a list of 1,024 ids per row
            # made a tensor cost 1.6 ms a proposal
            path_ids = torch.tensor(paths, dtype=torch.long, device=tail.device).view(len(paths), -1)
            rows = torch.cat([tail.expand(len(paths), -1), path_ids], 1)
            tails = rows[:, -window:] if window else rows[:, :0]
            # Coupled to the draw, q is ranked untruncated: the target's own truncation
            # decides what it can emit, and q's min-p dropped tokens that p admitted and
            # the noise favoured (the paper's sampling, fixed trees: depth-1 acceptance
            # 55% -> 66%, 1.90 -> 2.22 tokens/step; a 2-core Sapphire Rapids).
            process = scorer.untruncated if noise is not None and draw is None else scorer
            logits = process(self.draft_index[tails], extended)[:, :-1]
        probs = logits.softmax(-1)
        if draw is not None:  # drawn from q, for the rejection verifier: (ids, probs, q over the whole vocabulary)
            q = probs.double().new_zeros(len(probs), self.runner.vocab_size).index_copy_(1, self.draft_token_ids, probs.double())
            q = q / q.sum(-1, keepdim=True)  # a distribution to float64 precision: what is drawn from and tested against
            ids = [draw(row, k) for row in q]
            return ids, [[float(row[t]) for t in row_ids] for row, row_ids in zip(q, ids)], q
        ranking = probs
        if noise is not None:
            ranking, probs = coupled_rating(probs, noise)
        top = ranking.topk(min(k, ranking.shape[-1]), dim=-1)
        ids = [[self.draft_tokens[i] for i in row] for row in top.indices.tolist()]
        return ids, probs.gather(-1, top.indices).tolist(), None

    def _first_from_pass(
        self, root, state, k: int, noise: torch.Tensor | None, draw
    ) -> tuple[list[list[int]], list[list[float]], torch.Tensor | None]:
        """Depth 1 from the drafting pass (``root``: its logits [1, vocab] are the
        target's for the root's next token over the drafting view): the scores
        verification draws from, after the pipeline's penalty and warpers; over the
        whole context they are exactly those. Returns what :meth:`_ranked` does, for
        one row: greedy, the argmax alone (certain over the whole context, nearly so over
        a partial view: the acceptance tracker corrects it); sampled, the k best by
        the coupled rating; with ``draw``, k tokens drawn from the processed q."""
        first = root.output.logits  # [1, vocab]
        scorer = self.context.scorer
        if scorer is None:
            processed, greedy = first[0], False
        else:
            processed, greedy = scorer(scorer.context(state.tokens, device=first.device), first)[0], scorer.sampling.greedy
        if draw is not None:
            q = processed.double().softmax(-1)
            ids = draw(q, k)
            return [ids], [[float(q[t]) for t in ids]], q[None]
        if greedy:
            return [[int(processed.argmax())]], [[1.0]], None
        probs = processed.float().softmax(-1)
        ranking, probs = (probs, probs) if noise is None else coupled_rating(probs, noise)
        top = ranking.topk(min(k, ranking.shape[-1])).indices
        return [top.tolist()], [probs[top].tolist()], None

    @torch.inference_mode()
    def compile_now(self) -> float:
        level = self.parts.level()
        if level is None:
            return 0.0
        before, size, device = level.compile_seconds, self.kv.size, self.runner.device
        for rows in level.rows_to_compile(size):
            mask = torch.zeros(rows, size + rows, dtype=torch.bool, device=device)
            mask[:, size:] = torch.eye(rows, dtype=torch.bool, device=device)
            features = torch.zeros(rows, self.net.config.hidden_size, device=device)
            ids, positions = torch.zeros(rows, dtype=torch.long, device=device), torch.arange(rows, device=device)
            try:
                level(ids, features, positions, self.kv.keys, self.kv.values, mask)
            except CompileUnavailable:
                self.parts.level()  # says so once; eager from now on
                break
        return level.compile_seconds - before

    @property
    def catch_up_seconds(self) -> float:
        """Committing the pairs of the plain steps before this proposal: 3-129 pairs
        through the layer took 2-17 ms in a run on a 2-core AMD EPYC Zen 4, against ~2
        ms for the one to three pairs of a speculative step."""
        return self._catch_up_seconds

    @torch.inference_mode()
    def propose(self, state, inputs):
        self._catch_up_seconds = 0.0
        if not self.pending_tokens:
            return []
        self._proposing = True
        root = inputs.root_pass() if self.options.root_pass else None
        return self._propose(state, inputs, root)

    def _propose(self, state, inputs, root):
        """``root``: the drafting pass of the root (:class:`~tokenswift.interfaces.RootPass`),
        or None: drafted from the layer's own prediction of the root's feature."""
        options = self.options
        self.economy.proposing()
        started = time.perf_counter()
        root_feature, root_logits, root_position = self._commit_pending()
        if self._behind:
            self._catch_up_seconds, self._behind = time.perf_counter() - started, False
        window = self.context.scorer.window if self.context.scorer is not None else 0
        # what the penalty sees of the committed text
        tail = torch.tensor(state.tokens[-window:] if window else [], dtype=torch.long, device=self.runner.device)
        draw = (lambda depth: lambda q, k: inputs.draw_drafts(q, k, depth)) if inputs.sampled else (lambda depth: None)
        breadth = self.breadth_limit
        width, children = min(options.width, breadth), min(options.children, breadth)
        if root is None:
            ids, probs, q = self._ranked(root_logits[None], tail, [[]], children, inputs.noise_of(1, self.draft_token_ids), draw(1))
        else:
            # The target's own feature of the root's position, not the layer's guess of
            # it: depth 2 is drafted as well as depth 1 is without a pass.
            root_feature = self.net.feature(root.output.features[:1].to(device=self.runner.device, dtype=torch.float32))[0]
            ids, probs, q = self._first_from_pass(root, state, children, inputs.noise(1), draw(1))
        sampled = [] if q is None else [SampledChildren([], q[0], ids[0], probs[0])]
        # A candidate the warpers filtered out (probability 0) can never be drawn: dropped.
        kv = self.kv
        level = [_Node([t], [p], p, root_feature, kv.no_pair) for t, p in zip(ids[0], probs[0]) if p > 0]
        drafted = list(level)
        kv.start_proposal()
        device = self.runner.device
        for depth in range(1, self.depth_limit):
            level_started = time.perf_counter()
            expand = sorted((n for n in level if n.chance >= options.threshold), key=lambda n: -n.chance)[:width]
            if inputs.sampled and self.proposed is not None:
                # drawn children are all kept (the tree is exactly what was drawn): draw
                # no more than a step verifies
                expand = expand[: max(0, self.proposed - len(drafted)) // children]
            if not expand:
                break
            # each expanded node's pair sees the committed pairs and its ancestors' pairs
            visible = kv.visible(torch.tensor([n.parent_pair for n in expand], device=device))
            own = torch.eye(len(expand), dtype=torch.bool, device=device)
            keys, values, out, logits = self._forward(
                [n.tokens[-1] for n in expand], torch.stack([n.feature for n in expand]),
                torch.full((len(expand),), root_position + depth, device=device), visible, own,
            )  # out: [w, H]
            pairs = kv.draft(keys, values, visible).tolist()
            ids, probs, q = self._ranked(
                logits, tail, [n.tokens for n in expand], children, inputs.noise_of(depth + 1, self.draft_token_ids), draw(depth + 1)
            )
            if q is not None:
                sampled.extend(SampledChildren(n.tokens, q[row], ids[row], probs[row]) for row, n in enumerate(expand))
            level = []
            for row, node in enumerate(expand):
                for token, p in zip(ids[row], probs[row]):
                    if p > 0:
                        path, confidence = node.tokens + [token], node.confidence + [p]
                        level.append(_Node(path, confidence, node.chance * p, out[row], pairs[row]))
            drafted.extend(level)
            self.economy.level_took(time.perf_counter() - level_started)
        if inputs.sampled:  # every drawn child recorded with its q: the tree is exactly what was drawn
            return sampled
        drafted.sort(key=lambda n: -n.chance)  # best first; a stable sort keeps parents before children at ties
        return [Branch(n.tokens, n.confidence) for n in drafted[: self.proposed]]
