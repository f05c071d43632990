"""The memory planner's predictions against measured peaks, and what the allocator keeps beyond the tensors."""
