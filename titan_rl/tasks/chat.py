"""Tasks on the model's own tokenizer and chat template (those of the checkpoint folder).

`ChatTokenizer` adapts a transformers tokenizer loaded from a model folder to what the
trainer reads of a task's tokenizer (vocab_size, eos_id, pad_id, encode, decode) and adds
`stop_ids` (EOS and the end-of-turn token the chat template closes a reply with, e.g.
ChatML's `<|im_end|>`: generation stops on either) and `render(messages)`.

`ChatTask` is the base of tasks whose prompts are chat messages rendered with that
template (or raw text, `chat = False`) and whose reward reads the answer out of the
completion's text by one documented rule (`extract_answer`).
"""

from __future__ import annotations

import abc
import functools
import json
import re
from pathlib import Path

from .base import REPLACEMENT_CHAR, Example, Task

# Any of these in a folder means transformers has a tokenizer to load there.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Text no template alters: the probe finds what a template writes after a reply's content.
_PROBE = "titan-rl-probe-7f3a"
# A number as a reference answer or a completion writes it: sign, digits, decimals, a fraction.
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:/\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ChatTokenizer:
    """A model folder's tokenizer as the trainer uses a task's tokenizer.

    vocab_size is len(tokenizer) (base vocabulary plus added tokens: the largest id + 1 it
    can produce, which must not exceed the model's vocab_size); pad_id is the pad token,
    or EOS where there is none (padding is masked out, any id in range does).
    """

    def __init__(self, hf_tokenizer, folder: str):
        self.hf = hf_tokenizer
        self.folder = folder
        self.vocab_size = len(hf_tokenizer)
        self.eos_id = hf_tokenizer.eos_token_id
        self.bos_id = hf_tokenizer.bos_token_id
        self.has_chat_template = bool(getattr(hf_tokenizer, "chat_template", None))
        eot = self._end_of_turn() if self.has_chat_template else None
        if self.eos_id is None and eot is None:
            raise ValueError(f"the tokenizer in {folder!r} has no EOS token and no chat template that ends a reply "
                             f"with a special token: generation would never stop")
        # the id a supervised target ends with: what the template closes a reply with
        self.end_of_turn_id = eot if eot is not None else self.eos_id
        pad = hf_tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_id if self.eos_id is not None else eot
        stops = [self.eos_id, eot, *_generation_eos_ids(folder)]
        self.stop_ids = list(dict.fromkeys(i for i in stops if i is not None))

    @classmethod
    def from_folder(cls, folder: str) -> ChatTokenizer:
        """The tokenizer of model folder `folder` (loaded once per folder and process)."""
        return _load(str(Path(folder).resolve()))

    def _end_of_turn(self) -> int | None:
        """The first special token the template writes after an assistant reply's content
        (ChatML: <|im_end|>, Llama 3: <|eot_id|>), found by rendering a reply."""
        try:
            text = self.hf.apply_chat_template(
                [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}], tokenize=False)
        except Exception:  # a template that refuses this conversation (e.g. needs a system turn)
            return None
        at = text.rfind(_PROBE)
        if at < 0:
            return None
        special = {i for i, t in self.hf.added_tokens_decoder.items() if t.special}
        special.update(i for i in self.hf.all_special_ids if i is not None)
        tail = self.hf.encode(text[at + len(_PROBE):], add_special_tokens=False)
        return next((i for i in tail if i in special), None)

    def encode(self, text: str) -> list[int]:
        """Text to ids, no special tokens added."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        """A raw-text prompt: the tokenizer's own special tokens added (a BOS where the model
        expects one)."""
        return list(self.hf(text)["input_ids"])

    def render(self, messages: list[dict]) -> list[int]:
        """Chat messages to the prompt ids the template writes, ending where the assistant's
        reply starts."""
        out = self.hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        return list(out["input_ids"])

    def render_text(self, messages: list[dict]) -> str:
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def decode(self, ids, errors: str = "replace") -> str:
        """Ids to text up to the first stop id, special tokens skipped. Ids outside the
        tokenizer (a model's vocab is often larger) become U+FFFD, or raise ValueError with
        errors="strict"."""
        if errors not in ("replace", "strict"):
            raise ValueError(f"ChatTokenizer.decode: errors must be 'replace' or 'strict', got {errors!r}")
        stops, pieces, run = set(self.stop_ids), [], []
        for i in map(int, ids):
            if i in stops:
                break
            if 0 <= i < self.vocab_size:
                run.append(i)
                continue
            if errors == "strict":
                raise ValueError(f"ChatTokenizer.decode: id {i} is outside the tokenizer (size {self.vocab_size})")
            pieces += [self.hf.decode(run, skip_special_tokens=True), REPLACEMENT_CHAR]
            run = []
        pieces.append(self.hf.decode(run, skip_special_tokens=True))
        return "".join(pieces)

    def __repr__(self) -> str:
        return (f"ChatTokenizer({self.folder!r}, vocab_size={self.vocab_size}, stop_ids={self.stop_ids}, "
                f"chat_template={self.has_chat_template})")


def _generation_eos_ids(folder: str) -> list[int]:
    """The ids generation_config.json says end generation (an int or a list), if the folder
    has one: models list their end-of-turn tokens there."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return []
    try:
        ids = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return []
    ids = ids if isinstance(ids, list) else [ids]
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]


