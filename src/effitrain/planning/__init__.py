"""Memory planning: predict the peak of a training configuration before launch, and fit a budget."""
