"""Tasks from libraries and data files, on the checkpoint's tokenizer and chat template.

    task.name = "reasoning_gym:<dataset>"   any of reasoning-gym's procedural datasets
    task.name = "jsonl:<path>"              rows of a JSON-lines file ("parquet:<path>": a parquet file)

Both are `ChatTask`s (titan_rl.tasks.chat): the answer is read from the completion by
`extract_answer` (the last <answer>...</answer>, else the last number when the reference
is a number, else the last line). docs/tasks.md has the details.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import threading
from pathlib import Path

from .base import Example, is_held_out
from .chat import ChatTask

# reasoning-gym seeds item i of a dataset of seed s from s + i: sample(n, seed) uses the
# dataset seed seed * ITEM_STRIDE, so two task seeds never share an item's generator seed
# while n <= ITEM_STRIDE.
ITEM_STRIDE = 2**20
# Asks for the format extract_answer reads first, and the SFT target writes.
ANSWER_FORMAT = "Give your final answer inside <answer></answer> tags, e.g. <answer>42</answer>."


class ReasoningGymTask(ChatTask):
    """A reasoning-gym dataset (`reasoning_gym.create_dataset(dataset, size=, seed=, **config)`).

    task.kwargs: `chat`, `system` (default: ANSWER_FORMAT), `max_new_tokens` are this class's;
    every other key goes to the dataset's config (e.g. chain_sum's min_terms, max_digits).
    `seed` and `size` are the task's to choose: sample(n, seed) draws items 0..n-1 of the
    dataset of seed `seed * 2**20` (so sample(n, s) is a prefix of sample(m, s), and training
    and held-out seeds (titan_rl.tasks.HELD_OUT_SEEDS) never share a generator seed).

    Reward: the dataset's own `score_answer(answer, entry)`, with `answer` read from the
    completion by `extract_answer` (the last `<answer>...</answer>`; else, for a numeric
    reference, the last number; else the last non-empty line). An answer the scorer
    cannot read (it raises) scores 0.
    """

    def __init__(self, dataset: str, checkpoint: str, *, chat: bool = True, system: str = ANSWER_FORMAT,
                 max_new_tokens: int = 256, **config):
        self.name = f"reasoning_gym:{dataset}"
        self.dataset, self.config = dataset, dict(config)
        # scores with the run's config (a scorer may read it, e.g. a tolerance)
        self._scorer = open_reasoning_gym(dataset, self.config, name=self.name, owner=type(self),
                                          own_keys=("chat", "system", "max_new_tokens"))
        super().__init__(checkpoint, chat=chat, system=system, max_new_tokens=max_new_tokens)

    def sample(self, n: int, seed: int) -> list[Example]:
        self._check_n(n)
        self._rng(seed)  # the seed's type check
        return [self.make_example(entry["question"], str(entry["answer"]), meta=entry)
                for entry in draw_reasoning_gym(self.dataset, self.config, n, seed)]

    def score(self, answer: str, example: Example) -> float:
        try:
            return float(self._scorer.score_answer(answer, example.meta))
        except Exception:  # the library's parser on arbitrary model text: unreadable = wrong
            return 0.0


def open_reasoning_gym(dataset: str, config: dict, *, name: str, owner: type, own_keys: tuple[str, ...]):
    """The dataset's scorer (a one-item dataset built with `config`), after the checks every
    reasoning-gym task makes: a known dataset (else close names), no `seed` or `size` in
    `config` (the task draws by its own seeds), a config the dataset accepts. `name` and
    `owner` word the refusals; `own_keys` are the owner's own task.kwargs, listed beside
    the dataset's config keys."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if dataset not in DATASETS:
        close = difflib.get_close_matches(dataset, list(DATASETS), n=5, cutoff=0.5)
        hint = f"; close names: {', '.join(close)}" if close else f"; there are {len(DATASETS)}, e.g. " + \
            ", ".join(sorted(DATASETS)[:8])
        raise ValueError(f"reasoning-gym has no dataset {dataset!r}{hint}")
    for key in ("seed", "size"):
        if key in config:
            raise ValueError(f"{name}: task.kwargs may not set {key} = {config[key]!r}: the task draws questions "
                             f"by its own seeds ({owner.__module__}.{owner.__qualname__})")
    try:
        return reasoning_gym.create_dataset(dataset, size=1, seed=0, **config)
    except (TypeError, ValueError, AssertionError) as e:
        fields = [f for f in getattr(DATASETS[dataset][1], "__dataclass_fields__", {}) if f not in ("seed", "size")]
        raise ValueError(f"{name}: its config refuses task.kwargs {config!r}: {type(e).__name__}: "
                         f"{e or 'invalid value'} (its config keys: {', '.join(fields)}; this task's own: "
                         f"{', '.join(own_keys)})") from None


