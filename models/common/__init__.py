"""Pieces every architecture folder builds from (TorchTitan's models/common habit), one module
per idea: the dense decoder (config.py, transformer.py), the routed MLP (moe.py), gated
delta-rule attention and the hybrid shell (gdn.py), the Qwen3-Next family's shared layers
(next.py) and the TP plan pieces (parallelize.py). A model folder imports these and
`models/layers.py` / `models/ops.py`, never another folder (tests/test_imports.py)."""
