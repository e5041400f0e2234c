"""DataError lives in titan_te.errors; re-exported here for the data modules."""
from titan_te.errors import DataError

__all__ = ["DataError"]
