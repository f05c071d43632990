"""The kinds of task effitrain trains, by name (--task): config's choices, and the keys of the table of
task constructors in tasks/ (a test keeps the two the same)."""

NAMES = ("sequence-classification", "image-classification", "audio-classification", "causal-lm")

# --distill-temperature's default per task (config.resolved): Hinton's 2.0 softens a classifier's few logits; a
# causal LM's distribution over its vocabulary is learnt as it is sampled (1.0, as TRL's GKD and on-policy
# distillation do).
DISTILL_TEMPERATURE = {"sequence-classification": 2.0, "image-classification": 2.0, "audio-classification": 2.0,
                       "causal-lm": 1.0}
