"""Graph passes: fusion (``fuse``), coarsening (``coarsen``), stream assignment (``assign``)."""
