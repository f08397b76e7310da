"""A TorchTitan ModelSpec for any registered titan_rl architecture.

    spec = model_spec("qwen3", "debug", ModelOptions(kernels="exact"))
    config = Trainer.Config(model_spec=spec, ...); cpu_compat.trainer_overrides(config)

The spec bundles (torchtitan.protocols.ModelSpec, 0.3.0 shape):
  * model: TitanModel.Config(arch, flavor, options, ...); `.build()` returns the
    architecture's own model class (re-classed with TorchTitan's BaseModel hooks), so
    the trainer runs the same definition, names and forward as the rollout engine;
  * parallelize_fn: titan_rl.titan.parallelize.parallelize_fn (the architecture's TP plan,
    FSDP2/HSDP, full activation checkpointing);
  * state_dict_adapter: TitanStateDictAdapter (identity names + tied embeddings);
  * no pipelining_fn (PP is not supported), no post-optimizer hook.
"""

from __future__ import annotations

from torchtitan.protocols.model_spec import ModelSpec

from titan_rl.models.options import ModelOptions
from titan_rl.registry import get_architecture
from titan_rl.titan.model import TitanModel
from titan_rl.titan.parallelize import parallelize_fn
from titan_rl.titan.state_dict import TitanStateDictAdapter


def model_config(arch_name: str = "qwen3", flavor: str = "debug", options: ModelOptions = ModelOptions(),
                 **fields) -> TitanModel.Config:
    arch = get_architecture(arch_name)
    if fields.get("model_config") is None:
        arch.flavor(flavor)
    return TitanModel.Config(arch=arch_name, flavor=flavor, options=options.validate(), **fields)


def model_spec(arch_name: str = "qwen3", flavor: str = "debug", options: ModelOptions = ModelOptions(),
               **fields) -> ModelSpec:
    """ModelSpec for a registered architecture. `fields` go to TitanModel.Config
    (model_config=<arch config object>, init_seed=..., init_std=...)."""
    return ModelSpec(
        name=arch_name,
        flavor=flavor,
        model=model_config(arch_name, flavor, options, **fields),
        parallelize_fn=parallelize_fn,
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=TitanStateDictAdapter,
    )
