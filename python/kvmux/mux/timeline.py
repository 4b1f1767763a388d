"""Where each request's time went, from kvmux's own hooks
(``timeline_path`` in ``kv_connector_extra_config``).

The scheduler side's Rust core keeps, per request, what its hooks saw
(``rust/mux/scheduler/decision.rs``) and hands finished requests'
timelines to :class:`TimelineFile`, which appends one JSON line each. All
times are epoch seconds on the clock of vLLM's ``Request.arrival_time``
(``time.time()``); null where the event did not happen:

- ``req_id``, ``arrival``, ``prompt_tokens``;
- ``first_lookup``: vLLM's first ``get_num_new_matched_tokens``;
  ``lookup_calls``: how many it made (each "not ready" answer costs an
  engine step); ``ready``: the first lookup kvmux answered with a count;
  ``local_hit_tokens``: vLLM's own prefix cache at that lookup;
- ``children``: per child, in config order: ``name``; ``not_ready``
  (lookups it answered "not ready") and ``not_ready_s`` (its first such
  answer to its first ready one, or to when kvmux stopped waiting);
  ``tokens`` (its hit or span; for a declined child, the tokens declined);
  ``declined`` (null, ``"slow_load"``, ``"slow_wait"`` or ``"no_yield"``:
  the load decision's why; ``no_yield``: its recent "not ready" answers
  rarely ended in tokens, so it was not waited for); ``load_tokens``,
  ``load_async``, ``load_start`` (allocation) and ``load_done`` (async: the
  step whose output reported it received; sync: the end of the step that
  ran it); ``save_declined`` (null, ``"not_reused"`` or ``"held"``: save
  admission did not give the child the request's save, its ``save_policy``
  finding no block it lacks seen often enough or read back, or none it
  lacks at all);
- ``allocated``, ``external_tokens``;
- ``first_token``: the end of the engine step that computed the last prompt
  token (the first output token comes out of that step);
- ``finished``: ``request_finished``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["TimelineFile", "timeline_problem"]

logger = logging.getLogger("kvmux")


def timeline_problem(path: str) -> str | None:
    """Why kvmux could not append to ``path`` (None: it can), worded with
    the fix."""
    p = Path(path)
    if p.is_dir():
        return "is a directory; give a file path (one JSON line per finished request)"
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        return f"its directory {str(parent)!r} does not exist; create it or choose another path"
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        return "is not writable by this process; choose a path it can write"
    return None


class TimelineFile:
    """Appends timelines to ``path``, one JSON line each, opened on first
    use and flushed per call (a server stopped by a signal loses none).

    A diagnostic file never stops serving. When ``path`` is moved or removed
    (logrotate), the next write reopens it, so the lines go to the new file.
    When a write fails (disk full, directory gone), the lines are dropped,
    a warning says where and how many, and the next write tries again.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.dropped = 0
        self._lock = threading.Lock()
        self._file: Any = None
        self._failing = False

    def write(self, timelines: list[dict[str, Any]]) -> None:
        text = "".join(json.dumps(t, separators=(",", ":")) + "\n" for t in timelines)
        with self._lock:
            try:
                if self._file is not None and self._moved():
                    self._close()
                if self._file is None:
                    self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
                    if self._failing and self._ends_mid_line():
                        text = "\n" + text  # a failed write's partial line stays its own
                self._file.write(text)
                self._file.flush()
            except OSError as e:
                self._close()
                self.dropped += len(timelines)
                if not self._failing:
                    self._failing = True
                    logger.warning(
                        "kvmux: cannot append to timeline_path %r (%s); dropping finished "
                        "requests' timelines until it works again (serving goes on). Fix: "
                        "free space or restore the directory, or remove timeline_path",
                        self.path,
                        e,
                    )
                return
            if self._failing:
                self._failing = False
                logger.warning(
                    "kvmux: timeline_path %r is written again; %d timelines were dropped",
                    self.path,
                    self.dropped,
                )

    def _moved(self) -> bool:
        """The open file is no longer the one at ``path`` (rotated away)."""
        try:
            at_path = os.stat(self.path)
        except FileNotFoundError:
            return True
        mine = os.fstat(self._file.fileno())
        return (at_path.st_dev, at_path.st_ino) != (mine.st_dev, mine.st_ino)

    def _ends_mid_line(self) -> bool:
        with open(self.path, "rb") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"

    def _close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass  # its buffered lines are counted as dropped by the caller
