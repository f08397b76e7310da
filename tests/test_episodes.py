"""The rollout loop over episodes (titan_rl.rl.episodes) without an engine: an environment
that misbehaves ends its episode with reward 0 and one line, the others go on; episodes of an
environment that uses Python's global random do not depend on how many run at once; the chat
template's bridge appends exactly its own tokens, a re-render's divergence is counted, and a
template that rewrites earlier turns splits the episode, each part opening on the template's
own rendering. tests/test_episodes_engine.py runs episodes through the engines."""

import re
from types import SimpleNamespace

import pytest

from titan_rl.rl.episodes import EpisodeRequest, EpisodeRun, episode_metrics, parts_per_episode
from titan_rl.tasks import ChatTokenizer, as_environment, load_task
from titan_rl.tasks.bridge import ChatBridge

import _envs

vllm = pytest.importorskip("vllm")
SamplingParams = vllm.SamplingParams


class FakeEngine:
    """generate(prompts, params) as vLLM's: `reply(prompt ids, params)` gives each request's
    sampled ids (cut at max_tokens), log-prob -0.5 each; request ids count up."""

    def __init__(self, reply):
        self.reply, self.n, self.calls = reply, 0, []

    def __call__(self, prompts, params):
        outs = []
        for p, sp in zip(prompts, params):
            ids = list(self.reply(p["prompt_token_ids"], sp))
            cut = ids[:sp.max_tokens]
            self.calls.append((list(p["prompt_token_ids"]), cut))
            c = SimpleNamespace(token_ids=cut, logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in cut],
                                finish_reason="length" if len(ids) > len(cut) else "stop")
            outs.append(SimpleNamespace(request_id=str(self.n), prompt_token_ids=p["prompt_token_ids"], outputs=[c],
                                        num_cached_tokens=0))
            self.n += 1
        return outs


def _digits_reply(prompt, sp):  # two digits, then EOS: a function of the seed and the stream's length
    return [3 + (sp.seed + len(prompt)) % 10, 3 + (sp.seed * 7 + len(prompt)) % 10, 1]


def _requests(starts, max_tokens=4):
    return [EpisodeRequest(i, s, SamplingParams(max_tokens=max_tokens, seed=100 + i, logprobs=0))
            for i, s in enumerate(starts)]


@pytest.mark.parametrize("how", _envs.HOW)
def test_a_misbehaving_environment_ends_that_episode_with_reward_0_and_one_line(how, capsys):
    env = _envs.Misbehaving(how, timeout_s=0.5 if how == "step_hangs" else 60.0)
    run = EpisodeRun(env, _requests(range(6)), max_model_len=64, workers=3, step=7).run(FakeEngine(_digits_reply))
    rollout = run.rollout()
    assert len(rollout) == 6 and [e.index for e in rollout.episodes] == list(range(6))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("WARNING")]
    assert len(lines) == 3, lines  # one per odd start, nothing else
    want = {"reset": r"reset raised RuntimeError: reset failed on purpose",
            "step_raises": r"step raised ValueError: the game broke on purpose",
            "step_hangs": r"step took longer than 0.5 s \(env.timeout_s\)",
            "step_not_text": r"step returned int 42: allowed are None \(the episode is over\), a str, or a non-empty list",
            "overflow": r"the environment's answer to reply 1 \(5000 tokens\) overflows rollout.max_model_len = 64",
            "reward_raises": r"reward raised KeyError: 'no score on purpose'"}[how]
    for e in rollout.episodes:
        if e.index % 2:
            assert e.reward == 0.0 and e.end in ("error", "max_model_len") and re.search(want, e.reason), e
            line = next(ln for ln in lines if f"episode {e.index} (start {e.index})" in ln)
            assert re.search(want, line) and "its reward is 0 and the run goes on" in line, line
        else:  # the others are played to their end, as if nothing happened
            assert e.reward == 1.0 and e.end == "done" and e.turns == 3 and not e.reason, e
    if how == "reset":  # no opening: an empty row, nothing sampled
        assert all(rollout.tokens[i] == [] for i in (1, 3, 5))
    assert episode_metrics(rollout)["env_errors"] == 3


