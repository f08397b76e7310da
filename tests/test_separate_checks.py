"""A separate engine (its own process, titan_rl/rl/separate_engines.py) built otherwise than the
trainer is refused before the first rollout, in one line naming the entry: the contract the
trainer checks is the one the engine computes in its process (titan_rl.vllm.worker_extension), so
these tests build the real engine process differently (its dtype, its folder's tp_leaves or
recipe, or the CPU kind its process runs as, which changes its kernels' build flags and its
platform choices) and see the trainer's check fail. The control case, an engine built as the
trainer is, passes the same check and samples. No TorchTitan: the link is given a trainer-side
model directly, as in tests/test_engine_link.py."""

import dataclasses
import re

import pytest
import torch

pytest.importorskip("vllm")

from _folders import edit_config_in_place  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from titan_rl.rl.requests import prompt_episodes
from titan_rl import config  # noqa: E402
from titan_rl.contract import ContractMismatch  # noqa: E402
from titan_rl.kernels.cpu_features import MASKED_ENV  # noqa: E402
from titan_rl.registry import get_architecture  # noqa: E402
from titan_rl.rl.ranks import Ranks  # noqa: E402
from titan_rl.rl.separate_engines import SeparateEngines  # noqa: E402
from titan_rl.vllm import engine as engine_mod  # noqa: E402

SMALL = ["--rollout.kv_cache_mib=32", "--rollout.max_model_len=64", "--rollout.max_num_seqs=4",
         "--algorithm.prompts_per_step=2", "--algorithm.group_size=2", "--rollout.placement=\"separate\"",
         "--model.dtype=\"float32\""]


def _masked_process(folder, kw, monkeypatch):
    # the engine's process starts as an AVX2-only machine (kernels/cpu_features.py): its
    # compiled kernels are built with other flags, and its platform choices are the AVX2 ones
    for k, v in MASKED_ENV.items():
        monkeypatch.setenv(k, v)


def _built_otherwise(folder, kw, mp):
    # three bit-relevant choices changed in one engine (one engine process start, not three):
    # its refusal must name each entry, with each side's value
    kw.update(dtype="bfloat16")
    edit_config_in_place(folder, titan_tp_leaves=2, titan_quantization={
        "recipe": "fp8_rowwise", "layers": ["attention", "mlp", "experts", "linear_attention"]})


CASES = {
    "same": (lambda folder, kw, mp: None, None),
    "dtype+tp_leaves+recipe": (_built_otherwise, [r"dtype \(trainer 'float32', engine 'bfloat16'\)",
                                                  r"tp_leaves \(trainer 0, engine 2\)",
                                                  r"quantization \(trainer 'none', engine 'fp8_rowwise:"]),
    "cpu_kind": (_masked_process, [r"platform\.cpu_capability \(trainer .*\)", r"source\.csrc \(trainer "]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_separate_engine_built_otherwise_is_refused_by_name(tmp_path, monkeypatch, seed, case):
    """Each engine start is tens of seconds, so one engine is built otherwise in three choices
    (the contract compares entry by entry: each differing entry is named with both values)."""
    change, messages = CASES[case]
    if case == "cpu_kind" and not torch.cpu._is_avx512_supported():
        pytest.skip("an AVX2-only CPU: the masked engine would be this machine's own kind")
    real = engine_mod.make_llm

    def make_llm(folder, settings):
        kwargs = dataclasses.asdict(settings)
        change(folder, kwargs, monkeypatch)
        return real(folder, engine_mod.EngineSettings(**kwargs))

    monkeypatch.setattr(engine_mod, "make_llm", make_llm)
    cfg = config.load(None, SMALL)
    model = get_architecture(cfg.model.name).build(cfg.model.flavor, cfg.model_options()).init_weights(seed, 0.05)
    link = SeparateEngines(cfg, str(tmp_path), model, torch.float32, Ranks(), "collective")
    params = [SamplingParams(max_tokens=4, logprobs=0, seed=i, ignore_eos=True) for i in range(2)]
    reqs = [{"prompt_token_ids": [2, 3, 5, 7, 11]}, {"prompt_token_ids": [13, 17]}]
    try:
        if messages is None:  # the control: the same check passes and the engine samples
            rollout, _, version = link.collect(link.submit(1, prompt_episodes([r["prompt_token_ids"] for r in reqs], params)))
            assert len(rollout.tokens) == 2 and version == 0
            return
        with pytest.raises(ContractMismatch, match=r"execution contract before the first rollout \(engine 0\): "
                                                   r"trainer and engine differ in ") as e:
            link.submit(1, prompt_episodes([r["prompt_token_ids"] for r in reqs], params))
        listed = str(e.value).split("differ in ", 1)[1]
        for message in messages:
            assert re.search(message, listed), (message, str(e.value))
        assert "\n" not in str(e.value)
        assert link.engines, "the engine process was really built, then refused"
    finally:
        link.close()
