"""JPEG-encoded camera images, decoded in the front end (Pillow).

A robot on a slow link may send each image as JPEG bytes instead of a raw uint8 array (DreamZero's
client can, LeRobot's asks for it): a 180x320 frame is ~170 KiB raw and ~10-20 KiB as JPEG. The
server decodes it before anything else sees it, so policies get the same (T, H, W, 3) uint8 arrays.

Bounded: the header's size is checked against the caller's limits before any pixel is decoded
(``Image.open`` reads only the header), so a small file declaring a huge image costs nothing; only
baseline/progressive JPEG is accepted (no PNG/GIF/TIFF decoders reachable from the wire). A file
that does not decode is a :class:`JpegError` whose message the caller prefixes with the key.
"""

from __future__ import annotations

import io
import warnings

import numpy as np

JPEG_MAGIC = b"\xff\xd8\xff"


class JpegError(ValueError):
    """Bytes that are not a decodable JPEG within the limits; the message completes "expected ..., got <message>"."""


def looks_like_jpeg(data: bytes | bytearray | memoryview) -> bool:
    return bytes(data[:3]) == JPEG_MAGIC


def decode_jpeg(data: bytes | bytearray | memoryview, max_side: int) -> np.ndarray:
    """JPEG bytes -> (H, W, 3) uint8 RGB (grayscale and CMYK files are converted)."""
    from PIL import Image, UnidentifiedImageError

    if not looks_like_jpeg(data):
        raise JpegError("bytes that are not a JPEG (no FF D8 FF start marker)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(bytes(data)), formats=["JPEG"])
            width, height = image.size
            if not (1 <= height <= max_side and 1 <= width <= max_side):
                raise JpegError(f"a JPEG of {height}x{width} pixels (height and width must be 1 to {max_side})")
            image.load()  # decode now: a truncated or corrupt file fails here, not later
            if image.mode != "RGB":
                image = image.convert("RGB")
            return np.asarray(image, dtype=np.uint8)
    except JpegError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise JpegError(f"a corrupt JPEG ({exc})") from None


def encode_jpeg(image: np.ndarray, quality: int = 90) -> bytes:
    """(H, W, 3) uint8 RGB -> JPEG bytes (for clients: ``ardiff_server.tools.async_client``)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image, dtype=np.uint8), mode="RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()
