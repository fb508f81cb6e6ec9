"""Graph passes: horizontal fusion (the ``fusion`` package), coarsening (``coarsen``)."""
