"""Signals of a serving process: SIGINT / SIGTERM stop it (the first gracefully, a second at once);
SIGHUP reloads the TLS certificate (``ardiff-serve --tls-cert``); without TLS there is nothing to
reload and SIGHUP is logged and ignored (its default action would end the server, and a certbot
deploy hook or a closed terminal sends it to whatever runs).

One rule for ``ardiff-serve`` and ``ardiff-serve --ray``: the first signal calls ``on_first``
(answer in-flight requests, stop the engine, close connections); a second one, while that is
still going on, calls ``kill`` (SIGKILL the engine processes) and exits with status 1 without
waiting for anything.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable

logger = logging.getLogger(__name__)


def exit_on_second_signal(
    on_first: Callable[[], None], *, kill: Callable[[], None] = lambda: None, loop: asyncio.AbstractEventLoop | None = None
) -> None:
    """Install the handlers; with ``loop`` they run on that event loop, else as plain signal handlers."""
    received = False

    def handler(*_: object) -> None:
        nonlocal received
        if received:
            logger.warning("second signal: exiting now")
            kill()
            os._exit(1)
        received = True
        on_first()

    for sig in (signal.SIGINT, signal.SIGTERM):
        if loop is not None:
            loop.add_signal_handler(sig, handler)
        else:
            signal.signal(sig, handler)


SIGHUP_IGNORED = "SIGHUP ignored: nothing to reload without TLS (it reloads --tls-cert/--tls-key; docs/deploy.md)"


def reload_on_hangup(reload: Callable[[], object] | None, *, loop: asyncio.AbstractEventLoop) -> None:
    """SIGHUP calls ``reload`` on ``loop`` (a renewed certificate; open connections stay); with
    ``reload`` None it is logged and ignored."""
    loop.add_signal_handler(signal.SIGHUP, reload if reload is not None else lambda: logger.warning(SIGHUP_IGNORED))
