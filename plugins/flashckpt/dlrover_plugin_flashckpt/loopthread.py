"""The thread of one of the persister's loops (:class:`LoopThread`): the
``flash-persister`` thread of the :class:`.persisting.PersistLoop` and the
``flash-replicate`` thread of the :class:`.replica.ReplicaSender`. It owns the daemon
thread and the two events that wake it and end it; the loop it runs is its owner's."""

from __future__ import annotations

import threading
from typing import Callable


class LoopThread:
    """A daemon thread running ``target`` (which returns once :attr:`stopping`).

    Args:
        name: the thread's name. target: the loop; it calls :meth:`pause` between rounds.
    """

    def __init__(self, name: str, target: Callable[[], None]) -> None:
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=target, name=name, daemon=True)

    def begin(self) -> None:
        """Start the thread."""
        self._thread.start()

    def wake(self) -> None:
        """End the loop's current :meth:`pause` now (there is work)."""
        self._wake.set()

    def end(self, timeout: float | None = None) -> None:
        """Ask the loop to stop (after the round in progress) and wait up to ``timeout``
        seconds for the thread (``None``: as long as it takes)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`end` was called."""
        return self._stop.is_set()

    def pause(self, seconds: float) -> None:
        """Wait up to ``seconds`` for a :meth:`wake` (or :meth:`end`)."""
        self._wake.wait(seconds)
        self._wake.clear()
