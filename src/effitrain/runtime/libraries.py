"""The libraries effitrain runs on: their versions (env, the model card) and their logging, kept quiet
unless --debug so that a user error stays one line."""

from __future__ import annotations


def quiet_libraries(debug: bool) -> None:
    """transformers prints a load report and progress bars, torchao and torch warn at import: keep them
    for --debug only, so that a user error stays one line on stderr."""
    import datasets
    import transformers

    if not debug:
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
        quiet_import_warnings()
        quiet_known_warnings()


def quiet_import_warnings() -> None:
    """Libraries that log warnings when merely imported (torchao's optional kernels, torch's pytree,
    bitsandbytes looking for its CPU kernel on the Hub through `kernels`), and peft's use of a name
    transformers has deprecated."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
    for name in ("torchao", "torch.utils._pytree", "bitsandbytes", "kernels"):
        logging.getLogger(name).setLevel(logging.ERROR)


# Warnings known to be harmless in the runs effitrain makes, each with the test that shows it.
KNOWN_HARMLESS = (
    # peft on GPT-2's Conv1D layers (weights stored in x out): it sets fan_in_fan_out itself, and warns that it
    # did; the adapters' outputs and gradients are right (tests/unit/test_models.py, its Conv1D LoRA test).
    "fan_in_fan_out is set to False but the target module is `Conv1D`",
    # FSDP2 when a sharded module returns a view: effitrain's step does no in-place op on module outputs, and
    # training under FSDP equals one process (tests/integration/test_sharding.py, its equivalence test).
    r"FSDP2-wrapped module \(.*\) returned a view tensor",
)


def quiet_known_warnings() -> None:
    """Library warnings effitrain has checked are harmless here: off stderr unless --debug, each by its
    message, so that any other warning of the same libraries still shows."""
    import warnings

    for message in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


LIBRARIES = ("effitrain", "torch", "transformers", "accelerate", "datasets", "safetensors",
             "bitsandbytes", "torchao")


def versions() -> dict[str, str | None]:
    from importlib import metadata  # not at import: every command loads this module to quiet the libraries

    found = {}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found
