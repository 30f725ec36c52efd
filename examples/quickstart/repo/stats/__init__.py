"""Small statistics helpers used by the troupe quickstart."""

from stats.core import mean

__all__ = ["mean"]
