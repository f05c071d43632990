"""Models: found and loaded offline (loading), LoRA/QLoRA adapters through peft (adapters), saved
models read back for predict and evaluate (saved), the transformer blocks that FSDP shards and
--compile compiles (blocks)."""
