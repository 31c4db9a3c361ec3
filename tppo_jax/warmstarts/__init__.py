"""Data only: the shipped configs' supervised warm-starts, one ``warmstart-<key>/`` folder each
(``tppo_jax/weights/warmstart.py``: ``SHIPPED``, ``shipped``, ``ship``)."""
