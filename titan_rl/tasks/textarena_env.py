"""TextArena's single-player games as multi-turn environments: task.name = "textarena:<EnvId>".

    task.name = "textarena:GuessTheNumber-v0"      task.kwargs: max_turns, max_new_tokens, system,
                                                   and any of the game's own constructor keys
                                                   (game = {...} for those named as ours: max_turns)

An episode is one game, seeded by its start (an int, `Environment.starts`): the opening is
[system (if not empty), user: the game's first observation], each reply is the player's
action (textarena's action wrappers apply, e.g. "[5]" brackets added where missing) and the
game answers with what it observed since the last turn (its messages, without the echo of
the reply), until it is over or the loop's `max_turns` replies are spent.

Reward: 1.0 for a win, else 0.0. textarena 0.7.4's single-player games end with
`rewards = {0: r}`: r = 1 for a win (`set_outcome(reward=1)`), otherwise a fraction of
completion in [0, 1) (turn limit, a hole, a mine, the second invalid move) or -1; a game
the loop cut short has no rewards yet. Only the win counts, so a reward means the same
thing in every game.

Measured with textarena 0.7.4, offline (no nltk data): GuessTheNumber-v0, FrozenLake-v0,
Mastermind-v0, Minesweeper-v0 and TowerOfHanoi-v0 all make, reset and step, as do the other
single-player games without word lists (2048, Bandit, Blackjack, Countdown, Crosswords,
Cryptarithm, FifteenPuzzle, LightsOut, LogicPuzzle, PegJump, RushHour, Secretary, Set,
Slitherlink, Sokoban, Sudoku, ThreeCardMonte and their variants; a few print to stdout while
they play). Wordle and Hangman (and every game that calls `nltk.download` while it is made or
reset) need nltk word lists that cannot be downloaded here: they are refused at construction,
as are GuessWho and TwentyQuestions (they need an OpenRouter key) and two-player and
multi-player games (the policy would need an opponent).

`max_turns` is the loop's budget of replies; a game keeps its own turn limit (e.g.
GuessTheNumber-v0: 10 guesses), whichever comes first ends the episode.

textarena seeds Python's global `random` at reset (`random.seed(seed)` in its State) and
draws from it during play (e.g. Minesweeper places its mines at the first move), hence
`uses_global_random`: the rollout loop runs each call under the episode's own random state.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import io
import random
import sys
from dataclasses import dataclass

from .chat import ChatTokenizer
from .env import Environment, Reply, check_turn_settings

DEFAULT_SYSTEM = ("You are playing a text game. Each turn, reply with one move in exactly the format the game "
                  "asks for (usually in square brackets, e.g. [5]).")


class _NltkDownloadCalled(Exception):
    pass


@contextlib.contextmanager
def _quiet_nltk(calls: list | None = None):
    """No console output and no download attempt while textarena is imported or a game made:
    some game modules call `nltk.download` at import or in their constructor, which prints
    its failure straight to the stderr it bound at import (a redirect would not catch it),
    or could wait on the network. `nltk.download` becomes a no-op returning False (what it
    returns when a download fails); each call's arguments are appended to `calls`."""
    def no_download(*args, **kwargs):
        if calls is not None:
            calls.append(args or tuple(kwargs.values()))
        return False

    sink = io.StringIO()
    patched = []
    try:
        import nltk
        import nltk.downloader

        for owner in (nltk, nltk.downloader):
            patched.append((owner, owner.download))
            owner.download = no_download
    except ImportError:  # textarena without nltk: nothing to silence
        pass
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        for owner, original in patched:
            owner.download = original


def _names(calls: list) -> str:
    """The resources named by recorded nltk.download calls (an id, or a list of ids)."""
    names = []
    for args in calls:
        for arg in args[:1]:
            names += arg if isinstance(arg, (list, tuple)) else [arg]
    return ", ".join(dict.fromkeys(map(str, names)))


