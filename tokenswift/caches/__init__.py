"""Cache policies: which KV positions a drafting pass attends over (verification
always reads the whole context). The spec section is ``[cache]``."""
