"""Multi-turn episodes through the engines, token in and token out: every sampled token of
every turn has max |dlogp| 0 (dense fp32 with top-k / top-p kept sets replayed, dense bf16,
MoE with route replay, a GDN hybrid
with its state cache, GLM-5 with index replay), later turns reuse earlier turns' KV from the
prefix cache; a chat template that rewrites earlier turns splits episodes, each part exact;
FSDP 2 and a separate engine write the one-process colocated run's metrics line for line; a
separate engine sampling one step ahead never mixes weight versions inside an episode; an
environment's concurrency does not change the rollout."""

import sys

import pytest

pytest.importorskip("vllm")

import _zygote  # noqa: E402
from _train_runs import ENV, SEPARATE, _comparable, _metrics, _torchrun  # noqa: E402

RL = ["--algorithm.sft_steps=0", "--training.steps=2", "--lr_scheduler.warmup_steps=1",
      "--algorithm.prompts_per_step=2", "--algorithm.group_size=2", "--checkpoint.enable=false"]
DIGITS = ["--task.name=digit_turns", "--task.kwargs={turns = 4, min_len = 10, max_len = 14}", "--rollout.block_size=32",
          "--rollout.max_model_len=256"]
# the hybrids' KV block is 256 tokens (vLLM's mamba "align" mode): a 4th turn's prompt reuses a
# block only past that, so longer questions
LONG = ["--task.name=digit_turns", "--task.kwargs={turns = 4, min_len = 60, max_len = 64}",
        "--rollout.max_model_len=640"]
CASES = {
    # top-k / top-p with the sampler's kept sets replayed: recorded turn by turn
    "qwen3_fp32_kept": ["--model.dtype=float32", "--sampling.top_p=0.8", "--sampling.top_k=5",
                        "--sampling.mask_mode=replay", *DIGITS],
    "qwen3_bf16": ["--model.dtype=bfloat16", *DIGITS],
    "moe_replay_bf16": ["--model.name=qwen3_moe", "--model.flavor=debug_moe", "--model.dtype=bfloat16",
                        "--rollout.router_replay=replay", *DIGITS],
    "hybrid_bf16": ["--model.name=qwen3_hybrid", "--model.flavor=debug_hybrid", "--model.dtype=bfloat16", *LONG],
    "glm5_replay_fp32": ["--model.name=glm_moe_dsa", "--model.flavor=debug_glm5", "--model.dtype=float32",
                         "--rollout.index_selection=replay", *DIGITS],
}


