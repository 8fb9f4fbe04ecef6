"""Tree templates: which top-k candidates of each depth form the draft tree, and the
``tree.json`` files that keep a template fitted for a set of heads.

A template is either a list of widths per depth (``[1, 3, 3, 3]``: the top-1 at depth
1, under it the top-3 of depth 2, under each of those the top-3 of depth 3, ... i.e.
1 + 3 + 9 + 27 nodes) or explicit index paths (``[[0], [0, 0], [0, 1], [1]]``: each
a path of top-k ranks from depth 1 down; missing prefixes are implied).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path

from tokenswift.errors import SpecError
from tokenswift.tree import Branch


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def index_paths(template) -> list[tuple[int, ...]]:
    """The template as sorted, prefix-closed index paths; raises SpecError if malformed."""
    if not isinstance(template, Sequence) or isinstance(template, str) or not template:
        raise SpecError(f"drafter.tree must be a non-empty list of widths or of index paths, got {template!r}")
    if all(_is_int(w) for w in template):
        if any(w < 1 for w in template):
            raise SpecError(f"drafter.tree widths must be >= 1, got {list(template)}")
        paths = []
        for depth in range(1, len(template) + 1):
            paths.extend(itertools.product(*(range(w) for w in template[:depth])))
        return paths
    if all(isinstance(p, Sequence) and not isinstance(p, str) for p in template):
        paths = set()
        for path in template:
            if not path or not all(_is_int(i) and i >= 0 for i in path):
                raise SpecError(
                    f"drafter.tree index paths must be non-empty lists of ranks >= 0, got {list(path)!r} in {template!r}"
                )
            for end in range(1, len(path) + 1):
                paths.add(tuple(path[:end]))
        return sorted(paths, key=lambda p: (len(p), p))
    raise SpecError(
        f"drafter.tree must be a list of widths (e.g. [1, 3, 3, 3]) or of index paths "
        f"(e.g. [[0], [0, 0], [1]]), got {template!r}"
    )


def depth_widths(paths: list[tuple[int, ...]]) -> list[int]:
    """How many top-k candidates each depth needs: [max rank + 1 per depth]."""
    depth = max(len(p) for p in paths)
    return [1 + max(p[d] for p in paths if len(p) > d) for d in range(depth)]


def branches(paths: list[tuple[int, ...]], candidates: list[list[int]], confidences: list[list[float]] | None = None) -> list:
    """Token branches for ``paths`` given ``candidates[d]``, the ranked tokens of depth
    d+1 (and, optionally, ``confidences[d]``: their chances of acceptance, which make the
    branches :class:`~tokenswift.tree.Branch` objects). Only leaf paths are returned
    (their prefixes are implied in the trie)."""
    inner = {path[:-1] for path in paths}
    leaves = [path for path in paths if path not in inner]
    if confidences is None:
        return [[candidates[d][rank] for d, rank in enumerate(path)] for path in leaves]
    return [
        Branch(
            tokens=[candidates[d][rank] for d, rank in enumerate(path)],
            confidence=[confidences[d][rank] for d, rank in enumerate(path)],
        )
        for path in leaves
    ]


# -- tree files: a template saved beside the heads it was fitted for -----------------

TREE_NAME = "tree.json"
TREE_FORMAT = "tokenswift-tree/1"


def save_tree(directory, drafter: str, paths: Sequence[Sequence[int]], record: dict) -> Path:
    """Write ``tree.json`` (index paths + the fit's record) in ``directory``; returns its path."""
    path = Path(directory) / TREE_NAME
    data = {"format": TREE_FORMAT, "drafter": drafter, "paths": [list(p) for p in paths], **record}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path


def load_tree(directory, drafter: str) -> list[list[int]] | None:
    """The tree saved in ``directory`` for ``drafter``, if any (index paths)."""
    path = Path(directory) / TREE_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecError(f"cannot read the fitted tree {path}: {exc}") from None
    if data.get("format") != TREE_FORMAT or not isinstance(data.get("paths"), list):
        raise SpecError(f"{path} is not a {TREE_FORMAT} file (format {data.get('format')!r})")
    if data.get("drafter") != drafter:
        return None
    return data["paths"]
