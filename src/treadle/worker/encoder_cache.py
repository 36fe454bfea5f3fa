"""`EncoderCache`: a vision-language model's image features (its vision tower and projector's
output, [num_image_tokens, hidden] per image), kept by the image's pixel hash, least recently
used dropped first past `capacity_bytes`.

A prefill chunked through an image's placeholders, a preempted request run again, and a
second request with the same image take the features from here; the tower runs once per image
(`images_encoded` counts its runs, `hits` the images it was spared)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from treadle.wire.engine import MultiModalInput

DEFAULT_CAPACITY_BYTES = 256 << 20


class EncoderCache:
    def __init__(
        self,
        encode: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
    ) -> None:
        """`encode`: [images, 3, S, S] pixels -> [images, tokens, hidden] features."""
        self.encode = encode
        self.device = device
        self.capacity_bytes = capacity_bytes
        self._features: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        # Since the last `take_counts()`.
        self.images_encoded = 0
        self.hits = 0
        self.seconds = 0.0

    def features(self, images: Iterable[MultiModalInput]) -> dict[str, torch.Tensor]:
        """Each image's features by hash; those not cached are encoded in one batch. An
        image named twice (in one step) is encoded once."""
        out: dict[str, torch.Tensor] = {}
        missing: dict[str, torch.Tensor] = {}
        for mm in images:
            if mm.hash in out or mm.hash in missing:
                continue
            cached = self._features.get(mm.hash)
            if cached is None:
                missing[mm.hash] = mm.pixel_values
            else:
                self._features.move_to_end(mm.hash)
                out[mm.hash] = cached
                self.hits += 1
        if missing:
            start = time.perf_counter()
            pixels = torch.stack([p.to(self.device) for p in missing.values()])
            encoded = self.encode(pixels)
            self.seconds += time.perf_counter() - start
            self.images_encoded += len(missing)
            for key, rows in zip(missing, encoded, strict=True):
                out[key] = rows
                self._put(key, rows)
        return out

    def _put(self, key: str, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        self._features[key] = rows
        self._bytes += size
        while self._bytes > self.capacity_bytes and len(self._features) > 1:
            _, old = self._features.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()

    def take_counts(self) -> tuple[int, int, float]:
        """(images encoded, cache hits, seconds encoding) since the last call."""
        counts = (self.images_encoded, self.hits, self.seconds)
        self.images_encoded, self.hits, self.seconds = 0, 0, 0.0
        return counts
