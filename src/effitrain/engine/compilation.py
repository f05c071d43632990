"""--compile: what compiling costs, and no silent fall-back to eager. The blocks are compiled by the last
entry of models/transforms.py (compile_blocks), per transformer block (regional compilation).

The blocks (models/blocks.py: the repeated layers) are alike, so dynamo compiles one of them and the
others reuse its graph: six layers cost one compile, as in PyTorch's regional compilation recipe and
accelerate's `use_regional_compilation`. Each block is compiled in place (`nn.Module.compile`), as
accelerate does for FSDP2 and DeepSpeed, rather than with `accelerate.utils.compile_regions`, which
returns shallow copies and compiles every other module too (embeddings, pooler, head) as graphs of
their own: in place, the parameter names, state dict, save_pretrained and DDP's wrapping stay those
of the plain model.

Shapes: batches are padded to a multiple of 8 as without --compile, and dynamo's automatic dynamic
shapes turn the sequence and batch sizes into symbols at the first size that changes, so a run
compiles a few graphs whatever its lengths (benchmarks/techniques/compile.py measured it against padding to
power-of-two buckets with static graphs: those compiled more graphs, for longer, and ran slower).
Evaluation stays eager (engine/evaluator.py). Dynamo's counters give the graphs and seconds, reported
apart from the training time."""

from __future__ import annotations

import contextlib

import torch

from effitrain.errors import UserError
from effitrain.models.blocks import blocks

# Graphs per compiled function before dynamo gives up. Its default (8) would, once reached, silently
# run the blocks eagerly; here reaching the limit stops the run and says so.
RECOMPILE_LIMIT = 32


# What dynamo times: a forward graph's compile (tracing, AOT autograd, inductor), and the compile of its
# backward, which AOT autograd defers to the first backward call (measured: up to half the seconds).
COMPILE_PHASES = ("_compile.compile_inner", "backward._backward_impl")


def totals() -> tuple[int, float]:
    """(graphs compiled, seconds spent compiling forward and backward graphs) in this process so far."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(sum(compilation_time_metrics.get(phase, [])) for phase in COMPILE_PHASES)
    return counters["stats"]["unique_graphs"], seconds


class Watch:
    """What compiling has cost since the run started (dynamo's counters are per process: a test
    process runs many runs)."""

    def __init__(self, blocks: int):
        self.blocks = blocks
        self.start_graphs, self.start_seconds = totals()

    def since_start(self) -> tuple[int, float]:
        graphs, seconds = totals()
        return graphs - self.start_graphs, seconds - self.start_seconds

    def summary(self) -> dict:
        graphs, seconds = self.since_start()
        return {"blocks": self.blocks, "graphs": graphs, "seconds": seconds}


def watch(model: torch.nn.Module, applied: list[str], cleanup: contextlib.ExitStack) -> Watch | None:
    """With the compile stage applied: what compiling costs from now on, under a recompile limit that
    stops the run rather than going eager (for as long as `cleanup` is open)."""
    if "compile" not in applied:
        return None
    cleanup.enter_context(no_silent_fallback())
    return Watch(len(blocks(model)))


@contextlib.contextmanager
def no_silent_fallback():
    """Dynamo's recompile limit raised for the run, and reaching it an error rather than eager blocks."""
    import torch._dynamo

    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
        try:
            yield
        except torch._dynamo.exc.FailOnRecompileLimitHit as err:
            raise UserError(f"--compile: a block was compiled for {RECOMPILE_LIMIT} different input kinds (shapes, "
                            "dtypes or modes) and would otherwise run uncompiled from now on",
                            "drop --compile for this data (its inputs vary too much for compiled graphs)") from err
