"""The MoE decoder, its presets, tokenizers and checkpoints. Knows nothing about parallelism or RL."""
