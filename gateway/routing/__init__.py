"""Where a request goes: the live state table of every backend, its column snapshot, and the pure routing policies."""
