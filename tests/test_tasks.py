"""Built-in tasks: tokenizer, sampling determinism, rewards, SFT pairs, loader."""

import pytest

from titan_rl.tasks import (
    BUILTIN_TASKS,
    DIGITS_ALPHABET,
    CharTokenizer,
    DigitAddTask,
    DigitReverseTask,
    Example,
    Task,
    load_task,
)
from titan_rl.tasks import loader as tasks_loader
from titan_rl.tasks.chat import ChatTask

MODEL_VOCAB = 1024  # debug flavor; config.json says bos_token_id 0, eos_token_id 1


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_ids_and_round_trip():
    tok = CharTokenizer("abc")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert tok.vocab_size == 6
    assert tok.encode("cab") == [5, 3, 4]
    assert tok.encode("") == []
    assert tok.decode(tok.encode("abcabc")) == "abcabc"


def test_tokenizer_decode_stops_at_eos_and_skips_bos_pad():
    tok = CharTokenizer("abc")
    assert tok.decode([0, 3, 2, 4, 1, 5, 5]) == "ab"
    assert tok.decode([1, 3]) == ""
    assert tok.decode([]) == ""


def test_tokenizer_out_of_vocab_ids():
    tok = CharTokenizer("abc")
    assert tok.decode([3, 999, 4]) == "a\ufffdb"
    with pytest.raises(ValueError, match="999"):
        tok.decode([3, 999], errors="strict")
    with pytest.raises(ValueError, match="errors"):
        tok.decode([3], errors="ignore")


def test_tokenizer_errors():
    tok = CharTokenizer("abc")
    with pytest.raises(ValueError) as ei:
        tok.encode("abx")
    assert "'x'" in str(ei.value) and "'abc'" in str(ei.value)
    with pytest.raises(ValueError, match="repeats"):
        CharTokenizer("aba")
    with pytest.raises(ValueError, match="non-empty"):
        CharTokenizer("")


@pytest.mark.parametrize("cls", [DigitReverseTask, DigitAddTask])
def test_task_vocab_fits_model_and_specials_match_config(cls):
    task = cls()
    tok = task.tokenizer
    assert tok.vocab_size < MODEL_VOCAB
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.alphabet == DIGITS_ALPHABET


# ---------------------------------------------------------------- sampling


@pytest.mark.parametrize("cls", [DigitReverseTask, DigitAddTask])
def test_sample_deterministic_in_seed(cls):
    task = cls()
    a, b, c = task.sample(50, seed=7), task.sample(50, seed=7), task.sample(50, seed=8)
    assert a == b
    assert a != c
    assert task.sample(10, seed=7) == a[:10]
    assert task.sample(0, seed=7) == []


def test_reverse_examples_well_formed():
    task = DigitReverseTask(min_len=2, max_len=4)
    assert task.name == "digit_reverse"
    assert task.max_new_tokens == 6
    lengths = set()
    for ex in task.sample(300, seed=0):
        assert isinstance(ex, Example)
        digits = ex.prompt_text[len("rev:") : -1]
        assert ex.prompt_text == f"rev:{digits}=" and digits.isdigit()
        assert ex.answer == digits[::-1]
        assert ex.prompt_ids == [0] + task.tokenizer.encode(ex.prompt_text)
        assert len(ex.answer) + 1 <= task.max_new_tokens
        lengths.add(len(digits))
    assert lengths == {2, 3, 4}


def test_add_examples_well_formed():
    task = DigitAddTask()
    assert task.name == "digit_add"
    assert task.max_new_tokens == 5
    for ex in task.sample(300, seed=1):
        a, b = ex.prompt_text[:-1].split("+")
        assert ex.prompt_text.endswith("=")
        assert str(int(a)) == a and str(int(b)) == b  # no leading zeros
        assert 1 <= len(a) <= 3 and 1 <= len(b) <= 3
        assert ex.answer == str(int(a) + int(b))
        assert ex.prompt_ids == [0] + task.tokenizer.encode(ex.prompt_text)
        assert len(ex.answer) + 1 <= task.max_new_tokens
    assert DigitAddTask().make_example(12, 345).answer == "357"


@pytest.mark.parametrize(
    "kwargs", [dict(min_len=0), dict(min_len=5, max_len=4), dict(max_len=2.5), dict(max_len=1000)]
)
def test_bad_constructor_args(kwargs):
    with pytest.raises(ValueError):
        DigitReverseTask(**kwargs)


@pytest.mark.parametrize("n,seed", [(-1, 0), (2, "x"), (1.5, 0)])
def test_bad_sample_args(n, seed):
    with pytest.raises(ValueError):
        DigitReverseTask().sample(n, seed)


# ---------------------------------------------------------------- rewards


def _ids(task, text, eos=True):
    return task.tokenizer.encode(text) + ([task.tokenizer.eos_id] if eos else [])


