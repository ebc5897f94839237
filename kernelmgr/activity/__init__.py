"""Activity sources: where the project learns what a kernel is doing (NVML today)."""
