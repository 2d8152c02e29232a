"""JPEG-encoded camera images, decoded in the front end (Pillow).

A robot on a slow link may send each image as JPEG bytes instead of a raw uint8 array (DreamZero's
client can, LeRobot's asks for it): a 180x320 frame is ~170 KiB raw and ~10-20 KiB as JPEG. The
server decodes it before anything else sees it, so policies get the same (T, H, W, 3) uint8 arrays.

Bounded: a file is opened in two steps. :func:`read_jpeg` reads only the header (``Image.open``), so the
caller knows every frame's size and can refuse a request before any pixel is decoded (a 690-byte file may
declare 4096x4096, and Pillow fills the scan it lacks); :meth:`JpegFrame.decode_into` then decodes one
frame straight into the caller's stack. Only baseline/progressive JPEG is accepted (no PNG/GIF/TIFF
decoders reachable from the wire). A file that does not decode is a :class:`JpegError` whose message the
caller prefixes with the key.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from PIL.Image import Image

JPEG_MAGIC = b"\xff\xd8\xff"
STRIP_BYTES = 2**20  # of Pillow's buffer copied out at a time (JpegFrame.decode_into)


class JpegError(ValueError):
    """Bytes that are not a decodable JPEG within the limits; the message completes "expected ..., got <message>"."""


def looks_like_jpeg(data: bytes | bytearray | memoryview) -> bool:
    return bytes(data[:3]) == JPEG_MAGIC


@dataclass
class JpegFrame:
    """A JPEG whose header is read: its size is known, none of its pixels is decoded yet."""

    image: Image
    height: int
    width: int

    def decode_into(self, out: np.ndarray) -> None:
        """Decode the pixels into ``out`` ((height, width, 3) uint8 RGB; grayscale and CMYK files are
        converted), then free Pillow's buffer: a stack costs its own size plus one frame in Pillow (4 bytes
        a pixel). Rows are copied out a strip at a time: ``np.asarray(image)`` would make two more copies
        of the whole frame (``tobytes``'s chunks and their join), 10 bytes a pixel at the peak."""
        from PIL import Image

        try:
            image = self.image
            image.load()  # a truncated or corrupt file fails here
            if image.mode != "RGB":
                image = image.convert("RGB")
            rows = max(1, STRIP_BYTES // (4 * self.width))
            for top in range(0, self.height, rows):
                out[top : top + rows] = np.asarray(image.crop((0, top, self.width, min(self.height, top + rows))))
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
            raise JpegError(f"a corrupt JPEG ({exc})") from None
        finally:
            self.image.close()


def read_jpeg(data: bytes | bytearray | memoryview, max_side: int) -> JpegFrame:
    """The header of JPEG bytes, its size checked against ``max_side``; no pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    if not looks_like_jpeg(data):
        raise JpegError("bytes that are not a JPEG (no FF D8 FF start marker)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(bytes(data)), formats=["JPEG"])
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise JpegError(f"a corrupt JPEG ({exc})") from None
    width, height = image.size
    if not (1 <= height <= max_side and 1 <= width <= max_side):
        image.close()
        raise JpegError(f"a JPEG of {height}x{width} pixels (height and width must be 1 to {max_side})")
    return JpegFrame(image, height, width)


def decode_jpeg(data: bytes | bytearray | memoryview, max_side: int) -> np.ndarray:
    """JPEG bytes -> (H, W, 3) uint8 RGB (grayscale and CMYK files are converted)."""
    frame = read_jpeg(data, max_side)
    out = np.empty((frame.height, frame.width, 3), dtype=np.uint8)
    frame.decode_into(out)
    return out


def encode_jpeg(image: np.ndarray, quality: int = 90) -> bytes:
    """(H, W, 3) uint8 RGB -> JPEG bytes (for clients: ``ardiff_client.async_runner``)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image, dtype=np.uint8), mode="RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()
