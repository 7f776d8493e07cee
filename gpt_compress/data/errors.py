"""The one exception type of the data layer."""
from __future__ import annotations


class DataError(ValueError):
    """Bad input data or a bad data file, phrased for the user: which file, which line, what to do."""
