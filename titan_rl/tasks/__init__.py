"""Built-in verifiable RL tasks (no downloads): tokenizer, examples, rewards, loader."""

from .base import BUILTIN_TASKS, CharTokenizer, Example, Task, check_reward, load_task, match_reward
from .digits import DIGITS_ALPHABET, DigitAddTask, DigitReverseTask

__all__ = [
    "BUILTIN_TASKS",
    "CharTokenizer",
    "DIGITS_ALPHABET",
    "DigitAddTask",
    "DigitReverseTask",
    "Example",
    "Task",
    "check_reward",
    "load_task",
    "match_reward",
]
