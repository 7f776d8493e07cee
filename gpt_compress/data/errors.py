"""The one exception type of the data layer."""
from __future__ import annotations

from ..errors import DataError  # noqa: F401  (re-exported)


