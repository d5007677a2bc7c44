"""Images whose pixels came as bytes (ImageInput.dtype "uint8"): the model's processor output before its rescale and
normalize, which the tokenizer sends for the families whose processor does those two last (a quarter of float32's
bytes). The shard finishes them with transformers' own `rescale` and `normalize`, on each view in turn and with the
folder's image processor settings, as that processor's preprocessing does: the values are bit for bit its float32
ones (tests/services/tokenizer/images/test_images.py and tests/services/shard/vision/test_llava_next.py).

Qwen2-VL's and Qwen2.5-VL's rows come as [1, h / m, w / m, m, m, channels, patch, patch], one temporal copy each
(services/tokenizer/images/qwen2_vl.py): finished as one [channels, rows x patch, patch] image (rescale and normalize
are elementwise by channel, so the values are those of the processor's whole image), then each row repeated
temporal_patch_size times and flattened as its patchify does."""

from __future__ import annotations

import numpy as np

from libs.protocol.messages import ImageInput


class PixelFinisher:
    def __init__(self, model_dir: str | None) -> None:
        self.model_dir = model_dir
        # (do_rescale, rescale_factor, do_normalize, image_mean, image_std, temporal_patch_size or None)
        self._settings: tuple | None = None

    def refuses(self, image: ImageInput) -> str | None:
        """Why the image's pixels cannot be finished here (None: they can, or need not be)."""
        if image.dtype != "uint8":
            return None
        if len(image.shape) < 3:
            return f"uint8 pixels of shape {image.shape} are not views of [channels, height, width]"
        try:
            self._load()
        except Exception as e:  # no folder (a model built in memory) or no image processor in it
            return f"its pixels came before rescale and normalize, and the model's image processor is not here ({e})"
        return None

    def values(self, image: ImageInput, flat: np.ndarray) -> np.ndarray:
        """The image's float32 pixel values, shaped as the processor made them."""
        if image.dtype != "uint8":
            return np.asarray(flat, np.float32).reshape(image.shape)
        temporal = self._load()[-1]
        pixels = np.asarray(flat, np.uint8)
        if temporal is not None:  # Qwen2-VL's rows, one temporal copy each
            c, p = image.shape[-3], image.shape[-1]
            rows = pixels.reshape(-1, c, p, p)
            whole = self._finish(rows.transpose(1, 0, 2, 3).reshape(c, -1, p))
            done = whole.reshape(c, -1, p, p).transpose(1, 0, 2, 3)
            copies = np.broadcast_to(done[:, :, None], (len(done), c, temporal, p, p))
            return np.ascontiguousarray(copies).reshape(*image.shape[:5], c * temporal * p * p)
        views = [self._finish(view) for view in pixels.reshape(-1, *image.shape[-3:])]  # as the processor: by view
        return np.stack(views).reshape(image.shape)

    def _finish(self, view: np.ndarray) -> np.ndarray:
        """A [channels, height, width] uint8 view rescaled and normalized as the processor does, float32."""
        from transformers.image_transforms import normalize, rescale
        from transformers.image_utils import ChannelDimension

        do_rescale, factor, do_normalize, mean, std, _ = self._load()
        first = ChannelDimension.FIRST
        if do_rescale:
            view = rescale(view, factor, data_format=first, input_data_format=first)
        if do_normalize:
            view = normalize(view, mean, std, data_format=first, input_data_format=first)
        return np.asarray(view, np.float32)

    def _load(self) -> tuple:
        if self._settings is None:
            if not self.model_dir:
                raise ValueError("the model was not loaded from a folder")
            from transformers import AutoImageProcessor

            ip = AutoImageProcessor.from_pretrained(self.model_dir)
            temporal = getattr(ip, "temporal_patch_size", None)
            self._settings = (ip.do_rescale, ip.rescale_factor, ip.do_normalize, ip.image_mean, ip.image_std, temporal)
        return self._settings
