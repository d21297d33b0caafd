"""Everything that imports torch: model slices, KV cache, draft, head and tail engines, links."""
