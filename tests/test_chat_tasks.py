"""Chat tasks on the model's own tokenizer (a tiny BPE with a ChatML template, built here
offline), library tasks (reasoning-gym, JSON lines / parquet with math-verify), their
refusals at start, the evaluation CLI, and a short RL run on a chat task with mismatch 0."""

import json
import os
import re
import sys

import pytest
import torch

from titan_rl.tasks import HELD_OUT_SEEDS, ChatTokenizer, eval_seed, extract_answer, load_task
from titan_rl.tasks.library import ANSWER_FORMAT, math_equal

import _zygote

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# <|im_end|> first: id 0, the argmax of all-equal logits (the stop test below); EOS id 1 as
# in the debug models' config.json
SPECIALS = ["<|im_end|>", "<|endoftext|>", "<|im_start|>"]
IM_END, EOS, IM_START = 0, 1, 2
CORPUS = [ANSWER_FORMAT, "State the final answer to the following arithmetic problem: 12 + 7 - 3 =",
          "<answer>42</answer>", "system\nuser\nassistant\n", "What is one half? \\frac{1}{2} = 0.5"]
CHAIN_SUM = {"max_terms": 3, "max_digits": 2, "max_new_tokens": 12}


def _tokenizer(chat_template: str | None = CHATML):
    """A byte-level BPE of ~360 ids trained on a few lines, with ChatML's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", chat_template=chat_template)


def _model_folder(path, vocab_size=1024, zero_norm=False):
    """The debug qwen3 (random weights, fp32) as an HF folder. zero_norm: the final norm's
    weight 0, so every logit is 0 and greedy decoding picks id 0 (<|im_end|>) at once."""
    from dataclasses import replace

    from titan_rl.checkpoint import save_hf_folder
    from titan_rl.models import qwen3

    model = qwen3.build(replace(qwen3.FLAVORS["debug"], vocab_size=vocab_size)).init_weights(7, 0.05)
    if zero_norm:
        with torch.no_grad():
            model.model.norm.weight.zero_()
    save_hf_folder(model, path, dtype=torch.float32)
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """chat: model + tokenizer with a chat template; plain: no template; bare: no tokenizer
    files; small: a 256-id model under the ~360-id tokenizer; stops: chat with zero_norm."""
    root = tmp_path_factory.mktemp("chat_folders")
    out = {name: _model_folder(root / name, **kw) for name, kw in
           [("chat", {}), ("plain", {}), ("bare", {}), ("small", {"vocab_size": 256}), ("stops", {"zero_norm": True})]}
    for name in ("chat", "small", "stops"):
        _tokenizer().save_pretrained(out[name])
    _tokenizer(chat_template=None).save_pretrained(out["plain"])
    return out


# ---------------------------------------------------------------------------- the tokenizer
def test_render_stop_ids_and_decode(folders, tmp_path):
    tok = ChatTokenizer.from_folder(folders["chat"])
    assert tok.vocab_size == len(tok.hf) < 1024
    assert (tok.eos_id, tok.end_of_turn_id, tok.pad_id) == (EOS, IM_END, EOS)
    assert tok.stop_ids == [EOS, IM_END]  # EOS, then the token the template closes a reply with
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12 + 7 ="}]
    ids = tok.render(messages)
    assert ids == tok.hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == IM_START and ids.count(IM_END) == 2
    assert tok.hf.decode(ids).endswith("12 + 7 =<|im_end|>\n<|im_start|>assistant\n")
    answer = tok.encode("<answer>19</answer>")
    assert tok.decode(answer + [IM_END] + answer) == "<answer>19</answer>"  # stops at the end of turn
    assert tok.decode(answer + [EOS] + answer) == "<answer>19</answer>"  # and at EOS
    assert tok.decode([*answer[:2], 1000, *answer[2:]]) == tok.decode(answer[:2]) + "\ufffd" + tok.decode(answer[2:])
    with pytest.raises(ValueError, match="outside the tokenizer"):
        tok.decode([1000], errors="strict")
    # generation_config.json's EOS list (how HF folders name extra stop ids) joins them
    import shutil

    copy = tmp_path / "gen"
    shutil.copytree(folders["chat"], copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 5]}))
    assert ChatTokenizer.from_folder(str(copy)).stop_ids == [EOS, IM_END, 5]


def test_extract_answer_rule():
    assert extract_answer("<answer>1</answer> then <answer> 7 </answer> 9", "7") == "7"  # the last tag pair
    assert extract_answer("12 + 7 = 19.\nSo -3.5 it is", "-4") == "-3.5"  # numeric reference: the last number
    assert extract_answer("no digits here", "3") == ""
    assert extract_answer("thinking\n  Paris  \n\n", "Paris") == "Paris"  # otherwise the last non-empty line
    assert extract_answer("", "x") == ""


# ---------------------------------------------------------------------------- reasoning-gym
def test_reasoning_gym_task_end_to_end(folders):
    task = load_task("reasoning_gym:chain_sum", checkpoint=folders["chat"], **CHAIN_SUM)
    tok = task.tokenizer
    examples = task.sample(4, seed=11)
    assert [e.prompt_ids for e in task.sample(4, seed=11)] == [e.prompt_ids for e in examples]  # pure in seed
    assert [e.prompt_ids for e in task.sample(2, seed=11)] == [e.prompt_ids for e in examples[:2]]  # a prefix
    held_out = task.sample(4, seed=eval_seed(0))
    assert eval_seed(0) == HELD_OUT_SEEDS and {e.prompt_text for e in held_out} != {e.prompt_text for e in examples}
    ex = examples[0]
    assert ex.prompt_text.startswith("State the final answer") and ex.meta["answer"] == ex.answer
    assert ex.prompt_ids == tok.render([{"role": "system", "content": ANSWER_FORMAT},
                                        {"role": "user", "content": ex.prompt_text}])
    target = task.target_ids(ex)
    assert target[-1] == IM_END and tok.decode(target) == f"<answer>{ex.answer}</answer>"
    assert task.reward(ex, target) == 1.0
    assert task.reward(ex, tok.encode(f"The sum is {ex.answer}") + [IM_END]) == 1.0  # numeric fallback
    wrong = str(int(ex.answer) + 1)
    assert task.reward(ex, tok.encode(f"<answer>{wrong}</answer>")) < 1.0
    assert task.reward(ex, tok.encode("<answer>not a number</answer>")) < 1.0
    raw = load_task("reasoning_gym:chain_sum", checkpoint=folders["chat"], chat=False, system="", **CHAIN_SUM)
    ex = raw.sample(1, seed=11)[0]
    assert ex.prompt_ids == tok.encode(ex.prompt_text) and raw.target_ids(ex)[-1] == EOS


def test_reasoning_gym_refusals(folders):
    with pytest.raises(ValueError, match=r"no dataset 'chain_sun'; close names: chain_sum"):
        load_task("reasoning_gym:chain_sun", checkpoint=folders["chat"])
    with pytest.raises(ValueError, match=r"refuses task.kwargs \{'max_terms': 0\}.*config keys: min_terms, max_terms"):
        load_task("reasoning_gym:chain_sum", checkpoint=folders["chat"], max_terms=0)
    with pytest.raises(ValueError, match="may not set seed"):
        load_task("reasoning_gym:chain_sum", checkpoint=folders["chat"], seed=3)
    with pytest.raises(ValueError, match="names no dataset"):
        load_task("reasoning_gym:", checkpoint=folders["chat"])


# ---------------------------------------------------------------------------- data files
ROWS = [{"prompt": f"What is {k} halves?", "answer": f"\\frac{{{k}}}{{2}}"} for k in range(1, 19)] + [
    {"messages": [{"role": "user", "content": "Capital of France?"}], "answer": "Paris"},
    {"prompt": "2 + 2 =", "answer": 4}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_task_scores_with_math_verify(folders, tmp_path, monkeypatch):
    path = _jsonl(tmp_path / "rows.jsonl", ROWS)
    task = load_task(f"jsonl:{path}", checkpoint=folders["chat"], eval_fraction=0.2)
    assert len(task.held_out_rows) == 4 and len(task.train_rows) == 16  # round(0.2 x 20 distinct prompts)
    train = {e.prompt_text for e in task.sample(64, seed=5)}
    held = {e.prompt_text for e in task.sample(8, seed=eval_seed(0))}
    assert len(held) == 4 and not train & held  # held-out seeds draw the held-out rows only
    assert [e.prompt_ids for e in task.sample(3, seed=5)] == [e.prompt_ids for e in task.sample(64, seed=5)[:3]]
    tok = task.tokenizer
    half = next(e for e in task.sample(64, seed=5) + task.sample(4, seed=eval_seed(0)) if e.answer == "\\frac{1}{2}")
    assert task.reward(half, tok.encode("<answer>0.5</answer>") + [IM_END]) == 1.0  # math-verify's equivalence
    assert task.reward(half, tok.encode("It is 1/2")) == 1.0  # the last line, parsed by math-verify
    assert task.reward(half, tok.encode("<answer>0.25</answer>")) == 0.0
    assert math_equal("Paris", " Paris ") and not math_equal("Paris", "Rome")
    monkeypatch.setitem(sys.modules, "math_verify", None)  # not installed: exact strings only
    assert not math_equal("\\frac{1}{2}", "0.5") and math_equal("\\frac{1}{2}", "\\frac{1}{2}")


def test_jsonl_rows_and_parquet(folders, tmp_path):
    rows = _jsonl(tmp_path / "rows.jsonl", ROWS)
    task = load_task(f"jsonl:{rows}", checkpoint=folders["chat"], eval_fraction=0.0)
    paris = next(e for e in task.sample(200, seed=1) if e.answer == "Paris")  # a row of chat messages
    assert paris.prompt_ids == task.tokenizer.render([{"role": "user", "content": "Capital of France?"}])
    with pytest.raises(ValueError, match=r"no held-out rows .* eval_fraction > 0"):
        task.sample(1, seed=eval_seed(0))
    bad = _jsonl(tmp_path / "bad.jsonl", ROWS[:2] + [{"prompt": "x"}])
    with pytest.raises(ValueError, match=r"line 3 needs a reference answer 'answer'"):
        load_task(f"jsonl:{bad}", checkpoint=folders["chat"])
    pandas = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    parquet = tmp_path / "rows.parquet"
    plain = [{"prompt": r["prompt"], "answer": str(r["answer"])} for r in ROWS if "prompt" in r]
    pandas.DataFrame(plain).to_parquet(parquet)
    from_parquet = load_task(f"parquet:{parquet}", checkpoint=folders["chat"])
    from_jsonl = load_task(f"jsonl:{_jsonl(tmp_path / 'p.jsonl', [r for r in ROWS if 'prompt' in r])}",
                           checkpoint=folders["chat"])
    assert [e.prompt_ids for e in from_parquet.sample(5, 3)] == [e.prompt_ids for e in from_jsonl.sample(5, 3)]


# ---------------------------------------------------------------------------- refusals at start
@pytest.mark.parametrize("case", ["no_checkpoint", "no_template", "no_tokenizer", "vocab", "unknown_dataset"])
def test_refused_at_start_in_one_line(folders, case, tmp_path, capsys):
    from titan_rl.train import main as train_main

    task = ["--task.name=reasoning_gym:chain_sum", "--task.kwargs={max_new_tokens = 8}"]
    args, pattern = {
        "no_checkpoint": (task, r"task.name = 'reasoning_gym:chain_sum': task .* read from model.checkpoint, which "
                                r"is not set"),
        "no_template": ([f"--model.checkpoint={folders['plain']}", *task],
                        r"has no chat template .* set chat = false in task.kwargs"),
        "no_tokenizer": ([f"--model.checkpoint={folders['bare']}", *task],
                         r"the model folder '.*bare' \(model.checkpoint\) has no tokenizer files \(one of "
                         r"tokenizer.json"),
        "vocab": ([f"--model.checkpoint={folders['small']}", *task],
                  r"needs \d+ token ids \(the tokenizer in model.checkpoint = .*\); the model's vocab_size is 256"),
        "unknown_dataset": ([f"--model.checkpoint={folders['chat']}", "--task.name=reasoning_gym:chain_sums"],
                            r"no dataset 'chain_sums'; close names: chain_sum"),
    }[case]
    assert train_main(["--run-dir", str(tmp_path / "run"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ") and re.search(pattern, err), err
    assert not (tmp_path / "run" / "config.toml").exists()


# ---------------------------------------------------------------------------- evaluation
def test_eval_cli_runs_and_reruns_the_same(folders, tmp_path, capsys):
    from titan_rl.eval import main as eval_main

    args = ["--checkpoint", folders["chat"], "--task", "reasoning_gym:chain_sum", "--task-kwargs",
            json.dumps(CHAIN_SUM), "--n", "4", "--seed", "3"]
    r = _zygote.run([sys.executable, "-m", "titan_rl.eval", *args, "--json", str(tmp_path / "a.json")], env=ENV,
                    capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert re.search(r"questions +accuracy +mean reward +mean length\n +4 ", r.stdout), r.stdout
    a = json.loads((tmp_path / "a.json").read_text())
    assert 0.0 <= a["accuracy"] <= 1.0 and a["n"] == 4 and a["architecture"] == "qwen3" and a["dtype"] == "float32"
    assert a["response_length"] > 1 and len(a["questions"]) == 4
    assert eval_main([*args, "--json", str(tmp_path / "b.json")]) == 0  # the rerun, in this process
    b = json.loads((tmp_path / "b.json").read_text())
    same = ("accuracy", "reward_mean", "response_length", "questions")
    assert {k: a[k] for k in same} == {k: b[k] for k in same}
    # all logits equal: greedy emits id 0, <|im_end|> (not EOS), and the engine stops there
    assert eval_main([*args[:1], folders["stops"], *args[2:], "--json", str(tmp_path / "c.json")]) == 0
    c = json.loads((tmp_path / "c.json").read_text())
    assert c["response_length"] == 1.0 and {q["completion"] for q in c["questions"]} == {""}
    capsys.readouterr()
    assert eval_main([*args[:1], folders["bare"], *args[2:]]) == 2
    assert re.fullmatch(r"error: --task = 'reasoning_gym:chain_sum': the model folder '.*bare' "
                        r"\(model.checkpoint\) has no tokenizer files .*", capsys.readouterr().err.strip())


RL_RUN = ["--task.name=reasoning_gym:chain_sum", "--task.kwargs={max_terms = 3, max_digits = 2, max_new_tokens = 8}",
          "--training.steps=3", "--algorithm.sft_steps=1", "--algorithm.sft_batch=4", "--algorithm.prompts_per_step=2",
          "--algorithm.group_size=2", "--lr_scheduler.warmup_steps=1", "--checkpoint.enable=false",
          "--rollout.max_model_len=256"]


def _train(run_dir, folder, extra=()):
    cmd = [sys.executable, "-m", "titan_rl.train", "--run-dir", str(run_dir), f"--model.checkpoint={folder}", *RL_RUN,
           *extra]
    r = _zygote.run(cmd, env=ENV, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def evaluated_run(folders, tmp_path_factory):
    run = tmp_path_factory.mktemp("chat_run")
    return run, _train(run, folders["chat"], ["--eval.interval=1", "--eval.n=2", "--checkpoint.enable=true",
                                              "--checkpoint.interval=3"])


def test_eval_of_a_run_dir_is_the_runs_own_held_out_line(evaluated_run, capsys):
    """`python -m titan_rl.eval --checkpoint RUN_DIR`: the newest checkpoint exported in the run's
    dtype, the run's own task: the same greedy answers as the run's last evaluation (same
    questions, same weights, same engine)."""
    from titan_rl.eval import evaluate, _parse
    from titan_rl.run_dir import read_metrics

    run, _ = evaluated_run
    last = [m for m in read_metrics(str(run)) if m["phase"] == "eval"][-1]
    assert last["weights_step"] == 3
    doc = evaluate(_parse(["--checkpoint", str(run), "--n", "2", "--seed", "0"]))
    assert doc["task"] == "reasoning_gym:chain_sum" and doc["checkpoint"] == str(run)
    assert (doc["accuracy"], doc["reward_mean"], doc["response_length"]) == \
        (last["eval_accuracy"], last["eval_reward_mean"], last["eval_response_length"])


def test_rl_run_on_a_chat_task_has_zero_mismatch_and_logs_eval_accuracy(evaluated_run):
    from titan_rl.run_dir import read_metrics

    run, r = evaluated_run
    lines = read_metrics(str(run))
    assert [(m["step"], m["phase"]) for m in lines] == [(1, "sft"), (2, "eval"), (2, "rl"), (2, "eval"), (3, "rl"),
                                                        (3, "eval")]
    rl = [m for m in lines if m["phase"] == "rl"]
    assert all(m["max_abs_dlogp"] == 0.0 and m["bitwise_fraction"] == 1.0 for m in rl), rl
    evals = [m for m in lines if m["phase"] == "eval"]
    assert [m["weights_step"] for m in evals] == [1, 2, 3]  # before the first RL step, then after each sync
    assert all(0.0 <= m["eval_accuracy"] <= 1.0 and m["eval_n"] == 2 for m in evals)
    assert "eval accuracy" in r.stdout and "max |dlogp| 0 over 2 rl steps" in r.stdout
    assert "held-out accuracy" in r.stdout.strip().splitlines()[-1]  # the summary line
    assert r.stderr.strip() == "", r.stderr


@pytest.mark.slow
def test_evaluating_does_not_change_the_run(evaluated_run, folders, tmp_path):
    """Greedy evaluations through the run's engine between steps leave its rollouts and
    updates as they were: the same lines as a run without [eval], wall clock aside."""
    from titan_rl.run_dir import comparable, read_metrics

    run, _ = evaluated_run
    _train(tmp_path, folders["chat"])
    with_eval = [comparable(m) for m in read_metrics(str(run)) if m["phase"] != "eval"]
    assert with_eval == [comparable(m) for m in read_metrics(str(tmp_path))]
