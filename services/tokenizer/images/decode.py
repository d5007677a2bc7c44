"""Image bytes to a PIL image: PNG, JPEG, WebP or GIF (its first frame), refused before decoding when its header
claims more pixels than allowed (a decompression bomb), and refused when its data is cut short."""

from __future__ import annotations

import io
import warnings

from PIL import Image

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


class ImageError(ValueError):
    """An input that is not an image this server takes; its message is the client's."""


def decode(data: bytes, max_pixels: int) -> Image.Image:
    """The image in `data` as RGB (ImageError when it is not one of FORMATS, too large, or truncated)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = img.size
            if width * height > max_pixels:
                raise ImageError(f"image of {width}x{height} pixels is over the limit of {max_pixels} pixels")
            img.seek(0)  # a GIF: its first frame
            img.load()
            return img.convert("RGB")
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"image is too large to decode: {e}") from None
    except Image.UnidentifiedImageError:
        raise ImageError(f"not an image (accepted formats: {', '.join(FORMATS)})") from None
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt data
        raise ImageError(f"image could not be decoded: {e}") from None
