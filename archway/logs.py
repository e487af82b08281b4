"""How archway's log lines look: plain text for people, or one JSON object per line for log
pipelines (server.log_format). One formatter for archway's own loggers and gunicorn's, so a
pipeline never meets a line of another shape, and one `configure` for every process archway
starts: the command line, `archway serve` and its gate controller."""
import datetime as dt
import json
import logging
import logging.config
from typing import Any

from archway import logsafe

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; whatever else a record carries came from `extra=`.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """time, level, logger, message, the record's `extra=` fields, and the exception if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC)
                      .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_") and key not in entry:
                entry[key] = value if isinstance(value, (str, int, float, bool, list, dict)) \
                    or value is None else str(value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def logging_dict(level: int) -> dict:
    """A logging.config.dictConfig putting the root logger and gunicorn's in JSON lines. Given
    to gunicorn as logconfig_dict, it replaces gunicorn's own formats (text lines are
    archway.logsafe's, set up by the CLI)."""
    formatter = {"()": f"{__name__}.JsonFormatter"}
    handler = {"class": "logging.StreamHandler", "formatter": "archway",
               "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"archway": formatter},
        "handlers": {"archway": handler},
        "root": {"level": level, "handlers": ["archway"]},
        "loggers": {name: {"level": level, "handlers": ["archway"], "propagate": False}
                    for name in ("gunicorn.error", "gunicorn.access")},
    }


def configure(level: int, log_format: str = "text") -> None:
    """This process's log lines in `log_format` (server.log_format): text, every value escaped
    (archway.logsafe: a pod name cannot forge a line), or JSON lines."""
    if log_format == "json":
        logging.config.dictConfig(logging_dict(level))
    else:
        logsafe.configure(level, TEXT_FORMAT)
