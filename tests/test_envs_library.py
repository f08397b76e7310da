"""Multi-turn environments from libraries, offline: TextArena's single-player games
("textarena:<EnvId>") and a reasoning-gym question with a calculator tool ("tool:<dataset>"),
on a tiny tokenizer folder with a ChatML template built here."""

import importlib.util
import os
import random
import re
import subprocess
import sys

import pytest

from titan_rl.tasks import Environment, Reply, eval_seed, load_task
from titan_rl.tasks.tool_env import calculate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# templates without a tool turn: one raises on an unknown role (jinja's raise_exception), one drops it
RAISES_ON_TOOL = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                  "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                  "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
DROPS_TOOL = ("{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}"
              "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _tokenizer(chat_template):
    """A byte-level BPE of a few hundred ids with ChatML's special tokens (as tests/test_chat_tasks.py)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_end|>", "<|endoftext|>", "<|im_start|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["<answer>19</answer> <calc>12+7</calc>", "system\nuser\nassistant\ntool\n"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", chat_template=chat_template)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tokenizer-only folders (an environment reads no weights): chat (ChatML), two
    templates without a tool turn, and plain (no template)."""
    root = tmp_path_factory.mktemp("env_folders")
    out = {}
    for name, template in [("chat", CHATML), ("raises", RAISES_ON_TOOL), ("drops", DROPS_TOOL), ("plain", None)]:
        out[name] = str(root / name)
        _tokenizer(template).save_pretrained(out[name])
    return out


def _reply(env, text, turn=0):
    return Reply(tuple(env.tokenizer.encode(text)), text, turn, False)


class _Episode:
    """One episode as the rollout loop runs it: every environment call under the episode's
    own random state, swapped in and out of Python's global one (`uses_global_random`)."""

    def __init__(self, env, start, swap=True):
        self.env, self.swap, self.random = env, swap, random.Random(start).getstate()
        self.state, opening = self._call(env.reset, start)
        self.transcript = [m["content"] for m in opening]
        self.turn, self.done = 0, False

    def _call(self, fn, *args):
        if not self.swap:
            return fn(*args)
        saved = random.getstate()
        random.setstate(self.random)
        try:
            return fn(*args)
        finally:
            self.random = random.getstate()
            random.setstate(saved)

    def step(self, text):
        answer = self._call(self.env.step, self.state, _reply(self.env, text, self.turn))
        self.turn += 1
        self.transcript.append(text)
        if answer is None:
            self.done = True
        else:
            self.transcript += [m["content"] for m in answer]
        return answer

    def reward(self):
        return self._call(self.env.reward, self.state)


# ---------------------------------------------------------------------------- textarena
needs_textarena = pytest.mark.skipif(importlib.util.find_spec("textarena") is None,
                                     reason="textarena is not installed (pip install textarena)")


@needs_textarena
def test_textarena_builds_and_seeds_its_games(folders):
    env = load_task("textarena:GuessTheNumber-v0", checkpoint=folders["chat"])
    assert isinstance(env, Environment) and env.name == "textarena:GuessTheNumber-v0"
    assert env.uses_global_random and env.needs_checkpoint and (env.max_turns, env.max_new_tokens) == (8, 64)
    starts = env.starts(4, seed=3)
    assert starts == env.starts(4, seed=3) and len(set(starts)) == 4  # Environment's integer seeds
    (s1, o1), (s2, o2) = env.reset(starts[0]), env.reset(starts[0])
    assert o1 == o2 and s1.game.game_number == s2.game.game_number  # the same seed, the same game
    assert [m["role"] for m in o1] == ["system", "user"] and "[5]" in o1[1]["content"]
    assert not o1[1]["content"].startswith("[GAME]")  # plain text, not the wrapper's history string
    # the hidden number differs between seeds; FrozenLake shows its seeded board in the opening
    assert len({env.reset(s)[0].game.game_number for s in range(8)}) > 1
    lake = load_task("textarena:FrozenLake-v0", checkpoint=folders["chat"], system="")
    (_, a), (_, b), (_, c) = lake.reset(1), lake.reset(2), lake.reset(1)
    assert a == c and a != b and [m["role"] for m in a] == ["user"]


def _binary_search(episode):
    low, high = 1, 20  # GuessTheNumber-v0's range, as its opening states
    assert "between 1 and 20" in episode.transcript[-1]
    while True:
        guess = (low + high) // 2
        answer = episode.step(f"My guess is [{guess}].")
        if answer is None:
            return guess
        hint = answer[0]["content"]
        assert hint in ("The target number is higher.", "The target number is lower."), hint
        low, high = (guess + 1, high) if "higher" in hint else (low, guess - 1)


@needs_textarena
def test_textarena_win_scores_one_and_a_loss_zero(folders):
    env = load_task("textarena:GuessTheNumber-v0", checkpoint=folders["chat"])
    won = _Episode(env, 12345)
    guess = _binary_search(won)
    assert guess == won.state.game.game_number and won.turn <= 5  # log2(20) guesses
    assert won.state.env.close()[0] == {0: 1}  # textarena: 1 for the win
    assert won.reward() == 1.0
    # a guess, then two replies without a number: the game ends on the second invalid move
    lost = _Episode(env, 12345)
    wrong = 1 if won.state.game.game_number != 1 else 2
    assert "target number is" in lost.step(f"[{wrong}]")[0]["content"]
    assert "invalid move" in lost.step("I do not know")[0]["content"]
    assert lost.step("still no idea") is None
    textarena_reward = lost.state.env.close()[0][0]
    assert 0 < textarena_reward < 1  # textarena's completion fraction: not a win
    assert lost.reward() == 0.0
    cut = _Episode(env, 12345)  # the loop's turn budget ended it: no outcome yet
    cut.step(f"[{wrong}]")
    assert not cut.done and cut.reward() == 0.0


@needs_textarena
def test_textarena_tower_of_hanoi_solved_without_echoes(folders):
    env = load_task("textarena:TowerOfHanoi-v0", checkpoint=folders["chat"])
    episode = _Episode(env, 5)
    moves = ["[A C]", "[A B]", "[C B]", "[A C]", "[B A]", "[B C]", "[A C]"]  # 3 disks, 2**3 - 1 moves
    for move in moves[:-1]:
        answer = episode.step(move)[0]["content"]
        assert answer.startswith("You moved disk") and move not in answer  # the game's echo of the reply dropped
    assert episode.step(moves[-1]) is None and episode.reward() == 1.0


MINES = ["[3 3]", "[0 0]", "[7 7]", "[0 7]", "[7 0]"]


def _play(env, start, replies, episode=None):
    episode = episode or _Episode(env, start)
    for text in replies:
        if episode.done or episode.step(text) is None:
            break
    return episode


@needs_textarena
def test_textarena_interleaved_episodes_match_sequential_ones(folders):
    """Minesweeper draws its mines from the global random at the first move: two episodes
    stepped in turn match the same two run one after the other when each call runs under
    its episode's own random state, and not without."""
    env = load_task("textarena:Minesweeper-v0", checkpoint=folders["chat"])
    sequential = [_play(env, s, MINES) for s in (101, 202)]
    for swap in (True, False):
        random.seed(7)  # whatever the process's own random state is
        a, b = _Episode(env, 101, swap), _Episode(env, 202, swap)
        for text in MINES:
            for episode in (a, b):
                if not episode.done:
                    episode.step(text)
        same = [x.transcript for x in (a, b)] == [x.transcript for x in sequential]
        assert same == swap
        if swap:
            assert [x.reward() for x in (a, b)] == [x.reward() for x in sequential]
    assert sequential[0].transcript != sequential[1].transcript
    assert any("Current Board" in t for t in sequential[0].transcript)


@needs_textarena
@pytest.mark.parametrize("game", ["Wordle-v0", "Hangman-v0"])
def test_textarena_word_games_refused_in_one_line(folders, game):
    with pytest.raises(ValueError) as e:
        load_task(f"textarena:{game}", checkpoint=folders["chat"])
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"textarena:{game}: ")
    assert "nltk word lists" in message and "cannot be downloaded here" in message


