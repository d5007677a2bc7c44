"""Images whose pixels came as bytes (ImageInput.dtype "uint8"): the model's processor output before its rescale and
normalize, which the tokenizer sends for the families whose processor does those two last (a quarter of float32's
bytes). The shard finishes them with transformers' own `rescale` and `normalize`, on each view in turn and with the
folder's image processor settings, as that processor's preprocessing does: the values are bit for bit its float32
ones (tests/services/tokenizer/images/test_images.py and tests/services/shard/vision/test_llava_next.py)."""

from __future__ import annotations

import numpy as np

from libs.protocol.messages import ImageInput


class PixelFinisher:
    def __init__(self, model_dir: str | None) -> None:
        self.model_dir = model_dir
        self._settings: tuple | None = None  # (do_rescale, rescale_factor, do_normalize, image_mean, image_std)

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
        from transformers.image_transforms import normalize, rescale
        from transformers.image_utils import ChannelDimension

        do_rescale, factor, do_normalize, mean, std = self._load()
        first = ChannelDimension.FIRST
        views = []
        for view in np.asarray(flat, np.uint8).reshape(-1, *image.shape[-3:]):  # as the processor: view by view
            if do_rescale:
                view = rescale(view, factor, data_format=first, input_data_format=first)
            if do_normalize:
                view = normalize(view, mean, std, data_format=first, input_data_format=first)
            views.append(np.asarray(view, np.float32))
        return np.stack(views).reshape(image.shape)

    def _load(self) -> tuple:
        if self._settings is None:
            if not self.model_dir:
                raise ValueError("the model was not loaded from a folder")
            from transformers import AutoImageProcessor

            ip = AutoImageProcessor.from_pretrained(self.model_dir)
            self._settings = (ip.do_rescale, ip.rescale_factor, ip.do_normalize, ip.image_mean, ip.image_std)
        return self._settings
