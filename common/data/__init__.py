"""Data rules: formats, tokenising, truncation, packing, batching, and the step sources of each task."""
