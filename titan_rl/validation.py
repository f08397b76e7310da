"""Everything a run can refuse, checked before any heavy work (TorchTitan, DCP, vLLM).

A user error (bad config value, run dir, task, prompt, checkpoint folder, a relaunch with
another config) is one line on stderr and exit code 2; a traceback means a bug. The run
dir remembers its resolved config (RUN_DIR/config.toml) so a relaunch cannot silently mix
two settings.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

import tomli

from titan_rl import config as config_mod
from titan_rl.errors import UserError, one_line
from titan_rl.run_dir import latest_checkpoint_step
from titan_rl.rl.global_batch import check_global_batch

CONFIG_FILE = "config.toml"


def check_cli_overrides(extra: list[str], options: list[str]) -> None:
    """Arguments argparse did not know must be --section.key=value; a misspelt option
    is named with the nearest real one (argparse would hand its value on as an override)."""
    for arg in extra:
        key, sep, _ = arg.removeprefix("--").partition("=")
        if arg.startswith("--") and "." in key and sep:
            continue
        if arg.startswith("--") and "." not in key:
            m = difflib.get_close_matches(arg.split("=")[0], options, n=1, cutoff=0.5)
            hint = f"; did you mean {m[0]}?" if m else ""
            raise UserError(f"unknown option {arg.split('=')[0]}{hint} (options: {', '.join(options)}; "
                            f"config overrides are --section.key=value)")
        raise UserError(f"unexpected argument {arg!r}: expected an option ({', '.join(options)}) "
                        f"or a config override --section.key=value")


# -- run dir --------------------------------------------------------------------------
def check_run_dir(run_dir: str) -> None:
    p = Path(run_dir)
    if p.exists() and not p.is_dir():
        raise UserError(f"--run-dir {run_dir!r} is a file, not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--run-dir {run_dir!r} cannot be created: {e.strerror or e}") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise UserError(f"--run-dir {run_dir!r} is not writable")


def _flat(d: dict) -> dict:
    return {f"{s}.{k}": v for s, table in d.items() if isinstance(table, dict) for k, v in table.items()}


def config_diff(old: dict, new: dict) -> dict[str, tuple]:
    """{section.key: (old, new)} over the union of keys (a key one side lacks shows as None)."""
    a, b = _flat(old), _flat(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def check_run_config(cfg: config_mod.Config, run_dir: str, allow: list[str]) -> dict[str, tuple]:
    """Compare the resolved config with the one the run dir stored. Returns the allowed
    changes (to be logged); refuses any other difference when the run dir has progress
    to resume (a checkpoint), since TorchTitan would resume it under the new settings."""
    new = config_mod.to_dict(cfg)
    flat_keys = list(_flat(new))
    for key in allow:
        if key not in flat_keys and key != PLATFORM_KEY:
            m = difflib.get_close_matches(key, flat_keys, n=1, cutoff=0.5)
            raise UserError(f"--allow-config-change {key!r} is not a config key"
                            + (f"; did you mean {m[0]!r}?" if m else ""))
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file() or not cfg.checkpoint.enable or latest_checkpoint_step(cfg, run_dir) == 0:
        return {}
    try:
        old = tomli.loads(path.read_text())
    except (tomli.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid TOML ({e}); it records the run's config: restore it or use a "
                        f"new --run-dir") from None
    diff = config_diff(old, new)
    refused = {k: v for k, v in diff.items() if k not in allow}
    if refused:
        listed = "; ".join(f"{k}: {o!r} -> {n!r}" for k, (o, n) in refused.items())
        raise UserError(f"run dir {run_dir!r} holds a run with another config ({path}); differing keys: {listed}. "
                        f"Resuming would mix both settings: use a new --run-dir, or allow the change with "
                        f"--allow-config-change={','.join(refused)}")
    return diff


PLATFORM_FILE = "platform.json"
PLATFORM_KEY = "platform"  # --allow-config-change's name for "resume on other platform choices"


def _bit_choices(cfg: config_mod.Config) -> dict:
    import torch

    from titan_rl.kernels.selfcheck import bit_choices

    return bit_choices(getattr(torch, cfg.model.dtype))


def check_run_platform(cfg: config_mod.Config, run_dir: str, allow: list[str]) -> dict[str, tuple]:
    """A run dir with a checkpoint records the platform choices its bits came from
    (kernels.selfcheck.bit_choices); resuming it where one differs (another CPU kind, another
    torch) would continue the policy with other bits: refused in one line before any work,
    unless allowed with --allow-config-change=platform (then returned, to be logged). Stock
    kernels claim no bits: not checked."""
    path = Path(run_dir) / PLATFORM_FILE
    if (cfg.model.kernels != "exact" or not path.is_file() or not cfg.checkpoint.enable
            or latest_checkpoint_step(cfg, run_dir) == 0):
        return {}
    try:
        old = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); it records the platform the run's bits came from: "
                        f"restore it or use a new --run-dir") from None
    new = _bit_choices(cfg)
    diff = {f"{PLATFORM_KEY}.{k}": (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)}
    if diff and PLATFORM_KEY not in allow:
        listed = "; ".join(f"{k}: {o!r} -> {n!r}" for k, (o, n) in diff.items())
        raise UserError(f"run dir {run_dir!r} was trained on other platform choices ({path}): {listed}. Its policy "
                        f"would continue with other bits: resume it on the machine kind it ran on, or allow it "
                        f"with --allow-config-change={PLATFORM_KEY}")
    return diff


def write_run_platform(cfg: config_mod.Config, run_dir: str) -> None:
    path = Path(run_dir) / PLATFORM_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_bit_choices(cfg), indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def write_run_config(cfg: config_mod.Config, run_dir: str) -> None:
    path = Path(run_dir) / CONFIG_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(config_mod.to_toml(cfg))
    os.replace(tmp, path)


# -- task -----------------------------------------------------------------------------
def load_task_checked(cfg: config_mod.Config):
    return load_named_task(cfg.task.name, cfg.task.kwargs, cfg.model.checkpoint or None)


def load_named_task(name: str, kwargs: dict, checkpoint: str | None, keys=("task.name", "task.kwargs")):
    """The task `name` with `kwargs` (chat and library tasks: on `checkpoint`'s tokenizer),
    or a one-line UserError naming the keys (`keys`: how the caller's user spelt them)."""
    from titan_rl.tasks import BUILTIN_TASKS, LIBRARY_TASKS, load_task

    try:
        return load_task(name, checkpoint=checkpoint, **kwargs)
    except ValueError as e:
        hint = ""
        if ":" not in name:
            m = difflib.get_close_matches(name, list(BUILTIN_TASKS), n=1, cutoff=0.5)
            hint = f"; did you mean {m[0]!r}?" if m else ""
        elif name.partition(":")[0] not in LIBRARY_TASKS:
            m = difflib.get_close_matches(name.partition(":")[0], list(LIBRARY_TASKS), n=1, cutoff=0.6)
            hint = f"; did you mean '{m[0]}:{name.partition(':')[2]}'?" if m else ""
        raise UserError(f"{keys[0]} = {name!r}: {one_line(e).removeprefix('load_task: ')}{hint}") from None
    except Exception as e:  # the task's own constructor failed: the user's code, not ours
        raise UserError(f"{keys[0]} = {name!r}: constructing it with {keys[1]} = {kwargs!r} "
                        f"raised {type(e).__name__}: {e}") from None


def check_task(cfg: config_mod.Config, task, vocab_size: int) -> None:
    """A dry call of the task's prompt source for every step the run will take (a step's
    prompts are a pure function of (seed, step), so these are the run's prompts), checked
    against the model's vocabulary and rollout.max_model_len."""
    from titan_rl.rl.seeds import prompt_seed, sft_seed

    name, a, r = cfg.task.name, cfg.algorithm, cfg.rollout
    new = getattr(task, "max_new_tokens", None)
    if isinstance(new, bool) or not isinstance(new, int) or new < 1:
        raise UserError(f"task {name!r}: max_new_tokens = {new!r}: must be an int >= 1")
    tok = getattr(task, "tokenizer", None)
    if tok is None or not isinstance(getattr(tok, "vocab_size", None), int):
        raise UserError(f"task {name!r} has no tokenizer with an int vocab_size")
    if tok.vocab_size > vocab_size:
        whose = "its tokenizer"
        if getattr(task, "needs_checkpoint", False):
            whose = (f"the tokenizer in model.checkpoint = {cfg.model.checkpoint!r}; the model and its tokenizer must "
                     f"come from one folder")
        raise UserError(f"task {name!r} needs {tok.vocab_size} token ids ({whose}); the model's vocab_size is "
                        f"{vocab_size}")
    from titan_rl.tasks import Environment

    if isinstance(task, Environment):
        check_environment(cfg, task)
        return
    draws = [(f"RL step {step}", a.prompts_per_step, prompt_seed(cfg.training.seed, step), new)
             for step in range(a.sft_steps + 1, cfg.training.steps + 1)]
    if cfg.eval.interval > 0:
        from titan_rl.tasks import eval_seed

        draws.append(("the evaluation (eval.n, eval.seed)", cfg.eval.n, eval_seed(cfg.eval.seed),
                      cfg.eval.max_new_tokens or new))
    for where, n, seed, new_tokens in draws:
        check_prompts(task, name, n, seed, where, new_tokens, vocab_size, r.max_model_len)
    if a.sft_steps > 0:
        what = f"task {name!r}: sft_pairs(1, ...) (the supervised warm-up, algorithm.sft_steps = {a.sft_steps})"
        try:
            pairs = task.sft_pairs(1, seed=sft_seed(cfg.training.seed, 1))
        except Exception as e:
            raise UserError(f"{what} raised {type(e).__name__}: {e}") from None
        ok = (isinstance(pairs, list) and len(pairs) == 1 and len(pairs[0]) == 2
              and all(isinstance(t, int) for t in list(pairs[0][0]) + list(pairs[0][1])))
        if not ok:
            raise UserError(f"{what} returned {pairs!r:.200}: need one (prompt_ids, target_ids) pair of int lists")


def check_environment(cfg: config_mod.Config, env) -> None:
    """What can be known of a multi-turn environment before any episode: its turn budget, and
    a supervised warm-up only where it states targets. Its episodes are only known once
    played; one that misbehaves then ends with reward 0 and a logged reason
    (titan_rl.rl.episodes)."""
    name, a = cfg.task.name, cfg.algorithm
    turns = getattr(env, "max_turns", None)
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise UserError(f"task {name!r}: max_turns = {turns!r}: must be an int >= 1")
    timeout = getattr(env, "timeout_s", None)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise UserError(f"task {name!r}: timeout_s = {timeout!r}: must be a number of seconds > 0")
    if a.sft_steps > 0 and not callable(getattr(env, "sft_pairs", None)):
        raise UserError(f"algorithm.sft_steps = {a.sft_steps}: environment {name!r} states no supervised targets "
                        f"(no sft_pairs method); set algorithm.sft_steps = 0")


def check_prompts(task, name: str, n: int, seed: int, where: str, new_tokens: int, vocab_size: int,
                  max_model_len: int, limit_key: str = "rollout.max_model_len") -> list:
    """task.sample(n, seed), each prompt checked against the model's vocabulary and the
    engine's max_model_len (the setting `limit_key`) with `new_tokens` to generate; returns
    the examples."""
    try:
        examples = task.sample(n, seed=seed)
    except Exception as e:
        raise UserError(f"task {name!r}: sample({n}, seed={seed}) for {where} raised {type(e).__name__}: {e}") from None
    if len(examples) != n:
        raise UserError(f"task {name!r}: sample({n}, ...) returned {len(examples)} examples")
    for i, ex in enumerate(examples):
        ids = getattr(ex, "prompt_ids", None)
        if not ids or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise UserError(f"task {name!r}: example {i} at {where} has prompt_ids {ids!r:.300}: need a "
                            f"non-empty list of ints in [0, {vocab_size})")
        need = len(ids) + new_tokens
        if need > max_model_len:
            text = getattr(ex, "prompt_text", "")
            raise UserError(
                f"task {name!r}: example {i} at {where} ({text!r:.200}) has a {len(ids)}-token prompt; with "
                f"max_new_tokens = {new_tokens} it needs {need} positions > {limit_key} = {max_model_len}: "
                f"raise {limit_key} to >= {need} or shorten the prompts")
    return examples


# -- model / checkpoint -----------------------------------------------------------------
def model_vocab(cfg: config_mod.Config) -> int:
    """The model's vocab size, from the checkpoint folder (checked strictly) or the flavor."""
    from titan_rl.checkpoint import check_hf_folder
    from titan_rl.registry import get_architecture

    if cfg.model.checkpoint:
        return check_hf_folder(cfg.model.checkpoint, arch=cfg.model.name).vocab_size
    return get_architecture(cfg.model.name).flavors[cfg.model.flavor].vocab_size


def preflight_train(cfg: config_mod.Config, run_dir: str, allow: list[str]) -> tuple[object, dict]:
    """All start-up checks of `python -m titan_rl.train`. Returns (task, allowed config changes)."""
    check_global_batch(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    check_run_dir(run_dir)
    task = load_task_checked(cfg)
    check_task(cfg, task, model_vocab(cfg))
    changes = check_run_config(cfg, run_dir, allow)
    changes.update(check_run_platform(cfg, run_dir, allow))
    return task, changes
