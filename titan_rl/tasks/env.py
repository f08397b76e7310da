"""Environments: what a rollout talks to, for one turn or many.

An episode is a conversation between the policy and an `Environment`: `reset(start)` gives
the opening (chat messages, or prompt token ids), the engine samples a reply, `step(state,
reply)` answers with the environment's new messages (or None: the episode is over), and so
on for at most `max_turns` replies; `reward(state)` scores the finished episode. The rollout
loop (titan_rl.rl.episodes) keeps the episode one token stream, token in and token out: the
engine's sampled ids as it produced them, then only the new messages' tokens as the chat
template writes them after the reply (titan_rl.tasks.bridge), never a re-render of the whole
conversation.

A single-turn `Task` is the one-turn case of the same loop: `TaskEnvironment(task)` opens
with the task's prompt ids, ends after the first reply and scores it with `task.reward`.

An environment is reproducible by construction: each episode is a pure function of its
start (a seed or a task example, itself a function of the run's seed, the step and the
episode's global index) and of the replies, however the loop schedules the calls. An
environment whose code reads Python's global `random` (textarena seeds it in its state)
sets `uses_global_random`: the loop then runs each of its calls under the episode's own
random state, swapped in and out under a lock (titan_rl.rl.episodes).
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass

from .base import HELD_OUT_SEEDS, Example, Task, is_held_out

# Chat messages as the template renders them: {"role": ..., "content": ...}
Messages = list[dict]


@dataclass(frozen=True)
class Reply:
    """One sampled turn as the environment sees it."""

    ids: tuple[int, ...]  # the engine's sampled ids, the stop token included where it stopped on one
    text: str  # decoded up to the first stop id, special tokens skipped
    turn: int  # 0 for the first reply
    truncated: bool  # ended by the turn's token budget, not by a stop token


class Environment(abc.ABC):
    """An episode's other side. Subclasses set `name`, `tokenizer` (a ChatTokenizer for
    chat messages, or a CharTokenizer: plain text), `max_new_tokens` (per reply) and
    `max_turns`, and implement `reset`, `step` and `reward`."""

    name: str = "environment"
    tokenizer: object
    max_new_tokens: int
    max_turns: int = 1
    needs_checkpoint: bool = False  # True: the constructor takes `checkpoint` (the model folder's tokenizer)
    uses_global_random: bool = False  # its calls read or seed Python's global `random`
    # seconds one call (reset, step, reward) may take before its episode ends with reward 0
    timeout_s: float = 60.0

    def starts(self, n: int, seed: int) -> list:
        """The starts of n episodes, a pure function of (n, seed); a prefix of a longer draw.
        By default n integer seeds derived from `seed` (held-out seeds, >=
        titan_rl.tasks.HELD_OUT_SEEDS, give held-out ones)."""
        # training starts below 2**31 - 1; held-out ones are moved to HELD_OUT_SEEDS and up
        base = HELD_OUT_SEEDS if is_held_out(seed) else 0
        rng = random.Random(seed)
        return [base + rng.randrange(2**31 - 1) for _ in range(n)]

    @abc.abstractmethod
    def reset(self, start) -> tuple[object, Messages | list[int]]:
        """(the episode's state, its opening: chat messages, or prompt token ids)."""

    @abc.abstractmethod
    def step(self, state, reply: Reply) -> Messages | str | None:
        """The environment's answer to `reply`: new chat messages (a str is one user message),
        or None when the episode is over. May update `state`."""

    @abc.abstractmethod
    def reward(self, state) -> float:
        """The finished episode's reward."""

    def rewards(self, states: list) -> list[float]:
        """Every finished episode's reward in one call (override to batch a scorer)."""
        return [self.reward(s) for s in states]

    def target_ids(self, start) -> list[int] | None:
        """A supervised target for the first reply (algorithm.sft_steps), where there is one."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, max_turns={self.max_turns})"


def check_turn_settings(name: str, max_turns, max_new_tokens, system) -> None:
    """An environment's own keys, refused in one line naming the key and the value."""
    for key, value in (("max_turns", max_turns), ("max_new_tokens", max_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {key} = {value!r}: it must be an int >= 1")
    if not isinstance(system, str):
        raise ValueError(f"{name}: system = {system!r}: it must be a string (\"\" for none)")


@dataclass
class _TaskState:
    example: Example
    completion: tuple[int, ...] = ()


class TaskEnvironment(Environment):
    """A single-turn Task as an environment: one reply, scored by `task.reward(example, ids)`."""

    max_turns = 1

    def __init__(self, task: Task):
        self.task = task
        self.name = task.name
        self.tokenizer = task.tokenizer
        self.max_new_tokens = task.max_new_tokens

    def starts(self, n: int, seed: int) -> list[Example]:
        return self.task.sample(n, seed)

    def reset(self, start: Example):
        return _TaskState(start), list(start.prompt_ids)

    def step(self, state: _TaskState, reply: Reply):
        state.completion = reply.ids
        return None

    def reward(self, state: _TaskState) -> float:
        return self.task.reward(state.example, list(state.completion))

    def target_ids(self, start: Example) -> list[int]:
        return self.task.target_ids(start)


def as_environment(task_or_env) -> Environment:
    """What the rollout loop runs: an Environment as it is, a Task as its one-turn case."""
    if isinstance(task_or_env, Environment):
        return task_or_env
    if isinstance(task_or_env, Task):
        return TaskEnvironment(task_or_env)
    raise TypeError(f"not a Task or an Environment: {type(task_or_env).__name__}")
