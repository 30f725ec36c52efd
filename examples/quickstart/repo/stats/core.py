"""Descriptive statistics over sequences of numbers."""


def mean(values):
    """Return the arithmetic mean of a non-empty sequence."""
    if not values:
        raise ValueError("mean() needs at least one value")
    return sum(values) / len(values)
