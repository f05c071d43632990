"""The names of a registry that grows (optimizers, objectives): a sequence read when asked, so that config's
choices and --help include an entry registered later (a plug-in, a test)."""

from __future__ import annotations

from collections.abc import Sequence


class LiveNames(Sequence):
    """The keys of `registry` in their order, read at each use."""

    def __init__(self, registry: dict):
        self._registry = registry

    def __getitem__(self, index):
        return tuple(self._registry)[index]

    def __len__(self) -> int:
        return len(self._registry)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(tuple(self._registry))