@needs_textarena
@pytest.mark.parametrize("game, why, suggested", [
    ("GuessTheNumbr-v0", "textarena has no such game", "GuessTheNumber-v0"),
    ("TicTacToe-v0", "it is not a single-player game", "GuessTheNumber-v0"),
    ("Poker-v0", "it is not a single-player game", "Minesweeper-v0"),
])
def test_textarena_unknown_or_multiplayer_refused(folders, game, why, suggested):
    with pytest.raises(ValueError) as e:
        load_task(f"textarena:{game}", checkpoint=folders["chat"])
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"textarena:{game}: {why}; env_id must name a single-player game")
    assert suggested in message.rpartition("e.g. ")[2].split(", ")


@needs_textarena
def test_textarena_refusals_of_kwargs_and_folders(folders):
    with pytest.raises(ValueError, match=r"^textarena:GuessTheNumber-v0: the game cannot be made .* \{'colour': 3\}: "
                                         r"TypeError: .*unexpected keyword argument 'colour'"):
        load_task("textarena:GuessTheNumber-v0", checkpoint=folders["chat"], colour=3)
    game = load_task("textarena:GuessTheNumber-v0-hardcore", checkpoint=folders["chat"], max_turns=3)
    assert game.max_turns == 3
    with pytest.raises(ValueError, match="max_turns = 0: it must be an int >= 1"):
        load_task("textarena:GuessTheNumber-v0", checkpoint=folders["chat"], max_turns=0)
    with pytest.raises(ValueError, match="has no chat template"):
        load_task("textarena:GuessTheNumber-v0", checkpoint=folders["plain"])


