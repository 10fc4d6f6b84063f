"""Upstream private names, one module per upstream, each with the versions it was read from (not public API)."""
