"""Verifiable RL tasks: a character-level tokenizer, examples, rewards, held-out seeds, and a loader.

A built-in task needs no download: it generates its own prompts from a seed, owns a tiny
character-level tokenizer whose special ids match the models' config.json (BOS 0, EOS 1),
and scores a sampled completion (token ids) with a reward in [0, 1]. Chat and library
tasks (titan_rl.tasks.chat, titan_rl.tasks.library) use the checkpoint's own tokenizer
instead; docs/tasks.md describes both.
"""

from __future__ import annotations

import abc
import math
import random
from dataclasses import dataclass
from typing import Iterable

from titan_rl.errors import UserError

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
REPLACEMENT_CHAR = "\ufffd"

# Seeds at or above HELD_OUT_SEEDS draw held-out questions (evaluation); training draws
# from seeds below it (titan_rl.rl.seeds keeps every training seed under 2**31 - 1). A task
# with a fixed set of rows answers the two ranges from disjoint rows; a procedural one
# from disjoint generator seeds.
HELD_OUT_SEEDS = 2**31


def eval_seed(seed: int) -> int:
    """The task seed of evaluation seed `seed` (`[eval] seed`, `titan_rl.eval --seed`)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"evaluation seed must be an int >= 0, got {seed!r}")
    return HELD_OUT_SEEDS + seed


def is_held_out(seed: int) -> bool:
    return seed >= HELD_OUT_SEEDS


class CharTokenizer:
    """One id per character. Ids: 0 = BOS "<s>", 1 = EOS "</s>", 2 = PAD, then the alphabet.

    BOS/EOS ids are 0/1 to match the models' config.json (bos_token_id 0, eos_token_id 1).
    """

    bos_token = BOS_TOKEN
    eos_token = EOS_TOKEN
    pad_token = PAD_TOKEN

    def __init__(self, alphabet: str):
        if not isinstance(alphabet, str) or not alphabet:
            raise ValueError(f"CharTokenizer: alphabet must be a non-empty str, got {alphabet!r}")
        dups = sorted({c for c in alphabet if alphabet.count(c) > 1})
        if dups:
            raise ValueError(f"CharTokenizer: alphabet {alphabet!r} repeats characters {dups!r}")
        self.alphabet = alphabet
        self.bos_id = 0
        self.eos_id = 1
        self.pad_id = 2
        self._special = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
        self._offset = len(self._special)
        self._char_to_id = {c: i + self._offset for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return self._offset + len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        """Characters to ids. Adds no BOS/EOS. Unknown character -> ValueError."""
        ids = []
        for pos, c in enumerate(text):
            i = self._char_to_id.get(c)
            if i is None:
                raise ValueError(
                    f"CharTokenizer.encode: character {c!r} at position {pos} of {text!r} is "
                    f"not in the alphabet {self.alphabet!r}"
                )
            ids.append(i)
        return ids

    def decode(self, ids: Iterable[int], errors: str = "replace") -> str:
        """Ids to text: stops at the first EOS, skips BOS and PAD.

        Ids outside the vocabulary (a model's vocab is usually larger than this tokenizer's)
        become U+FFFD with errors="replace" (the default, so decoding samples never fails),
        or raise ValueError with errors="strict".
        """
        if errors not in ("replace", "strict"):
            raise ValueError(f"CharTokenizer.decode: errors must be 'replace' or 'strict', got {errors!r}")
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i == self.bos_id or i == self.pad_id:
                continue
            j = i - self._offset
            if 0 <= j < len(self.alphabet):
                out.append(self.alphabet[j])
            elif errors == "strict":
                raise ValueError(
                    f"CharTokenizer.decode: id {i} is outside the vocabulary (size {self.vocab_size})"
                )
            else:
                out.append(REPLACEMENT_CHAR)
        return "".join(out)

    def __repr__(self) -> str:
        return f"CharTokenizer(alphabet={self.alphabet!r}, vocab_size={self.vocab_size})"


@dataclass
class Example:
    """One prompt. prompt_ids starts with BOS (or whatever the chat template renders);
    prompt_text is the prompt without BOS; meta is what the task's reward needs besides the
    answer (a library's own record of the question)."""

    prompt_ids: list[int]
    answer: str
    prompt_text: str
    meta: object = None


def match_reward(answer: str, completion_ids: Iterable[int], tokenizer: CharTokenizer) -> float:
    """Shared reward shape: 1.0 for an exact, EOS-terminated match, else partial credit.

    The completion is decoded up to its first EOS. Partial credit = 0.5 * (positions i
    where completion[i] == answer[i]) / max(len(answer), len(completion)); so a wrong
    length is penalised, an empty completion scores 0, and a completion without EOS
    (truncated) scores at most 0.5 even if its text equals the answer.
    """
    ids = [int(i) for i in completion_ids]
    terminated = tokenizer.eos_id in ids
    text = tokenizer.decode(ids)
    if terminated and text == answer:
        return 1.0
    denom = max(len(answer), len(text))
    if denom == 0:
        return 0.0
    hits = sum(a == b for a, b in zip(answer, text))
    return 0.5 * hits / denom


class Task(abc.ABC):
    """Base class for a verifiable task. Subclasses set name, tokenizer, max_new_tokens
    and implement sample() (abstract: a class without it cannot be built) and may override
    reward(); sft_pairs() has a default built on sample()."""

    name: str = "task"
    tokenizer: CharTokenizer
    max_new_tokens: int
    # True: the constructor takes `checkpoint`, the model folder whose tokenizer it uses
    needs_checkpoint: bool = False

    @abc.abstractmethod
    def sample(self, n: int, seed: int) -> list[Example]:
        """n examples, a pure function of (n, seed); sample(n, s) is a prefix of sample(m, s) for n <= m."""

    def reward(self, example: Example, completion_ids: list[int]) -> float:
        """Score in [0, 1] for the sampled completion (ids after the prompt)."""
        return match_reward(example.answer, completion_ids, self.tokenizer)

    def target_ids(self, example: Example) -> list[int]:
        """The correct completion: the answer's ids followed by EOS."""
        return self.tokenizer.encode(example.answer) + [self.tokenizer.eos_id]

    def sft_pairs(self, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
        """(prompt_ids, target_ids) for supervised warm-up; target_ids ends with EOS."""
        return [(list(ex.prompt_ids), self.target_ids(ex)) for ex in self.sample(n, seed)]

    @staticmethod
    def _rng(seed: int) -> random.Random:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        return random.Random(seed)

    @staticmethod
    def _check_n(n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, max_new_tokens={getattr(self, 'max_new_tokens', None)})"


def check_reward(value, task_name: str, example_index: int, example, completion_index: int, completion, tok,
                 step: int) -> float:
    """A reward must be a finite number: a NaN would turn the advantages, the loss and then
    every weight into NaN without an error."""
    try:
        r = float(value)
    except (TypeError, ValueError):
        r = None
    if r is not None and math.isfinite(r):
        return r
    try:
        text = tok.decode(completion)
    except Exception:
        text = "?"
    raise UserError(
        f"task {task_name!r} returned reward {value!r} at step {step} for example {example_index} "
        f"(prompt {getattr(example, 'prompt_text', '')!r}), completion {completion_index} ({text!r}, ids "
        f"{list(completion)}): rewards must be finite numbers")