@needs_textarena
def test_textarena_import_and_refusals_print_nothing():
    """nltk's failed downloads print to the stderr it bound at import: nothing may reach fd 2."""
    code = ("from titan_rl.tasks import load_task\n"
            "import titan_rl.tasks.textarena_env as m\n"
            "assert 'GuessTheNumber-v0' in m.single_player_games()\n"
            "for game in ('Wordle-v0', 'Hangman-v0', 'Codenames-v0'):\n"
            "    try:\n"
            "        load_task('textarena:' + game, checkpoint='unused')\n"
            "    except ValueError as e:\n"
            "        assert 'nltk' in str(e), e\n"
            "print('done')\n")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout == b"done\n", out
    assert out.stderr == b"", out.stderr.decode()


# ---------------------------------------------------------------------------- the calculator tool
@pytest.mark.parametrize("expression, result", [
    ("2+3*4", "14"), (" (2 + 3) * 4 ", "20"), ("7/2", "3.5"), ("8/4", "2"), ("7//2", "3"), ("-7 % 3", "2"),
    ("2**-2", "0.25"), ("-(-1587 / 23)", "69"), ("1/3", "0.333333333333"),
])
def test_calculate(expression, result):
    assert calculate(expression) == result


@pytest.mark.parametrize("expression, error", [
    ("__import__('os')", "Call is not allowed"), ("os.system", "Attribute is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("'a' * 3", "'a' is not a number"), ("True + 1", "True is not a number"), ("[1, 2]", "List is not allowed"),
    ("10**10**10", "exponent 10000000000 is too large"), ("9**999", "too large"), ("1" * 101, "too large"),
    ("1e308 * 10", "not a finite number"), ("1/0", "division by zero"), ("(-8) ** 0.5", "not a real number"),
    ("2 +", "not an arithmetic expression"), ("1+" * 120 + "1", "longer than 200 characters"),
])
def test_calculate_refuses(expression, error):
    result = calculate(expression)
    assert result.startswith("error: ") and error in result, result


def test_tool_episode_scored_by_the_dataset(folders):
    env = load_task("tool:basic_arithmetic", checkpoint=folders["chat"])
    assert env.name == "tool:basic_arithmetic" and env.tool_role == "tool"
    assert (env.max_turns, env.max_new_tokens) == (4, 64)
    # the questions ReasoningGymTask draws, by the same seeds (held-out ones too)
    task = load_task("reasoning_gym:basic_arithmetic", checkpoint=folders["chat"])
    for seed in (7, eval_seed(0)):
        assert env.starts(3, seed) == [e.meta for e in task.sample(3, seed)]
    assert env.starts(2, 7) == env.starts(3, 7)[:2] and env.starts(2, 7) != env.starts(2, eval_seed(0))
    entry = env.starts(1, 7)[0]
    state, opening = env.reset(entry)
    assert opening[0]["role"] == "system" and "<calc>" in opening[0]["content"] and "<answer>" in opening[0]["content"]
    assert opening[1] == {"role": "user", "content": entry["question"]}
    assert env.step(state, _reply(env, "Let me add. <calc>12+7</calc>")) == [{"role": "tool", "content": "19"}]
    assert env.step(state, _reply(env, f"<answer>{entry['answer']}</answer>", 1)) is None
    assert env.reward(state) == 1.0
    state, _ = env.reset(entry)
    env.step(state, _reply(env, "<calc>12+7</calc>"))
    assert env.step(state, _reply(env, "<answer>19</answer>", 1)) is None
    assert env.reward(state) == float(env._scorer.score_answer("19", entry)) == (entry["answer"] == "19")
    # the turn budget ran out on a tool call: the call's expression is not an answer
    state, _ = env.reset(entry)
    assert env.step(state, _reply(env, f"<calc>{entry['answer']}</calc>")) is not None
    assert env.reward(state) == 0.0
    state, _ = env.reset(entry)  # a reply without a call and without tags: its last number
    assert env.step(state, _reply(env, f"It is {entry['answer']}")) is None and env.reward(state) == 1.0


@pytest.mark.parametrize("folder", ["raises", "drops"])
def test_tool_role_falls_back_to_user(folders, folder):
    env = load_task("tool:basic_arithmetic", checkpoint=folders[folder])
    assert env.tool_role == "user"
    state, _ = env.reset(env.starts(1, 0)[0])
    assert env.step(state, _reply(env, "<calc>12+7</calc>")) == [{"role": "user", "content": "Calculator: 19"}]


def test_tool_refusals(folders):
    with pytest.raises(ValueError, match=r"no dataset 'basic_arithmetik'; close names: basic_arithmetic"):
        load_task("tool:basic_arithmetik", checkpoint=folders["chat"])
    with pytest.raises(ValueError, match=r"^tool:basic_arithmetic: task.kwargs may not set seed = 3: .*CalculatorEnv"):
        load_task("tool:basic_arithmetic", checkpoint=folders["chat"], seed=3)
    with pytest.raises(ValueError, match=r"^tool:basic_arithmetic: task.kwargs may not set size = 9"):
        load_task("tool:basic_arithmetic", checkpoint=folders["chat"], size=9)
    with pytest.raises(ValueError, match=r"refuses task.kwargs \{'min_terms': 0\}.*this task's own: max_turns"):
        load_task("tool:basic_arithmetic", checkpoint=folders["chat"], min_terms=0)
    with pytest.raises(ValueError, match="has no chat template"):
        load_task("tool:basic_arithmetic", checkpoint=folders["plain"])
    with pytest.raises(ValueError, match=re.escape("max_new_tokens = 0: it must be an int >= 1")):
        load_task("tool:basic_arithmetic", checkpoint=folders["chat"], max_new_tokens=0)
