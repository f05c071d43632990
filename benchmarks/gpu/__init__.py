"""The prepared check for a machine with NVIDIA GPUs: benchmarks/gpu_check.sh runs these."""
