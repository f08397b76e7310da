"""`load_task`: a task or an environment from its name in a config (`[task] name`).

Built-in short names, "<prefix>:<argument>" library names, or "package.module:ClassName";
the same constructor rules for single-turn tasks (titan_rl.tasks.base.Task) and multi-turn
environments (titan_rl.tasks.env.Environment).
"""

from __future__ import annotations

import importlib
import inspect

from .base import Task
from .env import Environment

# Short names accepted by load_task. Plain strings so this module imports no task code.
BUILTIN_TASKS: dict[str, str] = {
    "digit_reverse": "titan_rl.tasks.digits:DigitReverseTask",
    "digit_add": "titan_rl.tasks.digits:DigitAddTask",
    "digit_turns": "titan_rl.tasks.digits:DigitTurnsEnvironment",  # multi-turn (titan_rl.tasks.env)
}
# "<prefix>:<argument>" names of tasks built from a library or a data file: the class, and
# the constructor keyword the argument goes to. These prefixes are never read as modules.
LIBRARY_TASKS: dict[str, tuple[str, str]] = {
    "reasoning_gym": ("titan_rl.tasks.library:ReasoningGymTask", "dataset"),
    "jsonl": ("titan_rl.tasks.library:JsonlTask", "path"),
    "parquet": ("titan_rl.tasks.library:ParquetTask", "path"),
    "textarena": ("titan_rl.tasks.textarena_env:TextArenaEnvironment", "env_id"),
    "tool": ("titan_rl.tasks.tool_env:CalculatorEnvironment", "dataset"),
}


def load_task(path: str, checkpoint: str | None = None, **kwargs):
    """Build a task from a built-in short name (see BUILTIN_TASKS), a library name
    "<prefix>:<argument>" (see LIBRARY_TASKS: "reasoning_gym:<dataset>", "jsonl:<path>",
    "parquet:<path>", the environments "textarena:<EnvId>" and "tool:<dataset>") or
    "package.module:ClassName".

    kwargs go to the class constructor. A class with `needs_checkpoint` (every chat and
    library task) also gets `checkpoint`, the model folder whose tokenizer and chat template
    it uses; other tasks ignore it. Raises ValueError naming the path and the reason when
    the module or class cannot be imported, the constructor rejects the kwargs, the task
    needs a checkpoint and has none, or the object is neither a Task nor an Environment
    (titan_rl.tasks.env: a multi-turn task; the rollout loop runs a Task as its one-turn case).
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"load_task: path must be a non-empty str, got {path!r}")
    prefix, sep, argument = path.partition(":")
    if sep and prefix in LIBRARY_TASKS:
        target, keyword = LIBRARY_TASKS[prefix]
        if not argument:
            raise ValueError(f"load_task: {path!r} names no {keyword}: write '{prefix}:<{keyword}>'")
        if keyword in kwargs:
            raise ValueError(f"load_task: {path!r} already names the {keyword}; task.kwargs may not set "
                             f"{keyword} = {kwargs[keyword]!r}")
        kwargs = {keyword: argument, **kwargs}
    else:
        target = BUILTIN_TASKS.get(path, path)
    if ":" not in target:
        raise ValueError(
            f"load_task: {path!r} is neither a built-in task ({', '.join(sorted(BUILTIN_TASKS))}), a library task "
            f"({', '.join(p + ':...' for p in LIBRARY_TASKS)}) nor of the form 'package.module:ClassName'"
        )
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"load_task: {path!r} must be of the form 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or any error raised while executing the module
        raise ValueError(
            f"load_task: cannot import module {module_name!r} for task {path!r}: {type(e).__name__}: {e}"
        ) from e
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ValueError(
                f"load_task: cannot import {attr!r} from module {module_name!r} for task {path!r}: "
                f"no attribute {part!r}"
            ) from e
    if isinstance(obj, type):
        if not issubclass(obj, (Task, Environment)):
            raise ValueError(f"load_task: {target!r} is a class but not a subclass of titan_rl.tasks.Task or "
                             f"titan_rl.tasks.Environment")
        if inspect.isabstract(obj):
            missing = ", ".join(sorted(obj.__abstractmethods__))
            raise ValueError(f"load_task: {target!r} does not implement {missing}, which its task base class "
                             f"leaves to each task")
        if obj.needs_checkpoint:
            if not checkpoint:
                raise ValueError(f"load_task: task {path!r} uses the model's own tokenizer and chat template, read "
                                 f"from model.checkpoint, which is not set: point it at the model's folder "
                                 f"(config.json, weights and tokenizer files)")
            kwargs = {"checkpoint": checkpoint, **kwargs}
        try:
            task = obj(**kwargs)
        except TypeError as e:
            raise ValueError(f"load_task: cannot construct {target!r} with {kwargs!r}: {e}") from e
    elif isinstance(obj, (Task, Environment)):
        if kwargs:
            raise ValueError(f"load_task: {target!r} is a Task instance; it takes no kwargs, got {kwargs!r}")
        task = obj
    else:
        raise ValueError(f"load_task: {target!r} is not a Task or an Environment (got {type(obj).__name__})")
    return task
