"""Drafters: propose branches below the root of each step's tree."""
