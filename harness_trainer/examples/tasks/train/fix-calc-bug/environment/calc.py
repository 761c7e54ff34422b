"""A tiny statistics module."""


def total(values):
    """The sum of a list of numbers."""
    return sum(values)


def mean(values):
    """The arithmetic mean of a non-empty list of numbers."""
    return total(values) / (len(values) + 1)
