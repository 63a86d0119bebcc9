"""Warnings collected while a tool runs, shown once each at the end instead of between its lines.

torch.compile, torchao, Transformer Engine and timm warn while a benchmark variant is built and
run, some on every step, by ``warnings.warn`` or by a logger. :class:`WarningLog` records both
(logging records at WARNING and above), keeps them off the console while it collects, and
:meth:`WarningLog.summary` lists each distinct one once, with how often and in which runs it came.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Dict, Iterator, List, Tuple

__all__ = ["WarningLog"]

_MAX_CHARS = 400  # of one message in the summary; the rest is marked as left out


def _short_path(path: str) -> str:
    """``transformer_engine/pytorch/module/base.py`` for a file under site-packages."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith("..") else rel


def _live_handlers() -> List[logging.Handler]:
    """Every handler a logging record can reach now: the root's, each logger's, and the last-resort
    handler that prints a WARNING when a logger (torchao's) has none on its way to the root."""
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    found: Dict[int, logging.Handler] = {}
    for lg in loggers:
        for h in lg.handlers:
            found.setdefault(id(h), h)
    if logging.lastResort is not None:
        found.setdefault(id(logging.lastResort), logging.lastResort)
    return list(found.values())


class _Capture(logging.Filter):
    """A handler filter that records WARNING-and-above records (once, however many handlers they
    pass) and stops them there; lower levels pass unchanged."""

    def __init__(self, log: "WarningLog", label: str):
        super().__init__()
        self.log, self.label = log, label
        self.seen: Dict[int, logging.LogRecord] = {}  # by id; holding the record keeps its id unique

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        if id(record) not in self.seen:
            self.seen[id(record)] = record
            self.log.add(f"{record.levelname} from logger {record.name}", record.getMessage(), self.label)
        return False


class WarningLog:
    """Warnings and WARNING-level log records, collected per labelled run and counted.

    Example::

        log = WarningLog()
        for name in ("timm-bf16", "timm-bf16-compile"):
            with log.collect(name):
                run(name)
        print(log.summary())
    """

    def __init__(self):
        # (source, message) -> [times raised, labels of the runs that raised it]
        self._seen: Dict[Tuple[str, str], list] = {}

    @property
    def total(self) -> int:
        """How many were raised, repeats included."""
        return sum(n for n, _ in self._seen.values())

    @property
    def distinct(self) -> int:
        """How many different ones (source and message) were raised."""
        return len(self._seen)

    def add(self, source: str, message: str, label: str) -> None:
        """Count one warning from ``source`` (category and place, or logger) raised in run ``label``."""
        entry = self._seen.setdefault((source, " ".join(message.split())), [0, []])
        entry[0] += 1
        if label not in entry[1]:
            entry[1].append(label)

    @contextlib.contextmanager
    def collect(self, label: str) -> Iterator[None]:
        """Collect instead of printing while the block runs (and when it raises), as run ``label``.

        Every ``warnings.warn`` counts, repeats included (the filter is "always" inside). Logging
        records reach the summary through the handlers that exist when the block starts.
        """
        capture = _Capture(self, label)
        handlers = _live_handlers()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for h in handlers:
                h.addFilter(capture)
            try:
                yield
            finally:
                for h in handlers:
                    h.removeFilter(capture)
                for w in caught:
                    self.add(f"{w.category.__name__} at {_short_path(w.filename)}:{w.lineno}", str(w.message), label)

    def summary(self) -> str:
        """``N warnings, M distinct:`` and one line per distinct one, most frequent first ("" if none)."""
        if not self._seen:
            return ""
        lines = [f"{self.total} warning{'s' * (self.total != 1)}, {self.distinct} distinct (each once: how often, "
                 "in which runs, from where):"]
        for (source, msg), (n, labels) in sorted(self._seen.items(), key=lambda kv: -kv[1][0]):
            if len(msg) > _MAX_CHARS:
                msg = f"{msg[:_MAX_CHARS]} [{len(msg) - _MAX_CHARS} more characters]"
            lines.append(f"  {n}x in {', '.join(labels)}: {source}: {msg}")
        return "\n".join(lines)