def draw_reasoning_gym(dataset: str, config: dict, n: int, seed: int) -> list[dict]:
    """Items 0..n-1 of the dataset of seed `seed * ITEM_STRIDE`: a pure function of (n,
    seed), a prefix of a longer draw, training and held-out seeds never sharing a generator
    seed (ReasoningGymTask.sample and the environments on reasoning-gym draw this way)."""
    import reasoning_gym

    if n == 0:
        return []
    return list(reasoning_gym.create_dataset(dataset, size=n, seed=seed * ITEM_STRIDE, **config))


def math_equal(reference: str, answer: str) -> bool:
    """Whether `answer` states `reference`: math-verify's equivalence (e.g. "0.5" and
    "\\frac{1}{2}") when both parse as mathematics, else equal strings after trimming and
    collapsing whitespace. Without math-verify installed, only the string comparison."""
    reference, answer = str(reference), str(answer)
    if " ".join(reference.split()) == " ".join(answer.split()):
        return True
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    # math-verify's timeouts use signal.alarm, which only the main thread may set
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold, pred = parse(reference, parsing_timeout=timeout), parse(answer, parsing_timeout=timeout)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout))


class JsonlTask(ChatTask):
    """Rows of a data file: each a prompt (a string under `prompt_key`) or chat messages (a
    list of {role, content} under `messages_key`), and a reference answer (`answer_key`).

    task.kwargs: prompt_key ("prompt"), messages_key ("messages"), answer_key ("answer"),
    eval_fraction (0.1), chat, system (""), max_new_tokens (256).

    Held-out rows: the distinct prompts are ordered by the sha256 of their text and the
    first max(1, round(eval_fraction x their number)) are held out (eval_fraction > 0), so
    the split depends on the rows alone, and a repeated row never sits in both. Training
    seeds draw from the other rows, held-out seeds (titan_rl.tasks.HELD_OUT_SEEDS and up)
    from these: sample(n, seed) walks seeded shuffles of its split, one after another.

    Reward: 1 if `math_equal(reference, answer)` (math-verify's equivalence, else exact
    string match), else 0, with `answer` read by `extract_answer`.
    """

    file_format = "jsonl"

    def __init__(self, path: str, checkpoint: str, *, prompt_key: str = "prompt", messages_key: str = "messages",
                 answer_key: str = "answer", eval_fraction: float = 0.1, chat: bool = True, system: str = "",
                 max_new_tokens: int = 256):
        self.name = f"{self.file_format}:{path}"
        if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) \
                or not 0 <= eval_fraction < 1:
            raise ValueError(f"{self.name}: eval_fraction must be a number in [0, 1), got {eval_fraction!r}")
        super().__init__(checkpoint, chat=chat, system=system, max_new_tokens=max_new_tokens)
        rows = []
        for where, row in self._read(Path(path)):
            if not isinstance(row, dict):
                raise ValueError(f"{self.name}: {where} is not an object: {row!r:.120}")
            question = row.get(messages_key, row.get(prompt_key))
            ok = isinstance(question, str) and question or isinstance(question, list) and question and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in question)
            if not ok:
                raise ValueError(f"{self.name}: {where} needs a non-empty string {prompt_key!r} or a list of "
                                 f"{{role, content}} messages {messages_key!r}; it has keys {sorted(row)}")
            if isinstance(question, list) and not chat:
                raise ValueError(f"{self.name}: {where} has messages; chat = false needs {prompt_key!r} strings")
            answer = row.get(answer_key)
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or str(answer).strip() == "":
                raise ValueError(f"{self.name}: {where} needs a reference answer {answer_key!r} (a string or a "
                                 f"number), got {answer!r}")
            rows.append((question, str(answer)))
        if not rows:
            raise ValueError(f"{self.name}: the file has no rows")
        self.train_rows, self.held_out_rows = _split(rows, eval_fraction)
        if not self.train_rows:
            raise ValueError(f"{self.name}: eval_fraction = {eval_fraction} holds out all {len(rows)} rows; "
                             f"lower it or add rows")

    def _read(self, path: Path):
        """(where, row) of each row of a JSON-lines file."""
        if not path.is_file():
            raise ValueError(f"{self.name}: no such file {str(path)!r}")
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield f"line {number}", json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{self.name}: line {number} is not JSON: {e}") from None

    def sample(self, n: int, seed: int) -> list[Example]:
        self._check_n(n)
        rng = self._rng(seed)
        pool = self.held_out_rows if is_held_out(seed) else self.train_rows
        if not pool and n:
            raise ValueError(f"{self.name}: no held-out rows to evaluate on (eval_fraction = 0): set task.kwargs "
                             f"eval_fraction > 0")
        order: list[int] = []
        while len(order) < n:  # one seeded shuffle after another: a prefix of a longer draw
            epoch = list(range(len(pool)))
            rng.shuffle(epoch)
            order += epoch
        return [self.make_example(*pool[i]) for i in order[:n]]

    def score(self, answer: str, example: Example) -> float:
        return 1.0 if answer and math_equal(example.answer, answer) else 0.0


