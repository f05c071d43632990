"""Models: found and loaded offline (loading), LoRA/QLoRA adapters through peft (adapters), the ordered
pipeline of transforms every model goes through (transforms), saved models read back for predict and
evaluate (saved), the transformer blocks that FSDP shards and --compile compiles (blocks), the character
tokenizer a model built from a config may take (character_tokenizer)."""
