"""What a forward reads: token sequences packed into per-rank rows (`rows`), context-parallel
zigzag order (`zigzag`), and the row facts attention and the boundaries take."""
