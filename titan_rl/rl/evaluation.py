"""Held-out evaluation: greedy answers to a fixed set of held-out questions, scored by the task.

Two callers share it: `python -m titan_rl.eval` (a checkpoint folder, its own exact engine)
and the RL trainer (`[eval]`: the run's own engine, before the first RL step and after
every `eval.interval`-th RL step's weight sync, one `"phase": "eval"` line in
metrics.jsonl each). The questions are `task.sample(n, eval_seed(seed))`, from the
held-out seed range (titan_rl.tasks.HELD_OUT_SEEDS), the same at every evaluation of a
run. Accuracy is the share of questions whose reward is 1 (full credit); the mean reward
and the mean response length (tokens, stop token included) come with it.
"""

from __future__ import annotations

import time

from titan_rl.rl.global_batch import rank_share
from titan_rl.rl.requests import greedy_episodes
from titan_rl.tasks import check_reward, eval_seed


def distinct_starts(starts: list) -> int:
    """How many different questions (or episode starts) `starts` holds: a task with few
    held-out rows draws the same ones again (JsonlTask walks seeded shuffles of its rows)."""
    import json

    def key(s):
        if hasattr(s, "prompt_ids"):
            return tuple(s.prompt_ids)
        return json.dumps(s, sort_keys=True, default=repr)

    return len({key(s) for s in starts})


def summary(sums: list[float]) -> dict:
    """eval_accuracy, eval_reward_mean, eval_response_length, eval_n from episode_sums' totals."""
    n, correct, reward, length = sums
    return {"eval_accuracy": correct / n, "eval_reward_mean": reward / n, "eval_response_length": length / n,
            "eval_n": int(n)}


def episode_sums(env, name: str, episodes: list, rollout, step: int = 0) -> list[float]:
    """[episodes, fully rewarded (reward 1), reward sum, sampled tokens] of a rollout of
    one-reply or multi-turn episodes, each reward checked finite as a rollout's are."""
    per = len(rollout) // max(len(episodes), 1)
    rewards, tokens = [], 0.0
    for i, ep in enumerate(episodes):
        info = rollout.episodes[i * per]
        rewards.append(check_reward(info.reward, name, i, ep.start, 0, rollout.tokens[i * per], env.tokenizer, step))
        tokens += sum(int(rollout.sampled[i * per + k].sum()) for k in range(per))
    return [float(len(rewards)), float(sum(r >= 1.0 for r in rewards)), float(sum(rewards)), tokens]


class RunEvaluation:
    """The trainer's evaluations: this data-parallel rank's share of the held-out episodes
    (a task's questions, an environment's held-out seeds), played greedily by the run's
    engine link, the counts summed over the data-parallel ranks."""

    def __init__(self, cfg, env, ranks):
        self.cfg, self.env, self.ranks = cfg, env, ranks
        e = cfg.eval
        share = rank_share(e.n, ranks.dp_degree, ranks.dp_rank)
        every = env.starts(e.n, seed=eval_seed(e.seed))
        self.distinct = distinct_starts(every)  # a small held-out set repeats: say so
        starts = every[share.start:share.stop]
        self.episodes = greedy_episodes(env, starts, e.max_new_tokens or env.max_new_tokens, first_index=share.start)

    def due_before(self, step: int) -> bool:
        """Before RL step `step`'s rollout: only the first RL step's (the starting point)."""
        return self.cfg.eval.interval > 0 and step == self.cfg.algorithm.sft_steps + 1

    def due_after(self, step: int) -> bool:
        """After RL step `step`'s weight sync: every eval.interval-th RL step."""
        rl_steps = step - self.cfg.algorithm.sft_steps
        return self.cfg.eval.interval > 0 and rl_steps > 0 and rl_steps % self.cfg.eval.interval == 0

    def run(self, engine, step: int, weights_step: int) -> dict:
        """The metrics line of one evaluation during step `step` of the weights after
        `weights_step` optimizer steps (what the engine holds)."""
        t0 = time.perf_counter()
        rollout = engine.generate(step, self.episodes)
        sums = episode_sums(self.env, self.cfg.task.name, self.episodes, rollout, step)
        line = summary(self.ranks.reduce_sums(sums, over_dp=True))
        line["eval_distinct"] = self.distinct
        if self.env.max_turns > 1:  # episodes: the win rate's companion, how long they lasted
            firsts = [e for e in rollout.episodes if e.part == 0]
            n, turns = self.ranks.reduce_sums([float(len(firsts)), float(sum(e.turns for e in firsts))], over_dp=True)
            line["eval_turns_per_episode"] = turns / n
        return {"step": step, "phase": "eval", "weights_step": weights_step, **line,
                "time_eval_seconds": time.perf_counter() - t0}
