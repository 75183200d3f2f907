"""rlfusion: RL post-training of Mixture-of-Experts language models that keeps every device busy."""

__version__ = "0.1.0"
