"""Retrievers: propose branches taken from the text so far."""
