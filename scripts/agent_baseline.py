"""How often a model wins textarena's single-player games before any training: the games an
agent run can learn from are those whose win rate leaves room (neither 0 nor near 1).

    python scripts/agent_baseline.py --checkpoint checkpoints/smollm2-135m-instruct \
        --games GuessTheNumber-v0 FrozenLake-v0 --n 32 --json outputs/agent_baseline.json

Each game: n held-out episodes (the seeds an RL run's evaluation plays), greedy, and the same
n sampled at temperature 1, on the exact engine through the rollout loop
(titan_rl.rl.episodes). Prints a table (win rate, turns per episode, sampled tokens,
seconds) and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titan_rl import quiet  # noqa: E402

quiet.install()


def play(llm, env, n: int, temperature: float, max_model_len: int) -> dict:
    from vllm import SamplingParams

    from titan_rl.rl.episodes import EpisodeRequest, EpisodeRun
    from titan_rl.rl.requests import stop_ids
    from titan_rl.tasks import eval_seed

    starts = env.starts(n, eval_seed(0))
    eps = [EpisodeRequest(i, s, SamplingParams(temperature=temperature, max_tokens=env.max_new_tokens, seed=i,
                                               stop_token_ids=stop_ids(env.tokenizer), logprobs=0))
           for i, s in enumerate(starts)]
    t0 = time.perf_counter()
    r = EpisodeRun(env, eps, max_model_len=max_model_len, workers=4).run(
        lambda prompts, params: llm.generate(prompts, params, use_tqdm=False)).rollout()
    firsts = [e for e in r.episodes if e.part == 0]
    return {"win_rate": sum(e.reward >= 1.0 for e in firsts) / n, "turns_per_episode": sum(e.turns for e in firsts) / n,
            "sampled_tokens": r.num_tokens, "errors": sum(bool(e.reason) for e in firsts),
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="checkpoints/smollm2-135m-instruct")
    ap.add_argument("--games", nargs="+", default=["GuessTheNumber-v0", "FrozenLake-v0", "Mastermind-v0",
                                                   "Minesweeper-v0", "TowerOfHanoi-v0"])
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    from titan_rl.jsonout import write_json
    from titan_rl.tasks import load_task
    from titan_rl.vllm.engine import EngineSettings, make_llm

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    llm = make_llm(args.checkpoint, EngineSettings(arch="llama", dtype=args.dtype, kv_cache_mib=1024,
                                                   max_model_len=args.max_model_len, max_num_seqs=64))
    rows = []
    print(f"{'game':24s} {'greedy win':>10s} {'sampled win':>11s} {'turns':>6s} {'tokens':>7s} {'s':>6s}")
    for game in args.games:
        env = load_task(f"textarena:{game}", checkpoint=args.checkpoint, max_turns=args.max_turns,
                        max_new_tokens=args.max_new_tokens)
        greedy = play(llm, env, args.n, 0.0, args.max_model_len)
        sampled = play(llm, env, args.n, 1.0, args.max_model_len)
        rows.append({"game": game, "greedy": greedy, "sampled": sampled})
        print(f"{game:24s} {greedy['win_rate']:>10.3f} {sampled['win_rate']:>11.3f} {sampled['turns_per_episode']:>6.2f} "
              f"{sampled['sampled_tokens']:>7d} {greedy['seconds'] + sampled['seconds']:>6.1f}", flush=True)
    if args.json:
        write_json(args.json, {"checkpoint": args.checkpoint, "dtype": args.dtype, "n": args.n,
                               "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens, "games": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
