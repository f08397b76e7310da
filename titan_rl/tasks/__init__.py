"""Verifiable RL tasks: built-in ones (no downloads, their own tokenizer), chat tasks on the
checkpoint's tokenizer and template, tasks from libraries; rewards, held-out seeds, loader."""

from .base import (
    HELD_OUT_SEEDS, CharTokenizer, Example, Task, check_reward, eval_seed, is_held_out, match_reward,
)
from .chat import ChatTask, ChatTokenizer, extract_answer
from .digits import DIGITS_ALPHABET, DigitAddTask, DigitReverseTask
from .env import Environment, Reply, TaskEnvironment, as_environment
from .loader import BUILTIN_TASKS, LIBRARY_TASKS, load_task

__all__ = [
    "BUILTIN_TASKS",
    "ChatTask",
    "ChatTokenizer",
    "CharTokenizer",
    "DIGITS_ALPHABET",
    "DigitAddTask",
    "DigitReverseTask",
    "Environment",
    "Example",
    "HELD_OUT_SEEDS",
    "LIBRARY_TASKS",
    "Reply",
    "Task",
    "TaskEnvironment",
    "as_environment",
    "check_reward",
    "eval_seed",
    "extract_answer",
    "is_held_out",
    "load_task",
    "match_reward",
]
