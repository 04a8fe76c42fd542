"""Logging of every speedpipe process, configured in one place: the launcher (and its coordinator),
and every stage worker, whether a local process, one of a multi-node member's processes or a Ray actor.

Owns the log levels, `SPEEDPIPE_LOG_LEVEL`, which level applies (`resolve_log_level`: the
`--log-level` flag if given, else `$SPEEDPIPE_LOG_LEVEL`, else WARNING) and `configure_logging`,
which entry points call once. The launcher hands its level on: to a local stage process as
`--log-level`, to a Ray actor as `SPEEDPIPE_LOG_LEVEL` in its environment
(launcher/backends/placement.py `forwarded_env`). Must not: be called below an entry point (a
library module only gets a logger), or read the environment at import time.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_LEVEL_ENV = "SPEEDPIPE_LOG_LEVEL"
DEFAULT_LOG_LEVEL = "WARNING"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def resolve_log_level(flag: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The level for this process: `flag` (the --log-level value) if given, else SPEEDPIPE_LOG_LEVEL
    of `environ` (default os.environ) if set and non-empty, else WARNING; upper-cased, one of
    LOG_LEVELS. Raises ValueError naming where a bad value came from and the allowed ones."""
    environ = os.environ if environ is None else environ
    source, value = "--log-level", flag
    if value is None:
        source, value = LOG_LEVEL_ENV, environ.get(LOG_LEVEL_ENV) or DEFAULT_LOG_LEVEL
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"{source} must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return level


def default_log_level() -> str:
    """SPEEDPIPE_LOG_LEVEL, else WARNING: the default of every `log_level` setting (read when the
    setting is made, not at import). Raises ValueError for a bad value, naming the variable."""
    return resolve_log_level(None)


def configure_logging(flag: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """Set this process's root logger to the level `resolve_log_level(flag, environ)` picks, writing
    `LOG_FORMAT` lines to stderr, and return that level. A root logger that already has handlers (a
    host program's, or pytest's) is left as it is, as `logging.basicConfig` does. Raises ValueError
    (a bad level) before changing anything."""
    level = resolve_log_level(flag, environ)
    logging.basicConfig(level=level, stream=sys.stderr, format=LOG_FORMAT)
    return level
