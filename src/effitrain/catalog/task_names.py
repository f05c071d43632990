"""The kinds of task effitrain trains, by name (--task): config's choices, and the keys of the table of
task constructors in tasks/ (a test keeps the two the same)."""

NAMES = ("sequence-classification", "image-classification", "audio-classification", "causal-lm")