@functools.lru_cache(maxsize=8)
def _load(folder: str) -> ChatTokenizer:
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(f"the model folder {folder!r} (model.checkpoint) is not a folder")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"the model folder {folder!r} (model.checkpoint) has no tokenizer files (one of "
                         f"{', '.join(TOKENIZER_FILES)}): a chat or library task reads the model's tokenizer from it; "
                         f"save the tokenizer there (tokenizer.save_pretrained(folder))")
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # transformers' own errors name the file it could not read
        raise ValueError(f"the model folder {folder!r} (model.checkpoint): transformers cannot load its tokenizer: "
                         f"{type(e).__name__}: {e}") from None
    return ChatTokenizer(hf, folder)


def extract_answer(text: str, reference: str = "") -> str:
    """The answer a completion gives, by one rule (docs/tasks.md):

    1. the content of the last `<answer>...</answer>` pair, stripped, if there is one;
    2. else, when the reference answer is a number (e.g. "-12", "3.5", "1/2"), the last
       number in the text ("" if it has none);
    3. else the last non-empty line, stripped.
    """
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1].strip()
    if _NUMBER.fullmatch(str(reference).strip()):
        numbers = _NUMBER.findall(text)
        return numbers[-1] if numbers else ""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


class ChatTask(Task):
    """A task stated in chat messages, rendered with the checkpoint's chat template.

    chat = True: each prompt is [system (if `system` is not empty), user: the question],
    rendered by the template with the assistant's turn opened; a row may also bring its own
    messages. chat = False: the question is raw text (`system`, if any, and a blank line
    before it), encoded with the tokenizer's own special tokens; no template needed.
    The reward decodes the completion up to its first stop id and scores
    `extract_answer(text, reference)` with `score`. The supervised target of an example is
    `target_text` (by default `<answer>{answer}</answer>`) followed by the end-of-turn id
    (EOS when chat = False), so a warm-up teaches the model to close its turn.
    Subclasses implement `sample` (with `make_example`) and `score`.
    """

    needs_checkpoint = True

    def __init__(self, checkpoint: str, *, chat: bool = True, system: str = "", max_new_tokens: int = 256):
        cls = type(self).__name__
        if not isinstance(chat, bool):
            raise ValueError(f"{cls}: chat must be true or false, got {chat!r}")
        if not isinstance(system, str):
            raise ValueError(f"{cls}: system must be a string (\"\" for none), got {system!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"{cls}: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        self.tokenizer = ChatTokenizer.from_folder(checkpoint)
        if chat and not self.tokenizer.has_chat_template:
            raise ValueError(f"the model folder {checkpoint!r} (model.checkpoint) has no chat template "
                             f"(tokenizer_config.json 'chat_template' or chat_template.jinja), which task "
                             f"{self.name!r} renders its prompts with: use an instruction-tuned model's folder, or set "
                             f"chat = false in task.kwargs for raw-text prompts")
        self.chat, self.system, self.max_new_tokens = chat, system, max_new_tokens
        self.end_id = self.tokenizer.end_of_turn_id if chat else self.tokenizer.eos_id

    def make_example(self, question: str | list[dict], answer: str, meta=None) -> Example:
        """An example from a question (a string, or a list of chat messages)."""
        if isinstance(question, list):
            if not self.chat:
                raise ValueError(f"task {self.name!r}: a question given as chat messages needs chat = true")
            return Example(self.tokenizer.render(question), answer, self.tokenizer.render_text(question), meta)
        if self.chat:
            messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
                {"role": "user", "content": question}]
            return Example(self.tokenizer.render(messages), answer, question, meta)
        text = f"{self.system}\n\n{question}" if self.system else question
        return Example(self.tokenizer.encode_prompt(text), answer, text, meta)

    @abc.abstractmethod
    def score(self, answer: str, example: Example) -> float:
        """The reward in [0, 1] of the extracted `answer` to `example`."""

    def reward(self, example: Example, completion_ids: list[int]) -> float:
        text = self.tokenizer.decode(completion_ids)
        return float(self.score(extract_answer(text, example.answer), example))

    def target_text(self, example: Example) -> str:
        return f"<answer>{example.answer}</answer>"

    def target_ids(self, example: Example) -> list[int]:
        return self.tokenizer.encode(self.target_text(example)) + [self.end_id]
