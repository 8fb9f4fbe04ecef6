"""Cache policies: which KV positions drafting forwards attend over."""
