"""OpenPI's batched requests (openpi PR #941): ``{"batch": [request, ...]}`` -> :class:`BatchRequest`.

``decode.py`` hands a map with a ``batch`` key here. The frame as a whole must be a batch: ``batch`` a list of
1 to ``max_elements`` maps, beside it at most ``endpoint: infer``; anything else is refused for the whole frame
(a ``session_id`` or ``prompt`` beside the list would leave unsaid which element it is for). Each element is an
OpenPI inference request of its own, decoded alone by :func:`~ardiff_server.wire.openpi.decode_openpi` (the same
schema, pixel budget, continuation and guidance rules as a single request): one that fails is a
:class:`RefusedElement` in its slot and the others stand. Refused in a slot too: a reset (``endpoint: reset``:
its reply is no chunk, and a batch that ended and served one session would leave its order unsaid; a reset request
names many sessions already), and a session id another element already named (each element is one session's call).

An element without ``session_id`` gets its session from its index on the connection (``frontend/openpi_batch.py``);
docs/spec.md §3 says why. The stacked form (every key with a leading N axis) is not read: docs/spec.md §3 says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ardiff_server.wire.openpi import ENDPOINT_KEY, SESSION_ID_KEY, OpenPIRequest
from ardiff_server.wire.protocol import RequestError, short_repr
from ardiff_server.wire.protocol import describe as _describe

BATCH_KEY = "batch"
MAX_ELEMENTS_SETTING = "server.max_batch_elements"


@dataclass(frozen=True)
class RefusedElement:
    """A batch element refused alone: ``message`` is the line a single request would get after ``bad request: ``."""

    message: str


BatchElement = OpenPIRequest | RefusedElement


@dataclass(frozen=True)
class BatchRequest:
    """One frame of many OpenPI inference requests, answered in one ``{"batch": [...]}`` reply in their order."""

    protocol: ClassVar[Literal["openpi_batch"]] = "openpi_batch"
    elements: tuple[BatchElement, ...]


def is_batch(payload: Any) -> bool:
    return isinstance(payload, dict) and BATCH_KEY in payload


def decode_batch(payload: dict[str, Any], decode_element: Callable[[Any], OpenPIRequest], *, max_elements: int) -> BatchRequest:
    """``{"batch": [...]}`` -> its elements, each decoded by ``decode_element`` alone (a bad one refused in its
    slot); a frame that is not a batch of 1 to ``max_elements`` maps is a :class:`RequestError` as a whole."""
    others = sorted(str(key) for key in payload if key not in (BATCH_KEY, ENDPOINT_KEY))
    if others:
        raise RequestError(
            f"{BATCH_KEY}: a batched request carries only its '{BATCH_KEY}' list, got also {short_repr(others[:4])}; "
            "put session_id, prompt and observations in each element"
        )
    if payload.get(ENDPOINT_KEY) not in (None, "infer"):
        raise RequestError(f"{ENDPOINT_KEY}: a batched request is an inference, got {short_repr(payload[ENDPOINT_KEY])}; send a reset on its own")
    items = payload[BATCH_KEY]
    if not isinstance(items, list | tuple):
        raise RequestError(f"{BATCH_KEY}: expected a list of requests, got {_describe(items)}")
    if not items:
        raise RequestError(f"{BATCH_KEY}: expected at least one request, got an empty list")
    if len(items) > max_elements:
        raise RequestError(f"{BATCH_KEY}: expected at most {max_elements} requests ({MAX_ELEMENTS_SETTING}), got {len(items)}")
    elements: list[BatchElement] = []
    named: dict[str, int] = {}  # session id -> the element that named it
    for index, item in enumerate(items):
        try:
            request = decode_element(item)
        except RequestError as exc:
            elements.append(RefusedElement(str(exc)))
            continue
        if request.endpoint != "infer":
            elements.append(RefusedElement(f"{ENDPOINT_KEY}: a batch element is an inference, got 'reset'; send a reset on its own"))
            continue
        if request.session_id is not None and request.session_id in named:
            first = named[request.session_id]
            elements.append(
                RefusedElement(f"{SESSION_ID_KEY}: {short_repr(request.session_id)} is element {first}'s too; each element is its own session")
            )
            continue
        if request.session_id is not None:
            named[request.session_id] = index
        elements.append(request)
    return BatchRequest(tuple(elements))
