"""What every trainer's vision data path shares: :class:`ModelImages`, a model's ``Family.images`` on its config,
which turns the processor's outputs (``pixel_values`` and the family's ``image_keys``) into the model's images."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ModelImages"]


@dataclass(frozen=True)
class ModelImages:
    """A model's ``Family.images`` on its config: the processor's outputs as the model takes images.

    Args:
        family: the model's adapter family.
        config: the model's ``transformers`` config.
    """

    family: Any
    config: Any

    @property
    def keys(self) -> tuple[str, ...]:
        """The processor's outputs besides ``pixel_values`` the model reads (Qwen-VL's grids and videos); with them
        the model's images are a dict of per-row arrays rather than image slots."""
        return tuple(self.family.image_keys)

    def __call__(self, input_ids: np.ndarray, pixel_values: np.ndarray | None, **vision: Any) -> Any:
        return self.family.images(self.config, input_ids, pixel_values, **vision)

    def of(self, input_ids: np.ndarray, processed: Mapping[str, Any]) -> Any:
        """The images of a processed batch (``pixel_values`` and :attr:`keys` read from it)."""
        pixels = processed.get("pixel_values")
        vision = {key: np.asarray(processed[key]) for key in self.keys if processed.get(key) is not None}
        return self(input_ids, None if pixels is None else np.asarray(pixels, np.float32), **vision)
