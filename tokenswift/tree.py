"""Draft trees: the candidate tokens of one decoding step, arranged as a trie.

Node 0 is the root: the last committed token, whose KV is not stored yet. Every other
node is a proposed token; its parent is the node before it on its branch. Branches
from the drafter and the retriever are merged into one trie, so the children of a
node carry distinct tokens and the path that matches a sampled sequence is unique.

Each node also carries a *confidence*: the proposer's estimate of the chance that the
node is accepted once its parent is (None where the proposer gave none). Confidences
only steer which nodes are worth verifying; they never change what is accepted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import torch

DRAFTER = 0
RETRIEVER = 1
SOURCE_NAMES = {DRAFTER: "drafter", RETRIEVER: "retriever"}


@attrs.frozen
class Branch:
    """A token sequence below the root, with an optional confidence per token (the
    chance it is accepted given that the tokens before it are)."""

    tokens: Sequence[int]
    confidence: Sequence[float | None] | None = None


@attrs.frozen(eq=False)
class SampledChildren:
    """Children drawn from a distribution, for verifiers that need to know it (the
    ``rejection`` verifier): below the node reached by ``path`` (tokens from depth 1; empty:
    the root), ``tokens`` drawn one after another without replacement from ``q``
    ([vocab], the drafter's processed distribution there), in the order drawn, each with
    an optional confidence."""

    path: Sequence[int]
    q: torch.Tensor
    tokens: Sequence[int]
    confidence: Sequence[float | None] | None = None


@attrs.define(eq=False, repr=False)
class DraftTree:
    """tokens[i], parents[i] (-1 for the root), depths[i] (0 for the root), sources[i]
    (DRAFTER or RETRIEVER; the first branch to add a node owns it) and confidence[i];
    proposals[node]: the distribution ``sampled[node]`` (child nodes, in the order
    drawn) were drawn from, for nodes whose children were sampled
    (:class:`SampledChildren`)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    sources: list[int]
    confidence: list[float | None]
    _children: list[dict[int, int]] = attrs.field(factory=list)
    proposals: dict[int, torch.Tensor] = attrs.field(factory=dict)
    sampled: dict[int, list[int]] = attrs.field(factory=dict)

    def __repr__(self) -> str:
        return f"DraftTree(nodes={len(self.tokens)}, depth={max(self.depths)})"

    @classmethod
    def root_only(cls, root_token: int) -> DraftTree:
        return cls(tokens=[int(root_token)], parents=[-1], depths=[0], sources=[DRAFTER], confidence=[1.0], children=[{}])

    @classmethod
    def from_branches(cls, root_token: int, branches: Iterable, source: int = DRAFTER) -> DraftTree:
        tree = cls.root_only(root_token)
        tree.add_branches(branches, source)
        return tree

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return max(self.depths)

    def children(self, node: int) -> dict[int, int]:
        """token -> child node index."""
        return self._children[node]

    def add_branch(self, branch, source: int = DRAFTER, parent: int = 0) -> int:
        """Add a branch (a token sequence or a :class:`Branch`) below ``parent``, reusing
        existing nodes; return its last node. A node reached again keeps the larger
        confidence."""
        if isinstance(branch, Branch):
            tokens, confidence = branch.tokens, branch.confidence
        else:
            tokens, confidence = branch, None
        node = parent
        for i, token in enumerate(tokens):
            token = int(token)
            value = None if confidence is None or confidence[i] is None else float(confidence[i])
            child = self._children[node].get(token)
            if child is None:
                child = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self.depths.append(self.depths[node] + 1)
                self.sources.append(source)
                self.confidence.append(value)
                self._children.append({})
                self._children[node][token] = child
            elif value is not None and (self.confidence[child] is None or value > self.confidence[child]):
                self.confidence[child] = value
            node = child
        return node

    def add_branches(self, branches: Iterable, source: int = DRAFTER) -> None:
        """Add branches (token lists, :class:`Branch`) and :class:`SampledChildren`."""
        for branch in branches:
            if isinstance(branch, SampledChildren):
                self.add_sampled(branch, source)
            else:
                self.add_branch(branch, source)

    def add_sampled(self, children: SampledChildren, source: int = DRAFTER) -> None:
        parent = self.add_branch(list(children.path), source) if len(children.path) else 0
        if parent in self.proposals:
            raise ValueError(f"node {parent} already has sampled children: one distribution per node")
        self.proposals[parent] = children.q
        order = self.sampled[parent] = []
        confidence = children.confidence
        for i, token in enumerate(children.tokens):
            value = None if confidence is None else confidence[i]
            child = self.add_branch(Branch([token], [value]), source, parent=parent)
            if child in order:
                raise ValueError(f"token {token} drawn twice below node {parent}: draws are without replacement")
            order.append(child)

    def path(self, node: int) -> list[int]:
        """Node indices from the first node below the root down to ``node``."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path(node)]

    def leaves(self) -> list[int]:
        return [i for i in range(len(self.tokens)) if not self._children[i]]

    def paths(self) -> list[list[int]]:
        """Root-to-leaf paths (node indices, root excluded)."""
        return [self.path(leaf) for leaf in self.leaves()]

    def subtree(self, keep: Sequence[int]) -> DraftTree:
        """A new tree of the nodes ``keep`` (node indices; the root and every kept
        node's parent must be kept too), in the order given."""
        index = {old: new for new, old in enumerate(keep)}
        if keep[0] != 0 or any(self.parents[old] not in index for old in keep[1:]):
            raise ValueError("a subtree must start at the root and keep every kept node's parent")
        tree = DraftTree.root_only(self.tokens[0])
        for old in keep[1:]:
            parent = index[self.parents[old]]
            tree.tokens.append(self.tokens[old])
            tree.parents.append(parent)
            tree.depths.append(self.depths[old])
            tree.sources.append(self.sources[old])
            tree.confidence.append(self.confidence[old])
            tree._children.append({})
            tree._children[parent][self.tokens[old]] = len(tree.tokens) - 1
        for old, q in self.proposals.items():
            if old in index:
                tree.proposals[index[old]] = q
                # What was drawn, as far as it was kept: a cut of the draws in their order
                # (see the rejection verifier for why no other cut is allowed).
                kept = []
                for child in self.sampled[old]:
                    if child not in index:
                        break
                    kept.append(index[child])
                tree.sampled[index[old]] = kept
        return tree

    def mask(self, device=None) -> torch.Tensor:
        """[n, n] bool: row i is True at i and at its ancestors."""
        n = len(self.tokens)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, i] = True
            parent = self.parents[i]
            if parent >= 0:
                mask[i] |= mask[parent]
        return mask.to(device)

    def token_tensor(self, device=None) -> torch.Tensor:
        return torch.tensor(self.tokens, dtype=torch.long, device=device)

    def depth_tensor(self, device=None) -> torch.Tensor:
        return torch.tensor(self.depths, dtype=torch.long, device=device)
