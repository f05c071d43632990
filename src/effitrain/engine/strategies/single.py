"""One process (--strategy ddp, the default, without peers): accelerate leaves the model unwrapped and
its no_sync is a plain context; clipping as DDP's on CPUs."""

from __future__ import annotations

from effitrain.engine.strategies.ddp import Ddp


class Single(Ddp):
    def count_traffic(self, model, wire) -> None:
        """Nothing crosses a wire (and the model has no DDP wrapper to hook)."""
