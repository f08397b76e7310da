"""The rollout loop: episodes of one turn or many, token in and token out.

`EpisodeRun(env, requests, ...)` runs a batch of episodes to their end on one engine
(`run(generate)`, `generate(prompts, params) -> RequestOutputs` being that engine's), then
gives them as one `Rollout` (`rollout(**records)`, with the captures of the engine's
choices). Each turn is one request per live episode, its prompt the episode's whole token
stream so far: the engine's prefix cache reuses the earlier turns' KV (and recurrent
states), computed by the same batch-invariant kernels the trainer's forward runs, so every
sampled token of every turn keeps pi == mu. Between turns only the environment's new
messages are appended, as the chat template's bridge (titan_rl.tasks.bridge); a template
that rewrites earlier turns splits the episode into a new sample, each part exact.

Rows: an episode owns `parts` rows of the rollout (1; the environment's max_turns where its
template rewrites history, one per possible split), so the step's row count is a function
of the config alone and every layout cuts the same global batch. Rows an episode did not
use are empty (no sampled token: no loss, no gradient). In a row, context tokens (bridges,
environment messages) are masked: only sampled tokens carry mu, a ratio and a loss.

Environments off the critical path, still reproducible: each phase (reset, step, rewards)
calls the episodes' environments concurrently on `workers` threads, each call with a
timeout; an environment that uses Python's global `random` runs each call under its
episode's own random state, swapped in and out under one lock, so an episode is a pure
function of its start and its replies whatever the scheduling. A call that raises, hangs
past `env.timeout_s`, returns what the interface does not allow, or an episode that no
longer fits `rollout.max_model_len`, ends that episode with reward 0 and a one-line reason;
the run goes on.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from titan_rl.rl.seeds import step_seed
from titan_rl.rollout import Rollout
from titan_rl.tasks.bridge import bridge_for
from titan_rl.tasks.env import Reply

# Why an episode ended. ERROR_ENDS score 0 whatever the environment says.
DONE, MAX_TURNS, SPLIT_LIMIT = "done", "max_turns", "render_break"
MAX_MODEL_LEN, ERROR = "max_model_len", "error"
ERROR_ENDS = (MAX_MODEL_LEN, ERROR)
_RANDOM = threading.Lock()  # Python's global random state: one owner at a time


@dataclass
class EpisodeRequest:
    """One episode of a step, as an engine link is sent it (picklable: the separate engines'
    rank 0 runs every rank's). `start`: the environment's (a seed, a task example); with no
    environment, the prompt ids. `params`: the first turn's SamplingParams; turn t > 0 draws
    with seed step_seed(seed, t)."""

    index: int  # the episode's global index in its step
    start: object
    params: object


@dataclass(frozen=True)
class EpisodeInfo:
    """A rollout row's episode: which part of it the row is, and how the episode went."""

    index: int
    part: int
    parts: int
    turns: int  # replies sampled in the whole episode
    samples: int  # parts it used (1 + its splits)
    end: str  # DONE, MAX_TURNS, SPLIT_LIMIT, MAX_MODEL_LEN, ERROR
    reason: str  # one line where the environment misbehaved, else ""
    reward: float | None  # None: no environment to score it
    rerender_diverged: bool  # a re-render of the conversation would have changed the tokens
    render_breaks: int  # turns where the template could not be bridged
    mixed_version_tokens: int  # sampled under other weights than the rollout's version
    cached_tokens: int  # prompt tokens of its turns the engine's prefix cache served (earlier turns' KV)
    first_turn: int = 0  # the episode's turn index of this row's first reply
    turn_lengths: tuple[int, ...] = ()  # this row's replies' sampled token counts, in order

    def turn_positions(self) -> tuple[list[int], list[int]]:
        """(turn index, position within its reply) of each of this row's sampled tokens."""
        turns = [self.first_turn + t for t, n in enumerate(self.turn_lengths) for _ in range(n)]
        return turns, [k for n in self.turn_lengths for k in range(n)]


@dataclass
class _Part:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    mu: list[float] = field(default_factory=list)
    full: list[torch.Tensor] = field(default_factory=list)
    turns: list[tuple[str, list[int]]] = field(default_factory=list)  # (request id, sampled ids)

    @property
    def stream(self) -> list[int]:
        return self.prompt + self.tokens

    def context(self, ids: list[int]) -> None:
        self.tokens += ids
        self.sampled += [False] * len(ids)
        self.mu += [0.0] * len(ids)


@dataclass
class _Episode:
    req: EpisodeRequest
    state: object = None
    messages: list = field(default_factory=list)
    parts: list[_Part] = field(default_factory=list)
    turns: int = 0
    end: str | None = None
    reason: str = ""
    reward: float | None = None
    diverged: bool = False
    breaks: int = 0
    mixed: int = 0
    cached: int = 0
    random_state: object = None
    reply: Reply | None = None
    pending: object = None  # the environment's answer to the last reply

    @property
    def live(self) -> bool:
        return self.end is None

    def finish(self, end: str, reason: str = "") -> None:
        if self.end is None:
            self.end, self.reason = end, reason


class EpisodeRun:
    def __init__(self, env, requests: list[EpisodeRequest], *, max_model_len: int, workers: int = 4,
                 version: int = 0, version_of=None, step: int = 0):
        self.env, self.max_model_len, self.workers = env, max_model_len, max(1, workers)
        self.version, self.version_of, self.step = version, version_of or (lambda: version), step
        self.bridge = bridge_for(env.tokenizer) if env is not None else None
        self.parts = parts_per_episode(env, self.bridge)
        self.episodes = [_Episode(r) for r in requests]
        self.outputs: list = []  # every turn's RequestOutput (the route / index records' donors)
        self.env_seconds = 0.0

    # -- the loop ----------------------------------------------------------------------------
    def run(self, generate) -> "EpisodeRun":
        env = self.env
        if env is None:  # prompts as given, one reply each
            for ep in self.episodes:
                ep.parts.append(_Part(list(ep.req.start)))
        else:
            self._call_each(self.episodes, self._reset, "reset")
        for turn in range(env.max_turns if env is not None else 1):
            going, prompts, params = [], [], []
            for ep in self.episodes:
                if not ep.live:
                    continue
                stream = ep.parts[-1].stream
                room = self.max_model_len - len(stream)
                if room < 1:
                    ep.finish(MAX_MODEL_LEN, f"its {len(stream)}-token stream leaves no room under "
                                             f"rollout.max_model_len = {self.max_model_len}")
                    continue
                going.append(ep)
                prompts.append({"prompt_token_ids": stream})
                params.append(_turn_params(ep.req.params, turn, room))
            if not going:
                break
            outputs = generate(prompts, params)
            version = self.version_of()
            for ep, out in zip(going, outputs):
                self._add_reply(ep, out, turn, version)
            if env is None:
                for ep in going:
                    ep.finish(DONE)
                break
            self._call_each([ep for ep in going if ep.live], self._step, "step")
            for ep in going:
                if ep.live:
                    self._join(ep, turn)
        for ep in self.episodes:
            ep.finish(MAX_TURNS)
        if env is not None:
            self._score()
        return self

    def _reset(self, ep: _Episode) -> None:
        state, opening = self.env.reset(ep.req.start)
        if isinstance(opening, str):
            opening = [{"role": "user", "content": opening}]
        ok_ids = isinstance(opening, (list, tuple)) and opening and all(
            isinstance(i, int) and not isinstance(i, bool) for i in opening)
        if not ok_ids and not _messages(opening):
            raise _Bad(f"reset returned an opening of type {type(opening).__name__}: allowed are prompt token ids, "
                       "a str, or a non-empty list of {role, content} messages with str values")
        ep.state = state
        ep.messages = [] if ok_ids else list(opening)
        ep.parts.append(_Part(self.bridge.opening(opening)))

    def _step(self, ep: _Episode) -> None:
        new = self.env.step(ep.state, ep.reply)
        if isinstance(new, str):
            new = [{"role": "user", "content": new}]
        if new is not None and not _messages(new):
            raise _Bad(f"step returned {type(new).__name__} {new!r:.80}: allowed are None (the episode is over), a "
                       "str, or a non-empty list of {role, content} messages with str values")
        ep.pending = new

    def _add_reply(self, ep: _Episode, out, turn: int, version: int) -> None:
        c = out.outputs[0]
        ids = list(c.token_ids)
        part = ep.parts[-1]
        part.tokens += ids
        part.sampled += [True] * len(ids)
        part.mu += [lp[t].logprob for t, lp in zip(ids, c.logprobs)]
        if c.logprobs and len(c.logprobs[0]) > 1:  # logprobs=-1: every token of the vocabulary
            part.full.append(torch.stack([torch.tensor([d[t].logprob for t in range(len(d))]) for d in c.logprobs]))
        part.turns.append((out.request_id, ids))
        self.outputs.append(out)
        ep.turns += 1
        ep.cached += out.num_cached_tokens or 0
        if version != self.version:
            ep.mixed += len(ids)
        text = self.env.tokenizer.decode(ids) if self.env is not None else ""
        ep.reply = Reply(tuple(ids), text, turn, c.finish_reason == "length")

    def _join(self, ep: _Episode, turn: int) -> None:
        """The environment's answer joins the stream (or splits it), unless the episode ends."""
        new = ep.pending
        if new is None:
            return ep.finish(DONE)
        if turn + 1 >= self.env.max_turns:
            return ep.finish(MAX_TURNS)
        part, reply = ep.parts[-1], ep.reply
        joined = self.bridge.join(ep.messages, list(reply.ids), reply.text, new)
        ep.messages += [{"role": "assistant", "content": reply.text}] + new
        if joined.ids is None:
            ep.breaks += 1
            ep.diverged = True
            if len(ep.parts) >= self.parts:
                return ep.finish(SPLIT_LIMIT)
            ep.parts.append(_Part(joined.restart))
            return
        if joined.rerendered is not None and part.stream + joined.ids != joined.rerendered:
            ep.diverged = True
        if len(part.stream) + len(joined.ids) >= self.max_model_len:
            return ep.finish(MAX_MODEL_LEN, f"the environment's answer to reply {turn + 1} ({len(joined.ids)} tokens) "
                                            f"overflows rollout.max_model_len = {self.max_model_len}")
        part.context(joined.ids)

    def _score(self) -> None:
        scored = [ep for ep in self.episodes if ep.end not in ERROR_ENDS and ep.state is not None]
        t0 = time.perf_counter()
        try:
            if self.env.uses_global_random or not scored:
                raise _Serial
            values = _with_timeout(lambda: self.env.rewards([ep.state for ep in scored]), self.env.timeout_s)
            if not isinstance(values, (list, tuple)) or len(values) != len(scored):
                raise _Serial
            for ep, v in zip(scored, values):
                ep.reward = v
        except Exception:  # noqa: BLE001  (one at a time, so one bad episode does not take the batch down)
            self._call_each(scored, lambda ep: setattr(ep, "reward", self.env.reward(ep.state)), "reward")
        self.env_seconds += time.perf_counter() - t0
        for ep in self.episodes:
            if ep.end in ERROR_ENDS:
                ep.reward = 0.0
                self._warn(ep)

    # -- calling environments ---------------------------------------------------------------
    def _call_each(self, episodes: list[_Episode], fn, what: str) -> None:
        """fn(ep) for each of `episodes`, `workers` at a time, each within env.timeout_s; a
        call that fails ends its episode (ERROR, whatever ended it before) with the reason."""
        todo = list(episodes)
        if not todo:
            return
        t0 = time.perf_counter()
        pool = ThreadPoolExecutor(max_workers=min(self.workers, len(todo)), thread_name_prefix="titan_rl-env")
        try:
            futures = {pool.submit(self._isolated, ep, fn): ep for ep in todo}
            done, late = wait(futures, timeout=self.env.timeout_s)
            for f in late:
                _fail(futures[f], f"{what} took longer than {self.env.timeout_s:g} s (env.timeout_s)")
            for f in done:
                e = f.exception()
                if e is not None:
                    text = str(e) if isinstance(e, _Bad) else f"{what} raised {type(e).__name__}: {e}"
                    _fail(futures[f], " ".join(text.split())[:300])
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # a hung call is left behind, its episode ended
        self.env_seconds += time.perf_counter() - t0

    def _isolated(self, ep: _Episode, fn):
        if not self.env.uses_global_random:
            return fn(ep)
        with _RANDOM:
            outer = random.getstate()
            if ep.random_state is None:
                ep.random_state = random.Random(step_seed(self.step, ep.req.index)).getstate()
            random.setstate(ep.random_state)
            try:
                return fn(ep)
            finally:
                ep.random_state = random.getstate()
                random.setstate(outer)

    def _warn(self, ep: _Episode) -> None:
        start = ep.req.start if isinstance(ep.req.start, int) else type(ep.req.start).__name__
        print(f"WARNING: step {self.step}: {self.env.name} episode {ep.req.index} (start {start}) ended at turn "
              f"{ep.turns}: {ep.reason or ep.end}; its reward is 0 and the run goes on", flush=True)

    # -- the record ---------------------------------------------------------------------------
    def rollout(self, kept_sets=None, routes=None, indices=None) -> Rollout:
        """The episodes as rows (each `parts` of them), with the engine's records."""
        routes_of = routes.assemble(self.outputs) if routes is not None else None
        indices_of = indices.assemble(self.outputs) if indices is not None else None
        pad = self.env.tokenizer.pad_id if self.env is not None else 0
        cols: dict[str, list] = {k: [] for k in ("request_ids", "prompts", "tokens", "mu", "full", "sampled",
                                                 "episodes", "kept", "kept_bytes_each", "routes", "indices")}
        for ep in self.episodes:
            info = dict(index=ep.req.index, parts=self.parts, turns=ep.turns, samples=len(ep.parts), end=ep.end,
                        reason=ep.reason, reward=ep.reward, rerender_diverged=ep.diverged, render_breaks=ep.breaks,
                        mixed_version_tokens=ep.mixed, cached_tokens=ep.cached)
            for k in range(self.parts):
                part = ep.parts[k] if k < len(ep.parts) else _Part([pad])
                if not part.prompt:  # reset failed before an opening: an empty row
                    part = _Part([pad])
                rids = [rid for rid, _ in part.turns]
                cols["request_ids"].append(rids[0] if rids else f"episode-{ep.req.index}-part-{k}")
                cols["prompts"].append(part.prompt)
                cols["tokens"].append(part.tokens)
                cols["mu"].append(torch.tensor(part.mu, dtype=torch.float64))
                cols["full"].append(torch.cat(part.full) if part.full else None)
                cols["sampled"].append(torch.tensor(part.sampled, dtype=torch.bool))
                first = sum(len(p.turns) for p in ep.parts[:k])
                cols["episodes"].append(EpisodeInfo(part=k, first_turn=first,
                                                    turn_lengths=tuple(len(ids) for _, ids in part.turns), **info))
                if kept_sets is not None:
                    cols["kept"] += [kept_sets.kept_for(rid, ids) for rid, ids in part.turns]
                    cols["kept_bytes_each"].append(sum(kept_sets.bytes_of(rid) for rid in rids))
                for name, record in (("routes", routes_of), ("indices", indices_of)):
                    if record is not None:
                        # the part's last request covers its whole stream (earlier turns: prefix-cache donors)
                        cols[name].append(record[rids[-1]] if rids else _empty(record))
        r = Rollout(cols["request_ids"], cols["prompts"], cols["tokens"], cols["mu"], cols["full"],
                    sampled=cols["sampled"], episodes=cols["episodes"], env_seconds=self.env_seconds)
        if kept_sets is not None:
            V = kept_sets.vocab_size
            r.kept = torch.cat(cols["kept"]) if cols["kept"] else torch.zeros(0, V, dtype=torch.bool)
            r.kept_bytes_each = cols["kept_bytes_each"]
        if routes is not None:
            r.routes, r.route_bytes_per_token = cols["routes"], routes.bytes_per_token
        if indices is not None:
            r.indices, r.index_bytes_per_token = cols["indices"], indices.bytes_per_token
        return r


def parts_per_episode(env, bridge=None) -> int:
    """Rows an episode owns: one, or one per turn where the template rewrites history."""
    if env is None or env.max_turns == 1:
        return 1
    bridge = bridge or bridge_for(env.tokenizer)
    return env.max_turns if bridge.rewrites_history() else 1


def episode_metrics(rollout: Rollout) -> dict[str, float]:
    """Sums over this rank's episodes (each counted on its first row), for the step line."""
    firsts = [e for e in (rollout.episodes or []) if e.part == 0]
    return {"episodes": float(len(firsts)),
            "turns": float(sum(e.turns for e in firsts)),
            "samples": float(sum(e.samples for e in firsts)),
            "render_breaks": float(sum(e.render_breaks for e in firsts)),
            "rerender_divergence": float(sum(e.rerender_diverged for e in firsts)),
            "env_errors": float(sum(e.end in ERROR_ENDS for e in firsts)),
            "mixed_version_tokens": float(sum(e.mixed_version_tokens for e in firsts)),
            "cached_tokens": float(sum(e.cached_tokens for e in firsts))}


class _Bad(Exception):
    """An environment returned what the interface does not allow (the message says what)."""


class _Serial(Exception):
    pass


def _fail(ep: _Episode, reason: str) -> None:
    ep.end, ep.reason = ERROR, reason


def _messages(x) -> bool:
    return isinstance(x, list) and bool(x) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in x)


def _turn_params(params, turn: int, room: int):
    """Turn `turn`'s SamplingParams: the episode's, reseeded after the first turn, and no
    more tokens than the engine's max_model_len leaves."""
    p = params.clone()
    if turn and p.seed is not None:
        p.seed = step_seed(p.seed, turn)
    p.max_tokens = min(p.max_tokens or room, room)
    return p


def _with_timeout(fn, seconds: float):
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan_rl-env")
    try:
        return pool.submit(fn).result(timeout=seconds)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _empty(record_by_id: dict) -> torch.Tensor:
    """An empty row's record, shaped as the others' (no engine request made it)."""
    first = next(iter(record_by_id.values()), None)
    if first is None:
        raise RuntimeError("no episode of this batch reached the engine: its records have no shape")
    return first.new_zeros((0, *first.shape[1:]))


__all__ = ["EpisodeInfo", "EpisodeRequest", "EpisodeRun", "episode_metrics", "parts_per_episode"]
