"""Models: configs and presets, initial weights, RoPE, Hugging Face folders, PEFT adapters."""
