"""The objectives --preference picks, by name, with what config needs of each before anything loads: its
words in --help, the preference flags only it takes, whether it compares with a reference model. The
classes that train them (tasks/objectives/) are keyed by the same names (a test keeps the two the same);
`tasks.objectives.register` adds a new objective's entry here with its class."""

from __future__ import annotations

from dataclasses import dataclass

from effitrain.catalog.live_names import Catalog


@dataclass(frozen=True)
class ObjectiveName:
    name: str
    words: str  # what --preference's help says of it
    settings: tuple[str, ...] = ()  # the preference flags, --beta aside, that only it takes
    reference: bool = False  # it compares the policy with a reference model (--reference, its default)
    without: str = "has its own loss"  # what refusing another objective's flag says of this one


_CATALOG = Catalog("objective")
NAMES, add, get = _CATALOG.names, _CATALOG.add, _CATALOG.get


def help_text() -> str:
    """--preference's help, from every registered objective's words."""
    return ("--task causal-lm on preference pairs (`prompt`, `chosen`, `rejected`, or `chosen` and `rejected` "
            f"conversations): {_CATALOG.listed()}")


add(ObjectiveName("dpo", "direct preference optimisation against a reference model",
                  settings=("reference", "dpo_loss", "dpo_label_smoothing"), reference=True))
add(ObjectiveName("orpo", "odds-ratio preference optimisation: the chosen answer's loss plus an odds-ratio term, "
                  "no reference", without="has no reference model and its own loss"))
