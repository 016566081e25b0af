"""Flax NNX models with a functional paged-KV forward."""
