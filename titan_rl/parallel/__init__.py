"""Tensor parallelism both engines apply: the plan as data and its application
(`plan.py`), and the sharded linears whose GEMMs have fixed shapes (`tp_linear.py`). The
trainer shards with DTensors (titan_rl/titan/parallelize.py), the engine with plain slices
(titan_rl/vllm/model.py); neither imports the other."""
