"""Data: sources (where examples come from) -> preprocessing (Auto processors) -> batches."""
