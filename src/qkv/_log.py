"""qkv's logger: what the library wants a user to know, said once per cause.

Everything qkv reports goes to the ``qkv`` logger (`logging.getLogger("qkv")`), which has a
`logging.NullHandler` so that a program that configures no logging sees nothing, as the
logging HOWTO asks of libraries. A program that wants the notes configures the logger
(``logging.basicConfig(level=logging.INFO)``); the ``qkv`` command prints them on stderr.

`note_once(cause, message)` logs a message the first time its cause is seen in this process
and never again: a first-time kernel build, a kernel that fell back, a dtype that this CPU
emulates. Attention runs thousands of times in a model; a note on every call would bury the
one line that matters.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable

__all__ = ["logger", "note_once"]

logger = logging.getLogger("qkv")
logger.addHandler(logging.NullHandler())

# The causes already noted in this process, and the lock that makes "once" hold across the
# encoder's batch threads. Process state by nature: "once per process" needs a memory.
_noted: set[str] = set()
_noted_lock = threading.Lock()


def note_once(cause: str, message: str | Callable[[], str | None], level: int = logging.INFO) -> None:
    """Log ``message`` at ``level`` on the ``qkv`` logger, unless ``cause`` was noted before.

    ``message`` may be a function, called only the first time (it may inspect the machine);
    when it returns None there is nothing to say for this cause, and it is not asked again.
    """
    if cause in _noted:  # the common case, without the lock
        return
    torch = sys.modules.get("torch")  # not imported here: the CLI's help imports no torch
    if torch is not None and torch.compiler.is_compiling():
        return  # Dynamo cannot trace the lock (fullgraph=True would fail): said by an eager call
    with _noted_lock:
        if cause in _noted:
            return
        _noted.add(cause)
    text = message() if callable(message) else message
    if text is not None:
        logger.log(level, text)
