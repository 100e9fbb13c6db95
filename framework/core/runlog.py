"""run.log's handler: the run's log continued where it ends, never written through a link (a log file planted as
a link to a checkpoint would otherwise get every line appended to the checkpoint's bytes)."""

from __future__ import annotations

import logging
from pathlib import Path

from framework.core import files

# The libraries of checkpoint.remote's store, whose records go to run.log alone, at WARNING (conf/hydra/job_logging/
# framework.yaml, and framework/app/launch.py for spawned workers): a failed upload is one warning of the framework's
# on the console, not botocore's retries and tracebacks.
STORE_LOGGERS = ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "aiohttp")


class RunLogHandler(logging.StreamHandler):
    """`logging.FileHandler`'s job for run.log, with the file opened by `framework.core.files.appending`. Used by
    conf/hydra/job_logging/framework.yaml (`filename:` as FileHandler takes it) and by spawned workers."""

    def __init__(self, filename: str) -> None:
        self.path = Path(filename)
        super().__init__(files.appending(self.path))

    def close(self) -> None:
        """Flush and close the file (again: nothing), as FileHandler.close does."""
        self.acquire()
        try:
            if not self.stream.closed:
                try:
                    self.flush()
                finally:
                    self.stream.close()
        finally:
            self.release()
            super().close()


def file_handlers() -> list[RunLogHandler]:
    """The run logs the root logger writes to."""
    return [h for h in logging.getLogger().handlers if isinstance(h, RunLogHandler)]


def loggers_writing_to(handler: logging.Handler) -> list[logging.Logger]:
    """Every logger that has `handler` (the root and those configured with it, e.g. framework.summary)."""
    found = [logging.getLogger(), *(logging.getLogger(name) for name in logging.root.manager.loggerDict)]
    return [logger for logger in found if handler in logger.handlers]
