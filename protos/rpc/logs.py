"""The one log format of every command: ``key=value`` lines, one event a line.

Only entry points (``ps-server``, ``ps-infer``, the trainer, ``ps-launch``, ``ps-admin``)
call ``configure_logging``; library modules only do ``logging.getLogger(__name__)``.

Example:
    >>> LOG_FORMAT.split()[0]
    'ts=%(asctime)s'
"""

from __future__ import annotations

import logging

__all__ = ["LOG_FORMAT", "configure_logging"]

LOG_FORMAT = "ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s"


def configure_logging(level: str | int, **fields: object) -> None:
    """Log to stderr at ``level`` in ``LOG_FORMAT``; ``fields`` (e.g. ``rank=0``) are added to
    every line, before the logger's name."""
    extra = "".join(f"{k}={v} " for k, v in fields.items())
    fmt = LOG_FORMAT.replace("logger=", extra + "logger=") if extra else LOG_FORMAT
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, format=fmt)
