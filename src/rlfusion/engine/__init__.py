"""Rollout engine: a pure-Python scheduler that plans, a runner that owns tensors and the KV cache."""
