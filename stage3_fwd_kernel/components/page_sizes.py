"""Which page sizes a kernel reads in place, and how (plain Python: no cutlass import, so that the
plans and fa4's routing can ask without setting a GPU arch). The device side is components.paged_kv.
"""
from __future__ import annotations


# A box covers whole 8-row swizzle atoms of the shared-memory tile; 16 rows at least because the
# issuing loop holds one page index per box and 16 boxes of 8 rows spilled the producer's 24 registers
MIN_BOX_ROWS = 16


def tma_pages(page_size: int, tile_n: int) -> bool:
    """Whether TMA boxes can read pages of page_size in place: a multiple of the key tile (one box
    per block), or a divisor of it that is a multiple of MIN_BOX_ROWS rows (tile_n / page_size
    boxes per block). Other sizes are gathered (`gathered`)."""
    return page_size % tile_n == 0 or (tile_n % page_size == 0 and page_size % MIN_BOX_ROWS == 0)


def page_size_ok(page_size: int, tile_n: int) -> bool:
    """Whether a kernel with key tile tile_n reads pages of page_size in place: any positive page
    size (TMA boxes where `tma_pages`, else the cp.async gather)."""
    return not isinstance(page_size, bool) and isinstance(page_size, int) and page_size > 0


def gathered(page_size, tile_n: int) -> bool:
    """Whether a build reads its pages with the cp.async gather (a paged build TMA cannot serve)."""
    return page_size is not None and not tma_pages(page_size, tile_n)


def check_page_size(page_size: int, tile_n: int) -> int:
    """The page size a kernel is built for (page_size_ok), else a ValueError naming it."""
    if not page_size_ok(page_size, tile_n):
        raise ValueError(f"page_size: expected a positive int (rows of one page), got {page_size!r}")
    return page_size


def box_rows(page_size, tile_n: int) -> int:
    """Rows of one K / V TMA box: the key tile, or a whole page when TMA reads pages smaller than it."""
    return tile_n if page_size is None or gathered(page_size, tile_n) else min(page_size, tile_n)
