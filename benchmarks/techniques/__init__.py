"""Techniques (padding, checkpointing, compile, adapters, optimizers, chat and preference tuning): what each one
buys and costs."""
