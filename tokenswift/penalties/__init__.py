"""Penalties: per-node logits transforms that see each node's own context."""
