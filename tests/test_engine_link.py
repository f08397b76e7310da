"""The RL loop's engine link (titan_rl/rl/engine_link.py) against a real in-process vLLM
engine: it refuses an engine built with another bit-relevant choice than the trainer's
(dtype, tp_leaves, quantization recipe, kernel mode: the real engine is built so, the
contract is not patched), and after a sync it compares what the engine holds with what
the trainer's forward uses, per tensor, naming a tensor that differs (dense and quantized).
No TorchTitan here: the link is given a trainer-side model directly."""

import json
import os

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from titan_rl import config  # noqa: E402
from titan_rl.contract import ContractMismatch  # noqa: E402
from titan_rl.errors import RunStopped  # noqa: E402
from titan_rl.registry import get_architecture  # noqa: E402
from titan_rl.rl.engine_link import ColocatedEngine  # noqa: E402
from titan_rl.rl.ranks import Ranks  # noqa: E402
from titan_rl.vllm import engine as engine_mod  # noqa: E402
from titan_rl.vllm.engine import engine_model  # noqa: E402
from titan_rl.vllm.model import TitanForCausalLM  # noqa: E402

SMALL = ["--rollout.kv_cache_mib=32", "--rollout.max_model_len=64", "--rollout.max_num_seqs=4",
         "--algorithm.prompts_per_step=2", "--algorithm.group_size=2"]


def _link(tmp_path, seed, *overrides, model=None):
    cfg = config.load(None, [*SMALL, *overrides])
    if model is None:
        model = get_architecture(cfg.model.name).build(cfg.model.flavor, cfg.model_options()).init_weights(seed, 0.05)
    model = model.to(torch.float32 if cfg.model.dtype == "float32" else torch.bfloat16)
    return ColocatedEngine(cfg, str(tmp_path), model, model.lm_head.weight.dtype, Ranks(), "collective"), model


def _sample(link):
    reqs = [{"prompt_token_ids": [2, 3, 5, 7, 11]}, {"prompt_token_ids": [13, 17]}]
    params = [SamplingParams(max_tokens=4, logprobs=0, seed=i, ignore_eos=True) for i in range(2)]
    return link.sample(reqs, params, kept_sets=False, routes=False)


def _built_otherwise(monkeypatch, change):
    """make_llm builds the real engine with one choice changed (`change(folder, kwargs)`)."""
    real = engine_mod.make_llm

    def make_llm(folder, **kwargs):
        change(folder, kwargs)
        return real(folder, **kwargs)

    monkeypatch.setattr(engine_mod, "make_llm", make_llm)


def _edit_config(folder, **keys):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        d = json.load(f)
    d.update(keys)
    with open(path, "w") as f:
        json.dump(d, f)


@pytest.mark.parametrize("case, message", [
    ("dtype", r"dtype \(trainer 'float32', engine 'bfloat16'\)"),
    ("tp_leaves", r"tp_leaves \(trainer 0, engine 2\)"),
    ("recipe", r"quantization \(trainer 'none', engine 'fp8_rowwise:attention,mlp,experts,linear_attention'\)"),
    ("kernels", r"kernels \(trainer 'exact', engine 'stock'\)"),
], ids=["dtype", "tp_leaves", "recipe", "kernels"])
def test_an_engine_built_otherwise_is_refused_by_name(tmp_path, monkeypatch, seed, case, message):
    changes = {
        "dtype": lambda folder, kw: kw.update(dtype="bfloat16"),
        "tp_leaves": lambda folder, kw: _edit_config(folder, titan_tp_leaves=2),
        "recipe": lambda folder, kw: _edit_config(folder, titan_quantization={
            "recipe": "fp8_rowwise", "layers": ["attention", "mlp", "experts", "linear_attention"]}),
        "kernels": lambda folder, kw: kw.update(kernels="stock"),
    }
    _built_otherwise(monkeypatch, changes[case])
    link, _ = _link(tmp_path, seed, "--model.dtype=\"float32\"")
    with pytest.raises(ContractMismatch, match=r"execution contract before the first rollout: trainer and engine "
                                               r"differ in .*" + message):
        _sample(link)
    assert link.llm is not None  # the engine was really built, then refused
    del link


@pytest.mark.parametrize("recipe", ["none", "fp8_rowwise"])
def test_a_sync_that_leaves_the_engine_other_weights_stops_naming_the_tensor(tmp_path, monkeypatch, seed, recipe):
    link, model = _link(tmp_path, seed, "--model.dtype=\"bfloat16\"", f"--quantization.recipe=\"{recipe}\"")
    _sample(link)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    assert link.sync(step=1) is True  # the engine holds exactly the trainer's forward operands
    bad = "model.layers.2.mlp.up_proj.weight"
    real = TitanForCausalLM.load_weights

    def corrupting_load(self, weights):
        loaded = real(self, weights)
        mod = self.get_submodule(bad.removesuffix(".weight"))
        with torch.no_grad():
            if mod.packed_rows is not None:  # the quantized GEMM reads its packed payload: its (row 0, k 0) code
                pq, start, _ = mod.packed_rows
                pq.packed[start // 32, 0, 2 * (start % 32)] ^= 1  # fp8 layout: [block][k-pair][column][k parity]
            elif mod.qweight is not None:  # quantized, dense form: one payload element of the engine's own copy
                mod.qweight.payload.view(torch.uint8).view(-1)[7] ^= 1
            else:
                mod.weight.view(-1)[7] += 1.0
        return loaded

    monkeypatch.setattr(TitanForCausalLM, "load_weights", corrupting_load)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    with pytest.raises(RunStopped, match=rf"weights after the weight sync of step 2: the engine holds other weights "
                                         rf"than the trainer's forward uses: {bad.replace('.', '[.]')} \("):
        link.sync(step=2)
    held = engine_model(link.llm).get_submodule(bad.removesuffix(".weight"))
    assert (held.qweight is not None) == (recipe != "none")  # quantized: the engine's own payload was hit
    del link
