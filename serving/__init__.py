"""Serving: HTTP question answering over partitioned replica gangs."""