class ParquetTask(JsonlTask):
    """JsonlTask over a parquet file (read with pandas and pyarrow)."""

    file_format = "parquet"

    def _read(self, path: Path):
        try:
            import pandas
            import pyarrow  # noqa: F401  (pandas' parquet engine)
        except ImportError:
            raise ValueError(f"{self.name}: reading parquet needs pandas and pyarrow (pip install pandas pyarrow); "
                             f"or write the rows as JSON lines and use 'jsonl:<path>'") from None
        if not path.is_file():
            raise ValueError(f"{self.name}: no such file {str(path)!r}")
        frame = pandas.read_parquet(path)
        for number, row in enumerate(frame.to_dict(orient="records"), 1):
            yield f"row {number}", {k: _plain(v) for k, v in row.items()}


def _plain(value):
    """A parquet cell as JSON would hold it (numpy arrays and scalars to lists and numbers)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _split(rows: list[tuple], fraction: float) -> tuple[list[tuple], list[tuple]]:
    """(training rows, held-out rows): the distinct questions ordered by the sha256 of their
    text; the first max(1, round(fraction x count)) held out (none when fraction is 0)."""
    def key(question) -> str:
        return hashlib.sha256(json.dumps(question, sort_keys=True).encode()).hexdigest()

    distinct = sorted({key(q) for q, _ in rows})
    held = set(distinct[:max(1, round(fraction * len(distinct)))]) if fraction > 0 else set()
    return [r for r in rows if key(r[0]) not in held], [r for r in rows if key(r[0]) in held]


__all__ = ["ANSWER_FORMAT", "ITEM_STRIDE", "JsonlTask", "ParquetTask", "ReasoningGymTask", "draw_reasoning_gym",
           "math_equal", "open_reasoning_gym"]
