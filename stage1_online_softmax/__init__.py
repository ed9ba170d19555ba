"""Stage 1: tiled FlashAttention in NumPy with FA4's conditional rescaling. See README.md."""
from .flash import RescaleStats, flash_backward, flash_forward

__all__ = ["flash_forward", "flash_backward", "RescaleStats"]
