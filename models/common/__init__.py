"""Pieces every architecture folder builds from (TorchTitan's models/common habit): the dense
decoder's config fields, its attention / MLP / decoder layer / causal-LM shell, and its TP plan.
A model folder imports these and `models/layers.py` / `models/ops.py`, never another folder."""