def test_global_random_episodes_do_not_depend_on_how_many_run_at_once():
    """textarena seeds Python's global random in its state: each episode's calls run under its
    own random state, so 1 worker and 6 (with calls interleaving by sleeps) play the same
    episodes: the same streams, rewards and digests."""
    def play(workers):
        env = _envs.GlobalRandomGame(turns=4, delay_s=0.01)
        run = EpisodeRun(env, _requests(range(12), max_tokens=3), max_model_len=128, workers=workers)
        r = run.run(FakeEngine(_digits_reply)).rollout()
        return r.sequences(), [e.reward for e in r.episodes], r.digests(r.mu[0].new_zeros(len(r)).float())

    one, six = play(1), play(6)
    assert one[0] == six[0] and one[1] == six[1]
    assert bool((one[2] == six[2]).all())
    assert len({tuple(s) for s in one[0]}) == 12  # the episodes differ from each other


def test_a_task_is_the_one_turn_case():
    task = load_task("digit_reverse")
    env = as_environment(task)
    examples = task.sample(5, seed=3)
    run = EpisodeRun(env, _requests(examples), max_model_len=64).run(FakeEngine(_digits_reply))
    r = run.rollout()
    assert r.prompts == [ex.prompt_ids for ex in examples]
    assert all(bool(s.all()) for s in r.sampled) and all(e.turns == 1 and e.end == "done" for e in r.episodes)
    assert [e.reward for e in r.episodes] == [task.reward(ex, t) for ex, t in zip(examples, r.tokens)]


def test_the_loop_stops_a_turn_at_max_model_len_and_masks_context():
    env = load_task("digit_turns", turns=3, min_len=3, max_len=3)
    run = EpisodeRun(env, _requests(range(4)), max_model_len=64).run(FakeEngine(_digits_reply))
    r = run.rollout()
    for i in range(4):
        sampled = r.sampled[i].tolist()
        assert sum(sampled) == 9 and len(sampled) == 9 + 2 * len("rev:123=")  # 3 replies, 2 questions between
        mask = r.mask()[i]
        span = r.response_span(i)
        assert mask[span].tolist() == sampled and not mask[:span.start].any()
    # a stream that no longer fits ends before its next turn
    short = EpisodeRun(env, _requests(range(2)), max_model_len=22).run(FakeEngine(_digits_reply)).rollout()
    assert all(e.end == "max_model_len" and e.reward == 0.0 and e.turns == 2 for e in short.episodes)


@pytest.fixture(scope="module")
def chat_folders(tmp_path_factory):
    from test_chat_tasks import _tokenizer

    out = {}
    for name, template in (("chatml", None), ("think", _envs.THINK_TEMPLATE)):
        folder = tmp_path_factory.mktemp(name)
        (_tokenizer() if template is None else _tokenizer(chat_template=template)).save_pretrained(folder)
        out[name] = str(folder)
    return out


def test_the_bridge_appends_the_templates_own_tokens_and_counts_a_rerender_that_differs(chat_folders):
    tok = ChatTokenizer.from_folder(chat_folders["chatml"])
    bridge = ChatBridge(tok)
    assert not bridge.rewrites_history()
    history = [{"role": "user", "content": "12 + 7 - 3 ="}]
    new = [{"role": "user", "content": "<answer>42</answer>"}]
    text = "<answer>42</answer>"
    canonical = tok.encode(text) + [tok.end_of_turn_id]
    stream = tok.render(history) + canonical
    joined = bridge.join(history, canonical, text, new)
    full = tok.render(history + [{"role": "assistant", "content": text}] + new)
    assert stream + joined.ids == full == joined.rerendered
    # the same text sampled as other tokens (one byte-level token per character): the bridge is
    # the same, the stream keeps the engine's ids, and a re-render would change them
    spelled = [i for ch in text for i in tok.encode(ch)] + [tok.end_of_turn_id]
    assert spelled != canonical and tok.decode(spelled) == text
    again = bridge.join(history, spelled, text, new)
    assert again.ids == joined.ids and tok.render(history) + spelled + again.ids != again.rerendered
    # a reply cut by its token budget: the bridge writes the end-of-turn token (as context)
    cut = bridge.join(history, canonical[:-1], text, new)
    assert cut.ids == [tok.end_of_turn_id] + joined.ids


def _chat_reply(tok):
    words = tok.encode("<answer>42</answer>")
    return lambda prompt, sp: words + [tok.end_of_turn_id]


