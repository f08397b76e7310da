"""A reasoning-gym question answered with a calculator tool: task.name = "tool:<dataset>".

    task.name = "tool:basic_arithmetic"     task.kwargs: max_turns, max_new_tokens, system, and
                                            the dataset's own config keys (as reasoning_gym:<dataset>)

The opening is [system: how to call the calculator and how to answer, user: the question].
A reply that writes `<calc>EXPRESSION</calc>` gets the calculator's answer to its first such
call as a tool message ({"role": "tool", "content": result}; where the chat template cannot
render a "tool" turn, a user turn "Calculator: <result>"), and the episode goes on. A reply
without a call ends the episode. Reward: the dataset's own `score_answer` of the answer the
last reply gives (read by `extract_answer`: the last <answer>...</answer>, else the last
number), so an episode the turn budget cut short is scored on its last reply (0 when it
gives no answer).

Questions are drawn exactly as ReasoningGymTask draws them (items 0..n-1 of the dataset of
seed `seed * ITEM_STRIDE`; held-out seeds draw held-out items).

The calculator is `calculate`: Python's `ast` on numbers, + - * / // % ** and parentheses
only, with bounded sizes; anything else gives an "error: ..." string. Nothing is eval'ed.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from dataclasses import dataclass

from .chat import ChatTokenizer, extract_answer
from .env import Environment, Reply, check_turn_settings
from .library import draw_reasoning_gym, open_reasoning_gym

DEFAULT_SYSTEM = ("You can use a calculator: write <calc>EXPRESSION</calc> (numbers, + - * / // % ** and parentheses) "
                  "and stop; its result comes back in the next message. When you know the answer, give it inside "
                  "<answer></answer> tags, e.g. <answer>42</answer>, without a <calc> call.")
_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
# Bounds that keep one call cheap whatever the model writes
MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 100  # an integer result (or operand) of more digits is refused
MAX_EXPONENT = 1000
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_PROBE = "titan-rl-tool-probe-5c1e"


class _Refused(Exception):
    pass


def _check_size(value):
    if isinstance(value, int) and value and math.log10(abs(value)) >= MAX_DIGITS:
        raise _Refused(f"the result is too large (more than {MAX_DIGITS} digits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise _Refused("the result is not a finite number")
    return value


def _power(base, exponent):
    if abs(exponent) > MAX_EXPONENT:
        raise _Refused(f"the exponent {exponent} is too large (at most {MAX_EXPONENT})")
    # the result's size before computing it: |base| ** exponent has about exponent * log10|base| digits
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) >= MAX_DIGITS:
        raise _Refused(f"the result is too large (more than {MAX_DIGITS} digits)")
    if isinstance(base, (int, float)) and base < 0 and not float(exponent).is_integer():
        raise _Refused("a negative number to a fractional power is not a real number")
    return base ** exponent


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, complex or str
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        return _check_size(_BINARY[type(node.op)](left, right))
    what = f"{node.value!r} is not a number" if isinstance(node, ast.Constant) else \
        f"{type(node).__name__} is not allowed"
    raise _Refused(f"{what} (numbers, + - * / // % ** and parentheses only)")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text (an int exactly, a float to 12
    significant digits), or "error: <why>" for anything else: names, calls, attributes,
    strings, a division by zero, a result over MAX_DIGITS digits, an exponent over
    MAX_EXPONENT. Parsed by `ast` and walked node by node; never eval'ed."""
    text = expression.strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        return f"error: the expression is longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        value = _evaluate(ast.parse(text, mode="eval"))
    except _Refused as e:
        return f"error: {e}"
    except SyntaxError:
        return "error: not an arithmetic expression"
    except ZeroDivisionError:
        return "error: division by zero"
    except (OverflowError, RecursionError, MemoryError, ValueError):
        return "error: the result is too large"
    return str(value) if isinstance(value, int) else f"{value:.12g}"


@dataclass
class _ToolState:
    entry: dict  # the reasoning-gym item: question, answer, metadata
    last_reply: str = ""


class CalculatorEnvironment(Environment):
    """A reasoning-gym question with a calculator (see the module docstring)."""

    needs_checkpoint = True

    def __init__(self, dataset: str, checkpoint: str, *, max_turns: int = 4, max_new_tokens: int = 64,
                 system: str = DEFAULT_SYSTEM, **dataset_config):
        self.name = f"tool:{dataset}"
        check_turn_settings(self.name, max_turns, max_new_tokens, system)
        self.dataset, self.config = dataset, dict(dataset_config)
        self._scorer = open_reasoning_gym(dataset, self.config, name=self.name, owner=type(self),
                                          own_keys=("max_turns", "max_new_tokens", "system"))
        self.max_turns, self.max_new_tokens, self.system = max_turns, max_new_tokens, system
        self.tokenizer = ChatTokenizer.from_folder(checkpoint)
        if not self.tokenizer.has_chat_template:
            raise ValueError(f"the model folder {checkpoint!r} (model.checkpoint) has no chat template "
                             f"(tokenizer_config.json 'chat_template' or chat_template.jinja), which task "
                             f"{self.name!r} renders its conversation with: use an instruction-tuned model's folder")
        self.tool_role = self._tool_role()

    def _tool_role(self) -> str:
        """"tool" where the chat template writes a tool turn's content, else "user": many
        templates raise on a role they do not know, some drop it silently."""
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "<calc>1+1</calc>"},
                    {"role": "tool", "content": _PROBE}]
        try:
            return "tool" if _PROBE in self.tokenizer.render_text(messages) else "user"
        except Exception:  # jinja's raise_exception, or any template error
            return "user"

    def starts(self, n: int, seed: int) -> list[dict]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        return draw_reasoning_gym(self.dataset, self.config, n, seed)

    def reset(self, start: dict):
        opening = [{"role": "system", "content": self.system}] if self.system else []
        opening.append({"role": "user", "content": start["question"]})
        return _ToolState(start), opening

    def step(self, state: _ToolState, reply: Reply):
        state.last_reply = reply.text
        call = _CALL.search(reply.text)
        if call is None:  # no tool call: this reply is the answer
            return None
        result = calculate(call.group(1))
        if self.tool_role == "tool":
            return [{"role": "tool", "content": result}]
        return [{"role": "user", "content": f"Calculator: {result}"}]

    def answer(self, state: _ToolState) -> str:
        """The answer the last reply gives (a <calc> call's expression is not an answer)."""
        text = _CALL.sub(" ", state.last_reply)
        return extract_answer(text, str(state.entry["answer"]))

    def reward(self, state: _ToolState) -> float:
        answer = self.answer(state)
        if not answer:
            return 0.0
        try:
            return float(self._scorer.score_answer(answer, state.entry))
        except Exception:  # the library's parser on arbitrary model text: unreadable = wrong
            return 0.0


__all__ = ["CalculatorEnvironment", "DEFAULT_SYSTEM", "calculate"]
