"""effitrain against its peers (transformers' Trainer, TRL, a plain transformers loop) on the same job."""
