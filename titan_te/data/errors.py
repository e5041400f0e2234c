"""DataError: bad input data (a missing path, an empty dataset, bad UTF-8, a corrupt shard ...)."""
from titan_te.config import ConfigError


class DataError(ConfigError):
    """Reported like a config mistake (exit code 2, one line naming the file or setting)."""

    def __init__(self, msg: str):
        super().__init__(msg)
        self.msg = msg

    def __reduce__(self):  # survives the trip from a DataLoader worker to the main process
        return (type(self), (self.msg,))
