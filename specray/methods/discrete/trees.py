"""Static draft trees (EAGLE-1 / LANTERN++ style, spec discrete_sd §3.5); torch-free.

A tree is a set of node *paths*: path ``(i_1, ..., i_t)`` is the ``i_t``-th child (0-based, in
drafting order) of node ``(i_1, ..., i_{t-1})``; the root, the empty path, is the last committed
token. At every node the drafter samples its children without replacement from its processed
distribution, so a node with ``m`` children has the child indices ``0 .. m-1``, and every prefix of
a path is a path. Verification walks down one path: at each node it tries the children in order.

Nodes are numbered ``0 .. N``: 0 is the root, then the paths sorted by (depth, path), which is the
order of the verify call's tokens (a node's parent always comes first).

The named trees are written as *children counts*: ``{parent path: number of children}``.
``eagle57`` is the 57-node, depth-5 tree LANTERN++ uses for LlamaGen (its code calls it
``naive_extend_57``); ``eagle25`` the 25-node, depth-5 tree of EAGLE-1 (``mc_sim_7b_63``), LANTERN++'s
default for Lumina-mGPT; ``small`` is a 9-node, depth-4 tree sized for the CPU, where a verify
call costs about its number of tokens at large batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

Path = tuple[int, ...]

# Children counts per parent path.
_EAGLE57: dict[Path, int] = {
    (): 5,
    (0,): 4, (1,): 3, (2,): 3, (3,): 2, (4,): 1,
    (0, 0): 4, (0, 1): 3, (0, 2): 3, (0, 3): 2, (1, 0): 2, (1, 1): 1, (2, 0): 1,
    (0, 0, 0): 4, (0, 0, 1): 3, (0, 0, 2): 2, (0, 0, 3): 1, (0, 1, 0): 2, (0, 1, 1): 1, (0, 2, 0): 1,
    (0, 0, 0, 0): 3, (0, 0, 0, 1): 2, (0, 0, 1, 0): 2, (0, 0, 1, 1): 1, (0, 0, 2, 0): 1,
}
_EAGLE25: dict[Path, int] = {
    (): 4,
    (0,): 3, (1,): 2, (2,): 2, (3,): 1,
    (0, 0): 3, (0, 1): 2, (0, 2): 2, (1, 0): 1,
    (0, 0, 0): 3,
    (0, 0, 0, 0): 2,
}
_SMALL: dict[Path, int] = {
    (): 3,
    (0,): 2, (1,): 1,
    (0, 0): 1,
    (0, 0, 0): 1,
}


class TreeError(ValueError):
    """A tree that is not a valid static draft tree."""


def paths_from_counts(counts: Mapping[Path, int]) -> list[Path]:
    """Every node path of a tree given as ``{parent path: number of children}``."""
    return [tuple(parent) + (i,) for parent, n in counts.items() for i in range(n)]


@dataclass(frozen=True)
class StaticTree:
    """A validated static tree; ``paths`` sorted by (depth, path), node ``k + 1`` is ``paths[k]``."""

    paths: tuple[Path, ...]
    name: str = "custom"

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], name: str = "custom") -> "StaticTree":
        """Validate ``paths`` (raises :class:`TreeError` saying what is wrong)."""
        if not paths:
            raise TreeError("a tree needs at least one node path, e.g. [[0], [1], [0, 0]]")
        nodes: set[Path] = set()
        for path in paths:
            node = tuple(path)
            if not node:
                raise TreeError("the empty path is the root (the last committed token); list only its descendants")
            if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in node):
                raise TreeError(f"path {list(node)}: child indices must be integers >= 0")
            if node in nodes:
                raise TreeError(f"path {list(node)} is listed twice")
            nodes.add(node)
        for node in nodes:
            if len(node) > 1 and node[:-1] not in nodes:
                raise TreeError(f"path {list(node)}: its parent {list(node[:-1])} is not in the tree")
            if node[-1] > 0 and node[:-1] + (node[-1] - 1,) not in nodes:
                raise TreeError(f"path {list(node)}: child {node[-1]} needs its elder sibling "
                                f"{list(node[:-1] + (node[-1] - 1,))} (children are drafted in order)")
        return cls(tuple(sorted(nodes, key=lambda p: (len(p), p))), name)

    @classmethod
    def chain(cls, length: int) -> "StaticTree":
        """A single path of ``length`` nodes (one child per node): chain drafting as a tree."""
        return cls.from_paths([(0,) * t for t in range(1, length + 1)], f"chain{length}")

    # ---- structure (node 0 is the root) --------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Drafted nodes (the root excluded)."""
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @cached_property
    def index(self) -> dict[Path, int]:
        return {(): 0, **{p: k + 1 for k, p in enumerate(self.paths)}}

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of every node (root 0)."""
        return (0, *(len(p) for p in self.paths))

    @cached_property
    def parents(self) -> tuple[int, ...]:
        """Parent node of every node (-1 for the root)."""
        return (-1, *(self.index[p[:-1]] for p in self.paths))

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Children of every node, in drafting order."""
        out: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for k, p in enumerate(self.paths):
            out[self.index[p[:-1]]].append(k + 1)
        return tuple(tuple(c) for c in out)

    @cached_property
    def internal(self) -> tuple[int, ...]:
        """Nodes with children (the root first), i.e. where the drafter's distribution is needed."""
        return tuple(v for v, c in enumerate(self.children) if c)

    @property
    def max_children(self) -> int:
        return max(len(c) for c in self.children)

    @cached_property
    def levels(self) -> tuple[tuple[int, ...], ...]:
        """Internal nodes by depth: ``levels[t]`` are the internal nodes at depth ``t``."""
        return tuple(tuple(v for v in self.internal if self.depths[v] == t) for t in range(self.depth))

    def ancestors(self, node: int) -> list[int]:
        """``node`` and its ancestors down to the root's child (the root excluded), deepest first."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out


NAMED_TREES: dict[str, StaticTree] = {
    "eagle57": StaticTree.from_paths(paths_from_counts(_EAGLE57), "eagle57"),
    "eagle25": StaticTree.from_paths(paths_from_counts(_EAGLE25), "eagle25"),
    "small": StaticTree.from_paths(paths_from_counts(_SMALL), "small"),
}


def resolve_tree(tree: str | Sequence[Sequence[int]]) -> StaticTree:
    """A named tree or an explicit list of paths (TreeError naming the allowed names)."""
    if isinstance(tree, str):
        try:
            return NAMED_TREES[tree]
        except KeyError:
            raise TreeError(f"unknown tree {tree!r}; allowed: {', '.join(NAMED_TREES)} "
                            "or a list of node paths") from None
    return StaticTree.from_paths(tree)