def _textarena():
    """textarena, imported quietly the first time (later calls, e.g. from the loop's worker
    threads, neither patch nltk nor redirect the console)."""
    module = sys.modules.get("textarena")
    if module is None:
        try:
            with _quiet_nltk():
                import textarena as module
        except ImportError as e:
            raise ValueError(f"textarena environments need the textarena package (pip install textarena; 0.7.4 is "
                             f"the version measured): {e}") from None
    return module


def _innermost(env):
    """The game under textarena's wrappers: its observations are new messages only, where
    the default LLMObservationWrapper would repeat the whole history every turn."""
    wrapper = _textarena().Wrapper
    while isinstance(env, wrapper):
        env = env.env
    return env


def _observation_text(observation) -> str:
    """A player's observation as plain text. textarena 0.7.4 gives (sender id, message,
    ObservationType) tuples; its older versions (and observation wrappers) a string. The
    echo of the player's action (a PLAYER_ACTION message, whichever sender a game gives it:
    TowerOfHanoi sends it as the game) is dropped: the reply is already in the conversation."""
    if isinstance(observation, str):
        return observation.strip()
    parts = []
    for item in observation or ():
        kind = getattr(item[2], "name", "") if len(item) > 2 else ""
        if kind != "PLAYER_ACTION":
            parts.append(str(item[1]).strip())
    return "\n\n".join(p for p in parts if p)


@functools.lru_cache(maxsize=1)
def single_player_games() -> tuple[str, ...]:
    """Registered ids whose game module uses textarena's SinglePlayerState and no nltk word
    list, read from the modules' source without importing them (importing some downloads):
    the suggestions of a refusal. Whether a game really runs is what the constructor checks."""
    ta = _textarena()
    registry = ta.envs.registration.ENV_REGISTRY
    by_module: dict[str, bool] = {}
    out = []
    for env_id, spec in registry.items():
        entry = spec.entry_point
        if not isinstance(entry, str):
            continue
        module = entry.partition(":")[0]
        if module not in by_module:
            try:
                origin = importlib.util.find_spec(module).origin
                with open(origin, encoding="utf-8") as f:
                    source = f.read()
            except Exception:
                source = ""
            by_module[module] = "SinglePlayerState" in source and "nltk" not in source and \
                "EnglishDictionary" not in source
        if by_module[module]:
            out.append(env_id)
    return tuple(out)


# what a refusal suggests when no registered id is close to the one asked for
_KNOWN_GOOD = ("GuessTheNumber-v0", "FrozenLake-v0", "Mastermind-v0", "Minesweeper-v0", "TowerOfHanoi-v0")


def _refuse_id(env_id: str, why: str) -> ValueError:
    # the "-raw" and "-train" variants are the same games with other wrappers: suggest the base ids
    games = [g for g in single_player_games() if not g.endswith(("-raw", "-train"))]
    suggest = difflib.get_close_matches(env_id, games, n=4, cutoff=0.6)
    suggest += [g for g in _KNOWN_GOOD if g in games and g not in suggest][:5 - len(suggest)]
    return ValueError(f"textarena:{env_id}: {why}; env_id must name a single-player game, e.g. {', '.join(suggest)}")


@dataclass
class _GameState:
    env: object  # the game with its wrappers: actions go through them
    game: object  # the game itself: observations are read from it
    done: bool = False


