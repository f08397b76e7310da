"""TorchTitan's sections are TorchTitan's own Config classes: every TorchTitan key is a TOML
key under its TorchTitan name or is refused by name with the reason, the values reach
Trainer.Config unchanged, and the run dir's config snapshot round-trips them."""

import dataclasses
import re

import pytest
import tomli

from titan_rl import config
from titan_rl.titan import sections

BASE = "train_configs/rl_debug.toml"


def _titan_classes():
    """section -> the TorchTitan class a section stands for (titan_rl's subclasses' bases)."""
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.config import TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC

    plain = {"training": TrainingConfig, "optimizer": OptimizersContainer.Config,
             "activation_checkpoint": FullAC.Config}
    return {s: plain.get(s, type(f())) for s, f in sections.SECTIONS.items()}


def _toml(v):
    return config._toml_value(v)


def test_every_trainer_config_field_is_a_section_or_refused():
    from torchtitan.trainer import Trainer

    for f in dataclasses.fields(Trainer.Config):
        assert f.name in sections.SECTIONS or f.name in sections.REFUSED_SECTIONS, f.name


@pytest.mark.parametrize("section", list(sections.SECTIONS))
def test_every_torchtitan_key_is_settable_or_refused(section):
    """Each key of TorchTitan's class: refused by name, or set from TOML (to its own value,
    or for a key TOML cannot write because it is None, left out of the snapshot)."""
    cls = _titan_classes()[section]
    table = config.to_dict(config.load(BASE))[section]
    for f in dataclasses.fields(cls):
        key = f"{section}.{f.name}"
        if key in sections.REFUSED_KEYS:
            continue
        if f.name not in table:  # None: TorchTitan's "unset"
            assert getattr(getattr(config.load(BASE), section), f.name) is None, key
            continue
        cfg = config.load(BASE, [f"--{key}={_toml(table[f.name])}"])
        assert config.to_dict(cfg)[section][f.name] == table[f.name], key


@pytest.mark.parametrize("key", list(sections.REFUSED_KEYS))
def test_refused_keys_name_the_key_and_the_reason(key):
    section, name = key.split(".")
    cls = _titan_classes()[section]
    assert name in {f.name for f in dataclasses.fields(cls)}, f"{key} is not a TorchTitan key"
    with pytest.raises(config.ConfigError, match=f"^{key} = .*: titan_rl does not take this TorchTitan key: "
                                                 + re.escape(sections.REFUSED_KEYS[key])):
        config.load(BASE, [f"--{key}=1"])


@pytest.mark.parametrize("section", list(sections.REFUSED_SECTIONS))
def test_refused_sections_name_the_section_and_the_reason(section):
    with pytest.raises(config.ConfigError, match=rf"^\[{section}\]: titan_rl does not take this TorchTitan "
                                                 r"section: " + re.escape(sections.REFUSED_SECTIONS[section])):
        config.from_dict({section: {"enable": True}})


@pytest.mark.parametrize("old, new", [
    ("optimizer.beta1=0.9", r"optimizer.betas = \[beta1, beta2\]"),
    ("optimizer.beta2=0.95", r"optimizer.betas = \[beta1, beta2\]"),
    ('optimizer.name="Adam"', r"optimizer.optimizer_name"),
])
def test_renamed_keys_say_the_torchtitan_name(old, new):
    with pytest.raises(config.ConfigError, match=rf"this key is {new} \(TorchTitan's name\)"):
        config.load(BASE, [f"--{old}"])


