"""The objectives --preference picks, by name, with what config needs of each before anything loads: its
words in --help, the preference flags only it takes, whether it compares with a reference model. The
classes that train them (tasks/objectives/) are keyed by the same names (a test keeps the two the same);
`tasks.objectives.register` adds a new objective's entry here with its class."""

from __future__ import annotations

from dataclasses import dataclass

from effitrain.catalog.live_names import LiveNames


@dataclass(frozen=True)
class ObjectiveName:
    name: str
    words: str  # what --preference's help says of it
    settings: tuple[str, ...] = ()  # the preference flags, --beta aside, that only it takes
    reference: bool = False  # it compares the policy with a reference model (--reference, its default)
    without: str = "has its own loss"  # what refusing another objective's flag says of this one


_ENTRIES: dict[str, ObjectiveName] = {}
NAMES = LiveNames(_ENTRIES)


def add(entry: ObjectiveName) -> ObjectiveName:
    if entry.name in _ENTRIES:
        raise ValueError(f"objective {entry.name} is registered already")
    _ENTRIES[entry.name] = entry
    return entry


def get(name: str | None) -> ObjectiveName | None:
    return _ENTRIES.get(name)


def help_text() -> str:
    """--preference's help, from every registered objective's words."""
    described = [f"{entry.name} ({entry.words})" for entry in _ENTRIES.values()]
    listed = ", ".join(described[:-1]) + " or " + described[-1] if len(described) > 1 else "".join(described)
    return ("--task causal-lm on preference pairs (`prompt`, `chosen`, `rejected`, or `chosen` and `rejected` "
            f"conversations): {listed}")


add(ObjectiveName("dpo", "direct preference optimisation against a reference model",
                  settings=("reference", "dpo_loss", "dpo_label_smoothing"), reference=True))
add(ObjectiveName("orpo", "odds-ratio preference optimisation: the chosen answer's loss plus an odds-ratio term, "
                  "no reference", without="has no reference model and its own loss"))
