"""The persister's failing state: how long its loop waits after a failed persist or
commit (exponential backoff, capped), which errors are logged (the first of a kind
and then at 1, 2, 4, 8, ... tries, not every try), and what its status says (failing
since when, with which error; recovered after how many tries). Imports no torch."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("dlrover_plugin_flashckpt.persister")

#: seconds waited after the first failure; doubled at every further one
BACKOFF_MIN_S = 0.5
#: the longest wait between two tries
BACKOFF_MAX_S = 30.0


class PersistFailures:
    """Failures of one persister's loop, in a row, and the backoff they impose.

    ``min_s``/``max_s``: the first and the longest wait (s) between two tries. The
    public state is :meth:`state`; the loop asks :meth:`wait_s` how long to sleep and
    :meth:`due` whether it may try again."""

    def __init__(self, min_s: float = BACKOFF_MIN_S, max_s: float = BACKOFF_MAX_S) -> None:
        self.min_s = min_s
        self.max_s = max_s
        self._lock = threading.Lock()
        self._failing: dict | None = None
        self._retry_at = 0.0
        self.recovered: dict | None = None

    def failed(self, what: str, error: BaseException,
               where: tuple[str, int] | None = None) -> str | None:
        """Record a failure of ``what`` (``"persisting trainer step 5"``; ``where``: the
        checkpoint directory and step it was for); returns the message to keep in the
        persister's errors when it is the first failure of its kind in a row (``None``
        when it only counts one more try)."""
        text = f"{type(error).__name__}: {error}"
        kind = (what, type(error).__name__, getattr(error, "errno", None))
        now = time.monotonic()
        with self._lock:
            f = self._failing
            new = f is None or f["_kind"] != kind
            if f is None:
                f = self._failing = {"since": time.time(), "tries": 0, "_first": now}
            f.update(_kind=kind, what=what, error=text, tries=f["tries"] + 1,
                     last=time.time(), dir=where[0] if where else None,
                     step=where[1] if where else None)
            delay = min(self.max_s, self.min_s * 2 ** min(f["tries"] - 1, 30))
            self._retry_at = now + delay
            tries = f["tries"]
        if new:
            msg = f"{what} failed: {text} (tried again in {delay:g} s, backing off to " \
                  f"{self.max_s:g} s)"
            log.error("%s", msg)
            return msg
        if tries & (tries - 1) == 0:  # a power of two: 2, 4, 8, ...
            log.error("%s still fails after %d tries since %s: %s", what, tries,
                      time.strftime("%H:%M:%S", time.localtime(self._failing["since"])), text)
        return None

    def succeeded(self) -> None:
        """A persist or commit landed: the failing state ends (logged, kept in
        :attr:`recovered`)."""
        with self._lock:
            f, self._failing, self._retry_at = self._failing, None, 0.0
            if f is None:
                return
            self.recovered = {"at": time.time(), "since": f["since"], "tries": f["tries"],
                              "error": f["error"], "what": f["what"]}
        log.warning("persisting recovered: %s failed %d times since %s (%s)", f["what"],
                    f["tries"], time.strftime("%H:%M:%S", time.localtime(f["since"])),
                    f["error"])

    def due(self) -> bool:
        """Whether the backoff allows a try now."""
        return time.monotonic() >= self._retry_at

    def wait_s(self, poll_s: float) -> float:
        """How long the loop sleeps before it looks again: ``poll_s``, or until the
        backoff ends when that is later."""
        return max(poll_s, self._retry_at - time.monotonic())

    def state(self) -> dict | None:
        """``None`` when nothing fails; else ``{"what", "error", "since" (unix time of
        the first failure in a row), "last", "tries", "retry_in_s", "dir", "step"}``."""
        with self._lock:
            if self._failing is None:
                return None
            out = {k: v for k, v in self._failing.items() if not k.startswith("_")}
            out["retry_in_s"] = round(max(0.0, self._retry_at - time.monotonic()), 3)
            return out
