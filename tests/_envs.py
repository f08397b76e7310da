"""Environments for the tests (task.name = "tests._envs:..."): one that misbehaves in a chosen
way on odd starts, one that uses Python's global random as textarena does, and a chat
conversation on a model folder's tokenizer."""

import random
import time

from titan_rl.tasks import CharTokenizer, ChatTokenizer, DIGITS_ALPHABET, Environment

HOW = ("reset", "step_raises", "step_hangs", "step_not_text", "overflow", "reward_raises")


class Misbehaving(Environment):
    """Digit questions on the built-in alphabet, `turns` of them; on odd starts it misbehaves
    as `how` says (HOW), at the second turn where the misbehaviour is a step's. Reward 1 for
    an episode that ends well."""

    name = "misbehaving"

    def __init__(self, how: str = "step_raises", turns: int = 3, timeout_s: float = 60.0):
        assert how in HOW, how
        self.how, self.max_turns, self.timeout_s = how, turns, timeout_s
        self.tokenizer = CharTokenizer(DIGITS_ALPHABET)
        self.max_new_tokens = 4

    def _bad(self, state) -> bool:
        return state["start"] % 2 == 1

    def reset(self, start):
        if self.how == "reset" and start % 2:
            raise RuntimeError("reset failed on purpose")
        return {"start": start, "turn": 0}, [self.tokenizer.bos_id] + self.tokenizer.encode("rev:12=")

    def step(self, state, reply):
        state["turn"] += 1
        if self._bad(state) and state["turn"] == 1:
            if self.how == "step_raises":
                raise ValueError("the game broke on purpose")
            if self.how == "step_hangs":
                time.sleep(3 * self.timeout_s)
            if self.how == "step_not_text":
                return 42
            if self.how == "overflow":
                return "1" * 5000
        return None if state["turn"] == self.max_turns else "rev:34="

    def reward(self, state):
        if self.how == "reward_raises" and self._bad(state):
            raise KeyError("no score on purpose")
        return 1.0


class GlobalRandomGame(Environment):
    """A game whose moves read Python's global random, seeded at reset (as textarena's do):
    each answer is a digit string drawn from it, so interleaved episodes that share one
    random stream would answer differently."""

    name = "global_random"
    uses_global_random = True

    def __init__(self, turns: int = 4, delay_s: float = 0.0):
        self.max_turns, self.delay_s = turns, delay_s
        self.tokenizer = CharTokenizer(DIGITS_ALPHABET)
        self.max_new_tokens = 3

    def reset(self, start):
        random.seed(start)
        return {"seen": []}, [self.tokenizer.bos_id] + self.tokenizer.encode(f"{random.randint(0, 999)}=")

    def step(self, state, reply):
        time.sleep(self.delay_s * random.random())  # other episodes' calls get in between
        state["seen"].append(random.randint(0, 999))
        return f"{state['seen'][-1]}="

    def reward(self, state):
        return float(sum(state["seen"]) % 7) / 7


# Qwen3 in non-thinking mode: the turn being generated (and a reply closing the conversation)
# opens with an empty think block; earlier assistant turns are written without it. So every
# new message rewrites the reply before it: a template that cannot be bridged.
THINK_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and loop.last %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + m['content'] "
    "+ '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}{% endif %}")


class ChatTurns(Environment):
    """A conversation on the model folder's chat template: the user asks, the reply is
    answered by the next question, `turns` times. Reward: the share of replies that end on
    the end-of-turn token."""

    name = "chat_turns"
    needs_checkpoint = True

    def __init__(self, checkpoint: str, turns: int = 3, max_new_tokens: int = 6):
        self.tokenizer = ChatTokenizer.from_folder(checkpoint)
        self.max_turns, self.max_new_tokens = turns, max_new_tokens

    def reset(self, start):
        return {"closed": 0, "n": 0}, [{"role": "user", "content": f"What is {start % 97} + 7 - 3 ="}]

    def step(self, state, reply):
        state["n"] += 1
        state["closed"] += not reply.truncated
        return None if state["n"] == self.max_turns else [{"role": "user", "content": f"and {state['n']} + 12 ="}]

    def reward(self, state):
        return state["closed"] / max(state["n"], 1)
