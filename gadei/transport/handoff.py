"""The one-item hand-off between a learner's train thread and a transport's helper thread."""

import threading

from ..ring import WAIT_SLICE


class Handoff:
    """A transport's background thread and the condition guarding its one-item hand-off."""

    def __init__(self, target, name: str):
        self.cond = threading.Condition()
        self.closing = False
        self.thread = threading.Thread(target=target, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Tell the thread to finish what it holds and end; wait for it (bounded)."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.thread.join(timeout=10 * WAIT_SLICE + 5)
