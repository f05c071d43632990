"""The training engine: the Accelerator loop and the pieces it switches on."""
