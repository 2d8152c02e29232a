"""The one serving loop: the scheduler decides a round, the engine carries it out, replies go out.

The worker process (rank 0; under CFG-parallel rank 1 follows rank 0's rounds) and the
in-process client both serve through :func:`serve`; only how a reply leaves differs.
"""

from __future__ import annotations

from collections.abc import Callable

from ardiff_server.engine.messages import Reply, Shutdown
from ardiff_server.engine.scheduler import Round


def serve(
    engine,
    send: Callable[[Reply], None],
    *,
    execute: Callable[[Round], list[Reply]] | None = None,
    share: Callable[[Round], None] | None = None,
    running: Callable[[tuple[int, ...] | None], None] | None = None,
) -> None:
    """Serve ``engine.scheduler``'s rounds until a :class:`Shutdown`.

    ``execute`` carries a round out (default ``engine.execute``); ``share`` hands each round to the
    other CFG-parallel rank before it runs; ``running`` is told which requests are being computed
    (``None`` when none: the progress watchdog reads it). Nothing else runs here: the recording
    decodes and writes on its own thread (``recorder.py``), never between two requests."""
    execute = execute or engine.execute
    scheduler = engine.scheduler
    while True:
        round = scheduler.next_round()
        if share is not None:
            share(round)
        if isinstance(round.control, Shutdown):
            return
        if running is not None:
            running(round.request_ids)
        try:
            replies = execute(round)
        finally:
            if running is not None:
                running(None)
        for reply in replies:
            send(reply)


def follow(receive: Callable[[], Round], execute: Callable[[Round], list[Reply]]) -> None:
    """CFG-parallel rank 1: carry out the rounds rank 0 decided, in its order, until a :class:`Shutdown`."""
    while True:
        round = receive()
        if isinstance(round.control, Shutdown):
            return
        execute(round)