def test_reverse_rewards_hand_computed():
    task = DigitReverseTask()
    ex = task.make_example("4821")
    assert ex.prompt_text == "rev:4821=" and ex.answer == "1284"
    r = lambda text, eos=True: task.reward(ex, _ids(task, text, eos))  # noqa: E731
    assert r("1284") == 1.0  # exact
    assert r("1294") == 0.5 * 3 / 4  # one wrong digit
    assert r("0000") == 0.0  # same length, all wrong
    assert r("") == 0.0  # empty (just EOS)
    assert task.reward(ex, []) == 0.0  # nothing at all
    assert r("128") == 0.5 * 3 / 4  # too short: over max(4, 3)
    assert r("12845") == 0.5 * 4 / 5  # too long: over max(4, 5)
    assert r("1284", eos=False) == 0.5  # no EOS: truncated, never full credit
    assert r("12", eos=False) == 0.5 * 2 / 4
    # text after EOS is ignored; BOS/PAD are skipped; out-of-vocab ids count as wrong chars
    assert task.reward(ex, _ids(task, "1284") + _ids(task, "99")) == 1.0
    assert task.reward(ex, [0] + _ids(task, "1284")) == 1.0
    assert task.reward(ex, _ids(task, "12")[:1] + [999] + _ids(task, "84")) == 0.5 * 3 / 4


def test_add_rewards_hand_computed():
    task = DigitAddTask()
    ex = task.make_example(12, 345)
    assert task.reward(ex, _ids(task, "357")) == 1.0
    assert task.reward(ex, _ids(task, "358")) == 0.5 * 2 / 3
    assert task.reward(ex, _ids(task, "3570")) == 0.5 * 3 / 4
    assert task.reward(ex, _ids(task, "")) == 0.0
    assert task.reward(ex, _ids(task, "357", eos=False)) == 0.5


@pytest.mark.parametrize("cls", [DigitReverseTask, DigitAddTask])
def test_rewards_in_unit_interval_for_random_completions(cls):
    import random

    task = cls()
    rng = random.Random(0)
    for ex in task.sample(50, seed=3):
        comp = [rng.randrange(MODEL_VOCAB) for _ in range(rng.randrange(task.max_new_tokens + 1))]
        assert 0.0 <= task.reward(ex, comp) <= 1.0


# ---------------------------------------------------------------- SFT pairs


@pytest.mark.parametrize("cls", [DigitReverseTask, DigitAddTask])
def test_sft_pairs(cls):
    task = cls()
    pairs = task.sft_pairs(40, seed=5)
    examples = task.sample(40, seed=5)
    assert len(pairs) == 40
    assert pairs == task.sft_pairs(40, seed=5)
    for (prompt, target), ex in zip(pairs, examples):
        assert prompt == ex.prompt_ids and prompt[0] == task.tokenizer.bos_id
        assert target[-1] == task.tokenizer.eos_id
        assert task.tokenizer.eos_id not in target[:-1]
        assert task.tokenizer.decode(target) == ex.answer
        assert len(target) <= task.max_new_tokens
        assert task.reward(ex, target) == 1.0


# ---------------------------------------------------------------- load_task


def test_load_task_by_short_name_and_path():
    assert set(BUILTIN_TASKS) == {"digit_reverse", "digit_add", "digit_turns"}
    t = load_task("digit_reverse")
    assert isinstance(t, DigitReverseTask) and t.max_new_tokens == 8
    t = load_task("digit_reverse", min_len=2, max_len=3)
    assert (t.min_len, t.max_len, t.max_new_tokens) == (2, 3, 5)
    assert isinstance(load_task("digit_add"), DigitAddTask)
    assert isinstance(load_task("titan_rl.tasks.digits:DigitAddTask", max_len=2), DigitAddTask)
    # the loader module's load_task is the same function and also knows the short names
    assert tasks_loader.load_task is load_task


class _NotATask:
    pass


_TASK_INSTANCE = DigitAddTask(max_len=2)


def test_load_task_instance():
    assert load_task(f"{__name__}:_TASK_INSTANCE") is _TASK_INSTANCE
    with pytest.raises(ValueError, match="no kwargs"):
        load_task(f"{__name__}:_TASK_INSTANCE", max_len=3)


def test_load_task_errors():
    with pytest.raises(ValueError) as ei:
        load_task("no_such_pkg_xyz.mod:Thing")
    assert "no_such_pkg_xyz.mod" in str(ei.value) and "ModuleNotFoundError" in str(ei.value)
    with pytest.raises(ValueError) as ei:
        load_task("titan_rl.tasks.digits:Nope")
    assert "titan_rl.tasks.digits" in str(ei.value) and "'Nope'" in str(ei.value)
    with pytest.raises(ValueError, match="not a subclass"):
        load_task(f"{__name__}:_NotATask")
    with pytest.raises(ValueError, match="not a Task"):
        load_task("titan_rl.tasks.digits:DIGITS_ALPHABET")
    with pytest.raises(ValueError, match="built-in"):
        load_task("digit_multiply")
    with pytest.raises(ValueError, match="cannot construct"):
        load_task("digit_reverse", nope=1)
    with pytest.raises(ValueError, match="min_len"):
        load_task("digit_reverse", min_len=0)
    with pytest.raises(ValueError):
        load_task("")
    with pytest.raises(ValueError):
        load_task("titan_rl.tasks.digits:")


class _NoSample(Task):
    max_new_tokens = 4


class _NoScore(ChatTask):
    def sample(self, n, seed):
        return []


def test_base_task_is_abstract():
    with pytest.raises(TypeError, match="sample"):
        Task()
    with pytest.raises(TypeError, match="sample"):
        _NoSample()
    with pytest.raises(ValueError, match=r"_NoSample' does not implement sample, which its task base class"):
        load_task(f"{__name__}:_NoSample")
    # a chat task's score is its own too; refused before the constructor reads the model folder
    with pytest.raises(ValueError, match=r"_NoScore' does not implement score, which"):
        load_task(f"{__name__}:_NoScore", checkpoint="/nonexistent")