class TextArenaEnvironment(Environment):
    """One single-player TextArena game per episode (see the module docstring)."""

    needs_checkpoint = True
    uses_global_random = True

    def __init__(self, env_id: str, checkpoint: str, *, max_turns: int = 8, max_new_tokens: int = 64,
                 system: str = DEFAULT_SYSTEM, game: dict | None = None, **env_kwargs):
        self.name = f"textarena:{env_id}"
        if game is not None and not isinstance(game, dict):
            raise ValueError(f"{self.name}: game = {game!r}: it must be a table of the game's own constructor keys")
        # `game`: the game's keys that share a name with this environment's (GuessTheNumber's max_turns)
        env_kwargs = {**env_kwargs, **(game or {})}
        check_turn_settings(self.name, max_turns, max_new_tokens, system)
        self.env_id, self.env_kwargs = env_id, dict(env_kwargs)
        self.max_turns, self.max_new_tokens, self.system = max_turns, max_new_tokens, system
        ta = _textarena()
        if env_id not in ta.envs.registration.ENV_REGISTRY:
            raise _refuse_id(env_id, "textarena has no such game")
        self._probe()
        self.tokenizer = ChatTokenizer.from_folder(checkpoint)
        if not self.tokenizer.has_chat_template:
            raise ValueError(f"the model folder {checkpoint!r} (model.checkpoint) has no chat template "
                             f"(tokenizer_config.json 'chat_template' or chat_template.jinja), which task "
                             f"{self.name!r} renders its conversation with: use an instruction-tuned model's folder")

    def _probe(self) -> None:
        """Make and reset the game once, quietly, so a game that cannot run here is refused
        now rather than at the first rollout: one that reaches for nltk's word lists (it calls
        nltk.download, or nltk raises LookupError), one that is not single-player, one whose
        constructor refuses env_kwargs. The caller's random state is kept: reset seeds it."""
        ta = _textarena()
        downloads: list = []
        saved = random.getstate()
        try:
            with _quiet_nltk(downloads):
                env = ta.make(self.env_id, **self.env_kwargs)
                env.reset(num_players=1, seed=0)
                if downloads:
                    raise _NltkDownloadCalled
        except (LookupError, _NltkDownloadCalled):
            raise ValueError(f"{self.name}: this game needs nltk word lists ({_names(downloads) or 'a corpus'}) "
                             f"that cannot be downloaded here; choose a game without word lists, e.g. "
                             f"GuessTheNumber-v0, Mastermind-v0, Minesweeper-v0") from None
        except (AssertionError, ValueError) as e:  # a two-player state asserts its number of players
            if "player" in str(e).lower():
                raise _refuse_id(self.env_id, "it is not a single-player game") from None
            raise self._refused(e) from None
        except Exception as e:  # e.g. TypeError: an env_kwargs key the game's constructor does not take
            raise self._refused(e) from None
        finally:
            random.setstate(saved)
        if not isinstance(getattr(_innermost(env), "state", None), ta.SinglePlayerState):
            raise _refuse_id(self.env_id, "it is not a single-player game")

    def _refused(self, e: Exception) -> ValueError:
        message = " ".join(str(e).split())  # one line
        return ValueError(f"{self.name}: the game cannot be made and reset with task.kwargs {self.env_kwargs!r}: "
                          f"{type(e).__name__}: {message} (this environment's own keys: max_turns, max_new_tokens, "
                          f"system, game; the others, and those in game = {{...}}, go to the game's constructor)")

    def reset(self, start: int):
        ta = _textarena()
        env = ta.make(self.env_id, **self.env_kwargs)
        env.reset(num_players=1, seed=int(start))
        game = _innermost(env)
        _, observation = game.get_observation()
        opening = [{"role": "system", "content": self.system}] if self.system else []
        opening.append({"role": "user", "content": _observation_text(observation)})
        return _GameState(env, game), opening

    def step(self, state: _GameState, reply: Reply):
        done, _ = state.env.step(action=reply.text)
        # get_observation hands over the game's queued messages and empties it: only what is new
        _, observation = state.game.get_observation()
        if done:
            state.done = True
            return None
        return [{"role": "user", "content": _observation_text(observation)}]

    def reward(self, state: _GameState) -> float:
        if not state.done:  # the loop's turn budget ended the game before the game did
            return 0.0
        closed = state.env.close()
        # textarena 0.7.4: (rewards, game_info); older versions: the rewards alone
        rewards = closed[0] if isinstance(closed, tuple) else closed
        value = rewards.get(0, 0) if isinstance(rewards, dict) else 0
        # a game may leave a message where its reward goes (ThreeCardMonte after a bad action): no win
        return 1.0 if isinstance(value, (int, float)) and value >= 1.0 else 0.0


__all__ = ["DEFAULT_SYSTEM", "TextArenaEnvironment", "single_player_games"]
