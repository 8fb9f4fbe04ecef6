"""Verifiers: walk the scored tree and decide what is accepted."""