def test_chatml_episodes_are_one_stream_with_the_engines_ids(chat_folders):
    env = _envs.ChatTurns(chat_folders["chatml"], turns=3, max_new_tokens=16)
    engine = FakeEngine(_chat_reply(env.tokenizer))
    r = EpisodeRun(env, _requests(range(2), max_tokens=16), max_model_len=256).run(engine).rollout()
    assert parts_per_episode(env) == 1 and len(r) == 2
    for i, e in enumerate(r.episodes):
        assert e.turns == 3 and e.samples == 1 and e.render_breaks == 0 and not e.rerender_diverged
        # each turn's prompt is the previous turn's prompt + its reply + the bridge: one stream
        prompts = [p for p, _ in engine.calls[i::2]]
        replies = [t for _, t in engine.calls[i::2]]
        assert all(prompts[k + 1][:len(prompts[k]) + len(replies[k])] == prompts[k] + replies[k] for k in range(2))
        assert r.sequences()[i][:len(prompts[2]) + len(replies[2])] == prompts[2] + replies[2]
        assert int(r.sampled[i].sum()) == sum(map(len, replies))


def test_a_template_that_rewrites_earlier_turns_splits_the_episode(chat_folders):
    """Qwen3-style: an empty think block opens the turn being written and is dropped from
    earlier ones, so no bridge can continue the stream: each turn opens a new sample on the
    template's own rendering of the conversation, and the re-render divergence is counted."""
    env = _envs.ChatTurns(chat_folders["think"], turns=3, max_new_tokens=16)
    tok = env.tokenizer
    assert ChatBridge(tok).rewrites_history() and parts_per_episode(env) == 3
    engine = FakeEngine(_chat_reply(tok))
    r = EpisodeRun(env, _requests(range(2), max_tokens=16), max_model_len=256).run(engine).rollout()
    assert len(r) == 6  # 3 rows per episode
    for i in range(2):
        rows = r.episodes[3 * i:3 * i + 3]
        assert [e.part for e in rows] == [0, 1, 2] and rows[0].samples == 3 and rows[0].render_breaks == 2
        assert rows[0].rerender_diverged and rows[0].end == "done"
        conv = [{"role": "user", "content": f"What is {i % 97} + 7 - 3 ="}]
        for k in range(3):
            assert r.prompts[3 * i + k] == tok.render(conv), k  # the template's own, turn by turn
            assert bool(r.sampled[3 * i + k].all())  # each part: its prompt, then one reply
            conv += [{"role": "assistant", "content": "<answer>42</answer>"},
                     {"role": "user", "content": f"and {k + 1} + 12 ="}]
    m = episode_metrics(r)
    assert m["samples"] == 6 and m["render_breaks"] == 4 and m["rerender_divergence"] == 2


def test_a_non_finite_engine_logprob_stops_the_step_naming_the_request():
    """A NaN or inf mu on a sampled token stops the step (RunStopped, one line naming the
    request, the token and the episode); the same value on a context token is not read."""
    import torch

    from titan_rl.errors import RunStopped
    from titan_rl.rl.ranks import Ranks
    from titan_rl.rl.rewards import check_logprobs

    env = load_task("digit_turns", turns=2, min_len=3, max_len=3)
    r = EpisodeRun(env, _requests(range(3)), max_model_len=64).run(FakeEngine(_digits_reply)).rollout()
    check_logprobs(r, Ranks(), step=3)  # all finite: nothing to say
    context = int((~r.sampled[1]).nonzero()[0])
    r.mu[1][context] = float("nan")
    check_logprobs(r, Ranks(), step=3)  # a context token's mu is a placeholder, never used
    for value in (float("nan"), float("inf")):
        r.mu[2][1] = value
        with pytest.raises(RunStopped) as e:
            check_logprobs(r, Ranks(), step=3)
        msg = str(e.value)
        assert f"request '{r.request_ids[2]}' (episode 2) is {value}" in msg and "step 3" in msg and "\n" not in msg


def test_a_held_out_set_that_repeats_is_counted_and_said(tmp_path, chat_folders):
    """A 10-row JSON-lines task holds out one row, so 4 held-out questions are one question four
    times: distinct_starts counts 1 and the evaluation line says so; a generator's starts differ."""
    import json

    from titan_rl.rl.evaluation import distinct_starts
    from titan_rl.run_dir import console_line
    from titan_rl.tasks import eval_seed

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n" for i in range(10)))
    task = load_task(f"jsonl:{rows}", checkpoint=chat_folders["chatml"])
    assert distinct_starts(task.sample(4, eval_seed(0))) == 1
    assert distinct_starts(load_task("digit_turns").starts(4, eval_seed(0))) == 4
    line = {"phase": "eval", "step": 2, "eval_accuracy": 0.0, "eval_reward_mean": 0.0, "eval_response_length": 3.0,
            "eval_n": 4, "eval_distinct": 1, "weights_step": 1}
    assert "(4 held-out questions, only 1 distinct, weights after step 1)" in console_line(line, 9)
    assert "distinct" not in console_line({**line, "eval_distinct": 4}, 9)
