"""Model implementations over the paged KV cache (one flat file per family)."""