def _train(run_dir, extra):
    cmd = [sys.executable, "-m", "titan_rl.train", "--run-dir", str(run_dir), *RL, *extra]
    r = _zygote.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [m for m in _metrics(run_dir) if m["phase"] == "rl"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The colocated one-process run of each case, made once."""
    made = {}

    def get(name):
        if name not in made:
            made[name] = _train(tmp_path_factory.mktemp(name), CASES[name])
        return made[name]

    return get


def _exact_turns(lines, cached=True):
    assert len(lines) == 2
    for m in lines:
        assert m["max_abs_dlogp"] == 0.0 and m["bitwise_fraction"] == 1.0 and m["weights_checksum_equal"], m
        assert m["turns_per_episode"] > 1 and m["samples_per_episode"] == 1 and m["render_breaks"] == 0, m
        assert m["mixed_version_tokens"] == 0
        assert not cached or m["prefix_cached_tokens"] > 0, m  # later turns ran on earlier turns' cached KV


@pytest.mark.parametrize("name", list(CASES))
def test_every_turn_of_every_episode_is_exact(runs, name):
    lines = runs(name)
    _exact_turns(lines, cached=name != "hybrid_bf16" or None)
    if name == "hybrid_bf16":  # a block of 256 reused by at least one 4th turn
        assert any(m["prefix_cached_tokens"] >= 256 for m in lines), lines
    if name == "qwen3_fp32_kept":
        assert all(m["kept_set_bytes_per_token"] > 0 for m in lines)
    if name == "moe_replay_bf16":
        assert all(m["route_bytes_per_token"] > 0 for m in lines)  # replayed: recorded across turns


def test_fsdp2_writes_the_one_process_lines(runs, tmp_path):
    """torchrun's 2 ranks (FSDP 2, each rank its own engine and its share of the episodes):
    the MoE multi-turn run's every metrics line, wall-clock fields aside."""
    r = _torchrun(tmp_path, [*RL, *CASES["moe_replay_bf16"]])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = [m for m in _metrics(tmp_path) if m["phase"] == "rl"]
    assert [_comparable(m) for m in got] == [_comparable(m) for m in runs("moe_replay_bf16")]


def test_tp2_writes_the_one_process_lines_at_its_leaves(tmp_path):
    """torchrun's 2 ranks as TP 2 (fixed K-leaves, model.tp_leaves = 8; each rank's engine TP 1):
    the dense bf16 multi-turn run's lines equal one process's at the same tp_leaves."""
    extra = [*CASES["qwen3_bf16"], "--model.tp_leaves=8"]
    alone = _train(tmp_path / "alone", extra)
    r = _torchrun(tmp_path / "tp2", [*RL, *extra, "--parallelism.tensor_parallel_degree=2",
                                     "--parallelism.data_parallel_shard_degree=1"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = [m for m in _metrics(tmp_path / "tp2") if m["phase"] == "rl"]
    _exact_turns(got)
    assert [_comparable(m) for m in got] == [_comparable(m) for m in alone]


def test_a_separate_engine_writes_the_colocated_lines_and_one_step_ahead_mixes_no_versions(runs, tmp_path):
    """The GDN hybrid's episodes on an engine process driven by rank 0 (its environments
    answering there): at K = 0 the colocated run's lines; at K = 1 each episode is played on
    one weight version (mixed_version_tokens 0) and is exact against those weights."""
    same = _train(tmp_path / "k0", [*CASES["hybrid_bf16"], *SEPARATE, "--rollout.max_off_policy_steps=0"])
    assert [_comparable(m) for m in same] == [_comparable(m) for m in runs("hybrid_bf16")]
    ahead = _train(tmp_path / "k1", [*CASES["hybrid_bf16"], *SEPARATE, "--rollout.max_off_policy_steps=1",
                                     "--training.steps=3"])
    assert [m["policy_lag"] for m in ahead] == [0, 1, 1]
    for m in ahead:
        assert m["max_abs_dlogp"] == 0.0 and m["mixed_version_tokens"] == 0 and m["turns_per_episode"] > 1, m


def test_the_environments_concurrency_does_not_change_the_rollout(tmp_path):
    """An environment on Python's global random (as textarena's games are): 1 and 4 workers
    sample the same episodes (rollout_sha256), with max |dlogp| 0."""
    env = ["--task.name=tests._envs:GlobalRandomGame", "--task.kwargs={turns = 3, delay_s = 0.01}"]
    one = _train(tmp_path / "w1", [*env, "--rollout.env_workers=1"])
    four = _train(tmp_path / "w4", [*env, "--rollout.env_workers=4"])
    assert [m["rollout_sha256"] for m in one] == [m["rollout_sha256"] for m in four]
    assert all(m["max_abs_dlogp"] == 0.0 and m["turns_per_episode"] == 3 for m in one + four)


def _chat_folder(tmp_path_factory, name, template=None):
    """The debug qwen3 with a tiny BPE and a chat template (ChatML by default)."""
    from test_chat_tasks import _model_folder, _tokenizer

    folder = tmp_path_factory.mktemp(name)
    _model_folder(folder)
    (_tokenizer() if template is None else _tokenizer(chat_template=template)).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def think_folder(tmp_path_factory):
    """The Qwen3-style template that rewrites earlier turns."""
    import _envs

    return _chat_folder(tmp_path_factory, "think_model", _envs.THINK_TEMPLATE)


@pytest.mark.parametrize("task", ["textarena:GuessTheNumber-v0", "tool:basic_arithmetic"])
def test_a_game_and_a_tool_are_exact_on_every_turn(tmp_path_factory, tmp_path, task):
    """textarena's GuessTheNumber (the game answers each guess, also a bad one) and the
    calculator tool (a result comes back as a tool message; a reply without a call ends the
    episode, as a random model's replies mostly do: tests/test_envs_library.py scripts the
    calls) on a chat model, every sampled token exact."""
    folder = _chat_folder(tmp_path_factory, "chatml_model")
    lines = _train(tmp_path, [f"--model.checkpoint={folder}", f"--task.name={task}",
                              "--task.kwargs={max_turns = 3, max_new_tokens = 6}", "--rollout.max_model_len=1024"])
    for m in lines:
        assert m["max_abs_dlogp"] == 0.0 and m["bitwise_fraction"] == 1.0, m
        assert m["samples_per_episode"] == 1 and m["render_breaks"] == 0 and m["turns_per_episode"] >= 1, m
        if task.startswith("textarena"):  # the game asks again after an invalid guess
            assert m["turns_per_episode"] > 1, m


def test_a_template_that_rewrites_earlier_turns_splits_episodes_into_exact_parts(think_folder, tmp_path):
    lines = _train(tmp_path, [f"--model.checkpoint={think_folder}", "--task.name=tests._envs:ChatTurns",
                              "--task.kwargs={turns = 3, max_new_tokens = 6}", "--rollout.max_model_len=256"])
    for m in lines:
        assert m["max_abs_dlogp"] == 0.0 and m["bitwise_fraction"] == 1.0, m
        # every turn after the first opens a new sample on the template's own rendering
        assert m["samples_per_episode"] == m["turns_per_episode"] > 1 and m["render_breaks"] > 0, m
        assert m["rerender_divergence"] == 4  # every episode of the step (2 prompts x 2)


def test_the_eval_cli_plays_held_out_episodes(tmp_path, capsys):
    """python -m titan_rl.eval on a multi-turn environment: n held-out episodes, greedy, each
    with its transcript as the engine saw it (replies and questions), the same on a rerun."""
    import json

    import torch

    from titan_rl.checkpoint import save_hf_folder
    from titan_rl.eval import main
    from titan_rl.models import qwen3

    folder = tmp_path / "model"
    save_hf_folder(qwen3.build("debug").init_weights(3, 0.05), str(folder), dtype=torch.float32)
    args = ["--checkpoint", str(folder), "--task", "digit_turns", "--task-kwargs", '{"turns": 3}', "--n", "4",
            "--max-model-len", "128"]
    docs = []
    for k in range(2):
        assert main([*args, "--json", str(tmp_path / f"e{k}.json")]) == 0
        docs.append(json.loads((tmp_path / f"e{k}.json").read_text()))
    first, again = docs
    assert first["n"] == 4 and len(first["questions"]) == 4
    for q in first["questions"]:
        assert q["turns"] == 3 and q["end"] == "done" and len(q["transcript"]) == 1
        assert q["transcript"][0].startswith("rev:") and q["transcript"][0].count("rev:") == 3
    assert first["questions"] == again["questions"] and first["accuracy"] == again["accuracy"]
