import pytest

from stats.core import mean


def test_mean_of_integers():
    assert mean([1, 2, 3, 4]) == 2.5


def test_mean_rejects_empty_input():
    with pytest.raises(ValueError):
        mean([])
