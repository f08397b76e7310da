"""Greedy accuracy of a checkpoint folder on held-out questions of a task, through the exact vLLM engine.

    python -m titan_rl.eval --checkpoint FOLDER --task NAME [--task-kwargs JSON] --n N --seed S
        [--max-new-tokens M] [--json OUT] [--dtype float32|bfloat16] [--kv-cache-mib MIB]
    python -m titan_rl.eval --checkpoint RUN_DIR [--step K] --n N --seed S ...

A run dir (it has config.toml) is evaluated at its newest checkpoint (or step K), exported in
the run's dtype (titan_rl.export: the weights its engine held), on the run's own task unless
--task says otherwise; with `[eval] seed = S` and n = N it reproduces the run's own held-out line.

A multi-turn environment (docs/agents.md) is played for N held-out episodes (its starts of
seed HELD_OUT_SEEDS + S, as `[eval]` plays them): accuracy is then the win rate (reward 1),
and the JSON has each episode's transcript, reward and turns.

The architecture comes from the folder's config.json; chat and library tasks read the
tokenizer and chat template from the same folder. The questions are
`task.sample(N, HELD_OUT_SEEDS + S)`: the held-out seed range, never drawn by training
(titan_rl.tasks.base), and the same questions `[eval] seed = S` evaluates during a run.
Answers are greedy (temperature 0), so a rerun gives the same numbers. Reported:
accuracy (the share of questions with reward 1), the mean reward and the mean response
length in tokens; the JSON also has every question, completion and reward.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from titan_rl import quiet

quiet.install()


def _parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m titan_rl.eval", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True,
                    help="HF folder (config.json, weights, tokenizer files) or a titan_rl run dir")
    ap.add_argument("--step", type=int, default=None, help="a run dir's checkpoint step (default: the newest)")
    ap.add_argument("--task", default=None, help="a task name, as task.name in a config (docs/tasks.md); "
                    "default for a run dir: its own")
    ap.add_argument("--task-kwargs", default=None, metavar="JSON", help="the task's kwargs, a JSON object")
    ap.add_argument("--n", type=int, default=32, help="held-out questions (default 32)")
    ap.add_argument("--seed", type=int, default=0, help="which held-out questions (default 0)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="default: the task's max_new_tokens")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="the engine's dtype (default: the folder's config.json dtype, else bfloat16)")
    ap.add_argument("--kv-cache-mib", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048,
                    help="a multi-turn environment's longest episode in tokens (default 2048)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    return ap.parse_args(argv)


def _run_dir_as_folder(args, work: str) -> None:
    """--checkpoint RUN_DIR: its checkpoint exported into `work` in the run's dtype, and the run's
    task (and kwargs) where --task is not given. Edits `args` in place."""
    from titan_rl import config as config_mod
    from titan_rl.export import export

    run = config_mod.load(os.path.join(args.checkpoint, "config.toml"))
    export(args.checkpoint, work, step=args.step, dtype=run.model.dtype, force=True)
    if args.task is None:
        args.task, args.task_kwargs = run.task.name, args.task_kwargs or json.dumps(run.task.kwargs)
    args.dtype = args.dtype or run.model.dtype
    args.source, args.checkpoint = args.checkpoint, work


def _checked(args) -> tuple:
    """Everything the evaluation can refuse, before an engine starts: (arch, task, kwargs,
    dtype, max_new_tokens, examples, max_model_len)."""
    from titan_rl.checkpoint import check_hf_folder
    from titan_rl.errors import UserError
    from titan_rl.registry import architecture_of_folder
    from titan_rl.tasks import Environment, eval_seed
    from titan_rl.validation import check_prompts, load_named_task

    for key, value, low in (("--n", args.n, 1), ("--seed", args.seed, 0), ("--max-new-tokens", args.max_new_tokens, 0),
                            ("--kv-cache-mib", args.kv_cache_mib, 1), ("--max-model-len", args.max_model_len, 16)):
        if value < low:
            raise UserError(f"{key} = {value}: must be >= {low}")
    if args.task is None:
        raise UserError("--task is needed for a checkpoint folder (a run dir brings its own)")
    try:
        kwargs = json.loads(args.task_kwargs or "{}")
    except json.JSONDecodeError as e:
        raise UserError(f"--task-kwargs = {args.task_kwargs!r} is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise UserError(f"--task-kwargs = {args.task_kwargs!r}: must be a JSON object of the task's kwargs")
    if not os.path.isdir(args.checkpoint):
        raise UserError(f"--checkpoint = {args.checkpoint!r} is not a folder")
    arch = architecture_of_folder(args.checkpoint).name
    model_cfg = check_hf_folder(args.checkpoint, arch=arch)
    with open(os.path.join(args.checkpoint, "config.json")) as f:
        folder_cfg = json.load(f)
    dtype = args.dtype or next((d for d in (folder_cfg.get("dtype"), folder_cfg.get("torch_dtype"))
                                if d in ("float32", "bfloat16")), "bfloat16")
    task = load_named_task(args.task, kwargs, args.checkpoint, keys=("--task", "--task-kwargs"))
    vocab = model_cfg.vocab_size
    if task.tokenizer.vocab_size > vocab:
        raise UserError(f"--task = {args.task!r} needs {task.tokenizer.vocab_size} token ids (its tokenizer); the "
                        f"model in {args.checkpoint!r} has vocab_size {vocab}")
    new = args.max_new_tokens or task.max_new_tokens
    limit = folder_cfg.get("max_position_embeddings") or 1 << 20
    if isinstance(task, Environment):  # episodes: known only once played; the engine's length is the bound
        return arch, task, kwargs, dtype, new, task.starts(args.n, eval_seed(args.seed)), min(limit, args.max_model_len)
    examples = check_prompts(task, args.task, args.n, eval_seed(args.seed), f"--seed {args.seed}", new, vocab, limit,
                             limit_key="the model's max_position_embeddings")
    max_model_len = max(len(ex.prompt_ids) for ex in examples) + new
    return arch, task, kwargs, dtype, new, examples, max_model_len


def evaluate(args) -> dict:
    """The evaluation `args` describe (parsed as by the CLI): its JSON document."""
    import tempfile

    from titan_rl.errors import UserError

    if args.step is not None and not os.path.isfile(os.path.join(args.checkpoint, "config.toml")):
        raise UserError(f"--step is for a run dir; {args.checkpoint!r} has no config.toml")
    with tempfile.TemporaryDirectory() as work:
        if os.path.isfile(os.path.join(args.checkpoint, "config.toml")):
            _run_dir_as_folder(args, work)
        return _evaluate(args)


def _evaluate(args) -> dict:
    import torch

    from titan_rl.rl.episodes import EpisodeRun
    from titan_rl.rl.evaluation import distinct_starts, episode_sums, summary
    from titan_rl.rl.requests import greedy_episodes
    from titan_rl.tasks import as_environment

    arch, task, kwargs, dtype, new, examples, max_model_len = _checked(args)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    from titan_rl.vllm.engine import EngineSettings, make_llm

    t0 = time.perf_counter()
    settings = EngineSettings(arch=arch, kernels="exact", dtype=dtype, kv_cache_mib=args.kv_cache_mib,
                              max_model_len=max_model_len, max_num_seqs=min(len(examples), 64))
    llm = make_llm(args.checkpoint, settings)
    env = as_environment(task)
    episodes = greedy_episodes(env, examples, new)
    rollout = EpisodeRun(env, episodes, max_model_len=max_model_len, step=0).run(
        lambda prompts, params: llm.generate(prompts, params, use_tqdm=False)).rollout()
    tokens = rollout.tokens
    sums = episode_sums(env, args.task, episodes, rollout)
    result = {k.removeprefix("eval_"): v for k, v in summary(sums).items()}
    result["distinct"] = distinct_starts(examples)
    if env is task:  # an environment's episodes: each one's stream as the engine saw it
        per = len(rollout) // len(episodes)
        questions = [{"start": ep.start if isinstance(ep.start, (int, str)) else repr(ep.start),
                      "transcript": [_text(task.tokenizer, rollout.sequences([i * per + k])[0]) for k in range(per)],
                      "reward": rollout.episodes[i * per].reward, "turns": rollout.episodes[i * per].turns,
                      "end": rollout.episodes[i * per].end} for i, ep in enumerate(episodes)]
    else:
        questions = [{"prompt": ex.prompt_text, "answer": ex.answer, "completion": task.tokenizer.decode(toks),
                      "reward": task.reward(ex, toks), "tokens": len(toks)} for ex, toks in zip(examples, tokens)]
    return {"checkpoint": os.path.abspath(getattr(args, "source", args.checkpoint)), "architecture": arch, "dtype": dtype, "kernels": "exact",
            "task": args.task, "task_kwargs": kwargs, "seed": args.seed, "max_new_tokens": new, **result,
            "seconds": time.perf_counter() - t0, "questions": questions}


def _text(tok, ids: list[int]) -> str:
    """A whole episode's stream as text, special tokens written (a reply's decode stops at its
    first stop id)."""
    if hasattr(tok, "hf"):
        return tok.hf.decode(ids)
    return "".join(tok.eos_token if i == tok.eos_id else tok.decode([i]) for i in ids)


def print_table(doc: dict, file=None) -> None:
    file = sys.stdout if file is None else file
    print(f"{doc['task']} on {doc['checkpoint']} ({doc['architecture']}, {doc['dtype']}, exact engine, greedy; "
          f"held-out seed {doc['seed']})", file=file)
    print(f"{'questions':>10s} {'accuracy':>10s} {'mean reward':>12s} {'mean length':>12s}", file=file)
    print(f"{doc['n']:>10d} {doc['accuracy']:>10.4f} {doc['reward_mean']:>12.4f} {doc['response_length']:>12.2f}",
          file=file)
    if doc.get("distinct", doc["n"]) < doc["n"]:
        print(f"only {doc['distinct']} of the {doc['n']} held-out questions are distinct: the task has no more "
              "held-out rows; the rest repeat them", file=file)


def main(argv=None) -> int:
    from titan_rl.errors import REPORTED, report_error
    from titan_rl.jsonout import write_json

    args = _parse(argv)
    try:
        doc = evaluate(args)
    except REPORTED as e:
        return report_error(e)
    print_table(doc)
    if args.json:
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    from titan_rl.malloc import run_main

    run_main(main)
