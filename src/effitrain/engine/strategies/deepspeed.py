"""--strategy deepspeed: accelerate's DeepSpeed plugin (ZeRO), on accelerators only. Everything else
goes through accelerate as in the base class: DeepSpeed's engine wraps the model and optimizer, and
clips inside its own step."""

from __future__ import annotations

from effitrain.engine.strategies.strategy import Strategy
from effitrain.errors import UserError
from effitrain.runtime import devices


class DeepSpeed(Strategy):
    name = "deepspeed"
    replicates = False
    resplits_steps = False  # effitrain re-splits the steps of replicas (DDP) only

    @classmethod
    def plugins(cls, config) -> dict:
        """accelerate runs DeepSpeed on accelerators only, so on a CPU it is refused (accelerate would fall
        back to DDP without a word)."""
        if not devices.has_accelerator():
            raise UserError(f"--strategy {cls.name} needs GPUs (accelerate runs DeepSpeed on accelerators only, "
                            "and on a CPU would silently fall back to DDP)",
                            "use --strategy fsdp (sharded) or ddp on CPUs")
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            raise UserError("--strategy deepspeed needs DeepSpeed, which is not installed",
                            "pip install 'effitrain[deepspeed]'")
        from accelerate.utils import DeepSpeedPlugin

        # DeepSpeed clips inside its engine step: accelerate's clip_grad_norm_ does nothing there.
        return {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=config.zero_stage, gradient_accumulation_steps=1,
                                                    gradient_clipping=config.max_grad_norm or None,
                                                    zero3_save_16bit_model=True)}
