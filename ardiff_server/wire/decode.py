"""The one way into the wire: a request frame -> the typed request of the protocol it speaks.

A request walks one way: :func:`decode_frame` unpacks the frame (``protocol.py``), :func:`decode_request` decides
whose message it is and hands it to that protocol's decoder, and the front end dispatches on the result's
``protocol`` to the handler of the same name (``frontend/openpi.py``, ``frontend/lingbot_va.py``):

* ``openpi`` (:class:`~ardiff_server.wire.openpi.OpenPIRequest`): RoboArena / DROID / an embodiment's
  ``observation/...`` keys, ``endpoint``, ``session_id``; every policy speaks it;
* ``openpi_batch`` (:class:`~ardiff_server.wire.batch.BatchRequest`): OpenPI's batched form (openpi PR #941),
  ``{"batch": [request, ...]}``, each element an OpenPI request decoded alone (``batch.py``); any policy;
* ``lingbot_va`` (:class:`~ardiff_server.wire.lingbot_va.LingBotVARequest`): upstream LingBot-VA's own messages,
  understood only for a policy whose ``PolicyInfo.native_protocol`` is ``lingbot_va`` (any other policy decodes
  them as OpenPI's, and refuses them as such). A batch of them is not taken: a batch's elements are OpenPI's.

Both read their shared fields (prompt, guidance scales, denoising steps, ``continuation``) through ``fields.py``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Literal

from ardiff_policies.embodiment import ObservationSchema
from ardiff_policies.info import PolicyInfo
from ardiff_server.wire.batch import BATCH_KEY, BatchRequest, decode_batch, is_batch
from ardiff_server.wire.budget import PixelBudget, request_budget
from ardiff_server.wire.fields import MAX_CHUNK_ID
from ardiff_server.wire.lingbot_va import LingBotVARequest, decode_lingbot_va, is_lingbot_va_message
from ardiff_server.wire.openpi import OpenPIRequest, decode_openpi
from ardiff_server.wire.protocol import DecodeLimits, RequestError, unpack

# MAX_CHUNK_ID: the largest continuation.chunk_id a request may name (the client checks replies against it)
__all__ = ["MAX_CHUNK_ID", "BatchRequest", "LingBotVARequest", "OpenPIRequest", "Request", "RequestError", "decode_frame", "decode_request"]

Request = OpenPIRequest | BatchRequest | LingBotVARequest


def decode_frame(
    frame: bytes,
    limits: DecodeLimits,
    info: PolicyInfo | None,
    *,
    max_request_pixels: int | Literal["auto"],
    continuation_refused: str | None,
    max_batch_elements: int | None = None,
) -> Request:
    """The server's way in (run in a worker thread): one frame unpacked within ``limits`` (arrays as read-only views of
    it) and decoded under the served policy's rules: its observation schema (``info`` None: RoboArena's DROID keys,
    no engine ready yet), its own protocol, whether it takes per-request guidance (it advertises ``guidance`` in its
    metadata), and the pixel budget ``server.max_request_pixels`` gives it (each element of a batch its own),
    counted before any image is decoded, and the per-request denoising steps it takes (``PolicyInfo.inference_steps``);
    a batch holds at most ``max_batch_elements`` (None: batches are refused)."""
    budget = request_budget(max_request_pixels, info)  # and the frames its policy keeps
    payload = unpack(frame, limits, copy=False)
    return decode_request(
        payload,
        info.observation_schema if info is not None else None,
        native_protocol=info.native_protocol if info is not None else None,
        guidance=info is not None and "guidance" in info.server_config,
        demonstrations=info is not None and "demonstration" in info.server_config,
        budget=budget,
        continuation_refused=continuation_refused,
        max_batch_elements=max_batch_elements,
        inference_steps=tuple(info.inference_steps) if info is not None else (),
    )


def decode_request(
    payload: Any,
    schema: ObservationSchema | None = None,
    *,
    native_protocol: str | None = None,
    guidance: bool = False,
    budget: PixelBudget | None = None,
    continuation_refused: str | None = None,
    max_batch_elements: int | None = None,
    inference_steps: Collection[str] = (),
    demonstrations: bool = False,
) -> Request:
    """One unpacked message -> the typed request of its protocol (``schema``: the served embodiment's keys, None:
    RoboArena's DROID keys; ``native_protocol``: the policy's own protocol, also understood; ``guidance``: the policy
    takes per-request ``video_guidance_scale`` / ``action_guidance_scale``; ``budget``: the per-request pixel budget,
    None: none; ``continuation_refused``: why this server serves no ``continuation``, None: it does;
    ``max_batch_elements``: the most elements a batch may hold, None: batches are refused; ``inference_steps``: the
    per-request denoising step keys the policy takes, ``ardiff_policies.inference_steps``; ``demonstrations``: the policy begins an episode with a
    demonstration, named by a LingBot-VA reset or an OpenPI session's first call: Zero-WAM)."""
    rules = {
        "guidance": guidance,
        "budget": budget,
        "continuation_refused": continuation_refused,
        "inference_steps": inference_steps,
        "demonstrations": demonstrations,
    }
    if is_batch(payload):
        if max_batch_elements is None:
            raise RequestError(f"{BATCH_KEY}: batched requests are not taken here")
        return decode_batch(payload, lambda item: decode_openpi(item, schema, **rules), max_elements=max_batch_elements)
    if native_protocol == "lingbot_va" and schema is not None and is_lingbot_va_message(payload):  # its cameras: the schema's
        return decode_lingbot_va(payload, schema.cameras, budget, inference_steps, demonstrations=demonstrations)
    return decode_openpi(payload, schema, **rules)
