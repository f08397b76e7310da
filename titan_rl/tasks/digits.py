"""Built-in digit tasks: small enough for the 3.7M debug model to learn on CPU in minutes.

Both tasks share one alphabet (vocab 19: BOS, EOS, PAD + 16 characters), so one
tokenizer, and one SFT warm-up, can serve either.
"""

from __future__ import annotations

from .base import CharTokenizer, Example, Task, match_reward
from .env import Environment

DIGITS_ALPHABET = "0123456789+=:rev"


def _check_lengths(cls: str, min_len: int, max_len: int, cap: int) -> None:
    for k, v in (("min_len", min_len), ("max_len", max_len)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{cls}: {k} must be an int, got {v!r}")
    if not 1 <= min_len <= max_len <= cap:
        raise ValueError(f"{cls}: need 1 <= min_len <= max_len <= {cap}, got min_len={min_len}, max_len={max_len}")


class DigitReverseTask(Task):
    """Prompt BOS + "rev:4821=", answer "1284". Digit strings may start with 0."""

    name = "digit_reverse"

    def __init__(self, min_len: int = 3, max_len: int = 6):
        _check_lengths(type(self).__name__, min_len, max_len, cap=64)
        self.min_len = min_len
        self.max_len = max_len
        self.tokenizer = CharTokenizer(DIGITS_ALPHABET)
        self.max_new_tokens = max_len + 2

    def make_example(self, digits: str) -> Example:
        prompt_text = f"rev:{digits}="
        return Example(
            prompt_ids=[self.tokenizer.bos_id] + self.tokenizer.encode(prompt_text),
            answer=digits[::-1],
            prompt_text=prompt_text,
        )

    def sample(self, n: int, seed: int) -> list[Example]:
        self._check_n(n)
        rng = self._rng(seed)
        out = []
        for _ in range(n):
            length = rng.randint(self.min_len, self.max_len)
            out.append(self.make_example("".join(rng.choice("0123456789") for _ in range(length))))
        return out


class DigitAddTask(Task):
    """Prompt BOS + "12+345=", answer "357". Each operand has a digit count uniform in
    [min_len, max_len] and no leading zero (a 1-digit operand may be 0)."""

    name = "digit_add"

    def __init__(self, min_len: int = 1, max_len: int = 3):
        _check_lengths(type(self).__name__, min_len, max_len, cap=32)
        self.min_len = min_len
        self.max_len = max_len
        self.tokenizer = CharTokenizer(DIGITS_ALPHABET)
        # The sum has at most max_len + 1 digits, then EOS.
        self.max_new_tokens = max_len + 2

    def make_example(self, a: int, b: int) -> Example:
        prompt_text = f"{a}+{b}="
        return Example(
            prompt_ids=[self.tokenizer.bos_id] + self.tokenizer.encode(prompt_text),
            answer=str(a + b),
            prompt_text=prompt_text,
        )

    @staticmethod
    def _operand(rng, length: int) -> int:
        lo = 0 if length == 1 else 10 ** (length - 1)
        return rng.randint(lo, 10**length - 1)

    def sample(self, n: int, seed: int) -> list[Example]:
        self._check_n(n)
        rng = self._rng(seed)
        out = []
        for _ in range(n):
            a = self._operand(rng, rng.randint(self.min_len, self.max_len))
            b = self._operand(rng, rng.randint(self.min_len, self.max_len))
            out.append(self.make_example(a, b))
        return out


class DigitTurnsEnvironment(Environment):
    """Several digit reversals in one conversation, for the debug models: the environment
    states "rev:4821=" and the reply should be "1284" and EOS; then it states the next one,
    for `turns` turns. Plain text (no chat template): each question's characters are
    appended to the stream after the reply's EOS. Reward: the mean of match_reward over the
    `turns` questions (a question not reached scores 0)."""

    name = "digit_turns"

    def __init__(self, turns: int = 3, min_len: int = 2, max_len: int = 4):
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
            raise ValueError(f"DigitTurnsEnvironment: turns must be an int >= 1, got {turns!r}")
        self.questions = DigitReverseTask(min_len, max_len)
        self.tokenizer = self.questions.tokenizer
        self.max_new_tokens = self.questions.max_new_tokens
        self.max_turns = turns

    def reset(self, start: int):
        examples = self.questions.sample(self.max_turns, seed=start)
        return {"examples": examples, "scores": []}, list(examples[0].prompt_ids)

    def step(self, state, reply):
        scores, examples = state["scores"], state["examples"]
        scores.append(match_reward(examples[len(scores)].answer, reply.ids, self.tokenizer))
        return None if len(scores) == len(examples) else examples[len(scores)].prompt_text

    def reward(self, state) -> float:
        return sum(state["scores"]) / self.max_turns

    def sft_pairs(self, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
        """The first question's (prompt, target) of n episodes (the format; later turns follow it)."""
        return self.questions.sft_pairs(n, seed)