@pytest.mark.parametrize("override, message", [
    ("--optimizer.betas=[0.9]", r"optimizer.betas = \[0.9\]: must be two values in \[0, 1\)"),
    ('--training.mixed_precision_reduce="bfloat16"', r"is not allowed; allowed: \['float32'\]"),
    ('--parallelism.fsdp_reshard_after_forward="sometimes"', r"allowed: \['default', 'always', 'never'\]"),
    ("--training.gc_freq=1.5", r"training.gc_freq = 1.5: expected int, got float"),
    ('--debug.seed="a"', r"debug.seed = 'a': expected int, got str"),
    ('--optimizer.param_groups=[{pattern = "norm"}]', r"optimizer.param_groups\[0\] = .*missing \['optimizer_name'\]"),
    ('--optimizer.param_groups=[{pattern = "x", optimizer_name = "AdamW", lrr = 1}]',
     r"unknown key 'optimizer.param_groups\[0\].lrr'"),
    ('--activation_checkpoint.mode="selective"', r"SelectiveAC is not implemented for titan_rl models"),
    ('--activation_checkpoint.mode="memory_budget"', r"MemoryBudgetAC needs torch.compile"),
    ('--activation_checkpoint.mode="sometimes"', r"allowed: \['none', 'full', 'selective', 'memory_budget'\]"),
    ("--metrics.log_frq=2", r"unknown key 'metrics.log_frq'.*did you mean 'log_freq'"),
])
def test_torchtitan_types_and_values_are_strict(override, message):
    with pytest.raises(config.ConfigError, match=message):
        config.load(BASE, [override])


def test_torchtitan_post_init_checks_are_config_errors():
    cfg = config.load(BASE)
    cfg.checkpoint.interval = 0  # past _fill and _RANGES: TorchTitan's own check still refuses it
    with pytest.raises(config.ConfigError, match=r"^\[checkpoint\] Checkpoint interval needs to be at least 1"):
        config._check_titan_sections(cfg)


NON_DEFAULT = [
    "--training.gc_freq=7", "--training.max_norm=0.5", "--lr_scheduler.total_steps=400",
    '--lr_scheduler.decay_type="cosine"', "--optimizer.betas=[0.8, 0.9]", '--optimizer.implementation="foreach"',
    '--optimizer.param_groups=[{pattern = "norm", optimizer_name = "AdamW", optimizer_kwargs = {lr = 0.01}}]',
    "--parallelism.data_parallel_replicate_degree=1", '--checkpoint.folder="ckpt"', "--checkpoint.load_only=false",
    '--metrics.save_tb_folder="tensorboard"', '--activation_checkpoint.mode="full"',
    "--activation_checkpoint.preserve_rng_state=false", "--comm.init_timeout_seconds=60", "--debug.seed=5",
    "--profiler.profile_freq=3",
]


def test_snapshot_round_trips_the_torchtitan_sections():
    cfg = config.load(BASE, NON_DEFAULT)
    again = config.from_dict(tomli.loads(config.to_toml(cfg)))
    assert config.to_dict(again) == config.to_dict(cfg)
    assert again.optimizer.param_groups[0].optimizer_kwargs == {"lr": 0.01} and again.debug.seed == 5


def test_sections_reach_trainer_config():
    from torchtitan.components.optimizer import ParamGroupConfig
    from torchtitan.distributed.activation_checkpoint import FullAC

    from titan_rl.titan.build import build_titan_config

    cfg = config.load(BASE, NON_DEFAULT)
    tc = build_titan_config(cfg, "/tmp/unused_run_dir")
    t = tc.training
    assert (t.gc_freq, t.max_norm, t.steps) == (7, 0.5, cfg.training.steps) and not hasattr(t, "seed")
    # the keys titan_rl derives
    assert (t.local_batch_size, t.seq_len, t.mixed_precision_param) == (1, cfg.rollout.max_model_len, "float32")
    assert tc.parallelism.spmd_backend == "partial_dtensor" and cfg.parallelism.spmd_backend == "spmd_types"
    assert tc.optimizer.implementation == "foreach"
    assert tc.optimizer.param_groups == [
        ParamGroupConfig(pattern="norm", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                         optimizer_kwargs={"lr": 1e-3, "betas": (0.8, 0.9), "eps": 1e-8, "weight_decay": 0.0})]
    assert (tc.lr_scheduler.total_steps, tc.lr_scheduler.decay_type) == (400, "cosine")
    assert type(tc.activation_checkpoint) is FullAC.Config and not tc.activation_checkpoint.preserve_rng_state
    assert (tc.checkpoint.folder, tc.checkpoint.enable, tc.checkpoint.last_save_model_only) == ("ckpt", True, False)
    assert tc.metrics.save_tb_folder == "tensorboard" and tc.comm.init_timeout_seconds == 60
    assert tc.debug.seed == 5 and tc.profiler.profile_freq == 3
    assert build_titan_config(config.load(BASE), "/tmp/unused_run_dir").activation_checkpoint is None
