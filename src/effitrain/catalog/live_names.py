"""The names of a registry that grows (optimizers, objectives): a sequence read when asked, so that config's
choices and --help include an entry registered later (a plug-in, a test); and the catalog of named entries the
objectives' registries keep."""

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


class Catalog:
    """Entries with a `name` and `words` (what --help says of each), in the order added; `names` their live names."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict = {}
        self.names = LiveNames(self._entries)

    def add(self, entry):
        if entry.name in self._entries:
            raise ValueError(f"{self.kind} {entry.name} is registered already")
        self._entries[entry.name] = entry
        return entry

    def get(self, name: str | None):
        return self._entries.get(name)

    def entries(self) -> list:
        return list(self._entries.values())

    def listed(self) -> str:
        """'a (its words), b (its words) or c (its words)', for a flag's help."""
        described = [f"{entry.name} ({entry.words})" for entry in self._entries.values()]
        return ", ".join(described[:-1]) + " or " + described[-1] if len(described) > 1 else "".join(described)
