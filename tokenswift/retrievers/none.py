"""The ``none`` retriever: retrieves nothing."""

from __future__ import annotations

from tokenswift.interfaces import Retriever


class NoRetriever(Retriever):
    """Retrieves nothing."""

    def retrieve(self, state, first_tokens):
        return []
