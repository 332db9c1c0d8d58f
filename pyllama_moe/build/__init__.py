"""Builds: cmake + ninja keyed by content (builder), the embedded build key (info), the cffi loader (ffi)."""
