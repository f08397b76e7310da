"""The execution contract (titan_rl.contract): the same model gives the same hash, a
deliberately changed entry is refused by name, the canonical JSON is stable, stock mode
reports the op entries it differs in by design, and the trainer's check refuses a
perturbed engine side. No vLLM: the engine side is built from the same pieces."""

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from titan_rl import contract
from titan_rl.contract import OPS, Contract, ContractMismatch, canonical_json, check, contract_of, diff
from titan_rl.models import qwen3
from titan_rl.registry import get_architecture
from titan_rl.models.options import ModelOptions
from titan_rl.errors import RunStopped

OP_ENTRIES = {f"op.{n}" for n in (*OPS, "attention", "fuse_same_input")}


def _model(kernels="exact", **options):
    return qwen3.build("debug", ModelOptions(kernels=kernels, **options))


@pytest.fixture(scope="module")
def base():
    return contract_of(_model())


def test_same_model_same_hash(base):
    again = contract_of(_model())
    assert again == base and again.hash == base.hash and diff(base, again) == [] and check(base, again) == []
    # the engine builds the model from config.json: the same contract, tp_leaves included
    spec = get_architecture("qwen3")
    trainer = _model(tp_leaves=2)
    config_json = {**trainer.cfg.hf_config(), **trainer.options.to_hf()}
    engine = spec.build(spec.config_from_hf(config_json), ModelOptions.from_hf(config_json))
    assert contract_of(engine) == contract_of(trainer)


def test_entries_name_what_the_model_computes_with(base):
    e = base.entries()
    assert e["arch"] == "qwen3" and e["kernels"] == "exact" and e["dtype"] == "float32" and e["tp_leaves"] == 0
    assert e["op.linear"] == "titan_rl.kernels.matmul.torch_impl.linear"
    assert e["op.attention"] == "titan_rl.kernels.attention.torch_impl"
    assert e["op.fuse_same_input"] is True
    assert e["selfcheck"] == "passed" and "torch_threads" not in e["platform.threads"]
    assert e["gradient_leaves"] == "none" and e["quantization"] == "none"
    assert e["version.torch"] == torch.__version__
    assert all(e[f"version.{p}"] for p in contract.PACKAGES)
    assert len(e["source.kernels"]) == len(e["source.csrc"]) == 64
    assert base.hash == hashlib.sha256(canonical_json(e).encode()).hexdigest()
    assert base.record() == {"hash": base.hash, "entries": e}


def test_canonical_json_is_stable():
    c = Contract(arch="qwen3", model_config="m", kernels="exact", dtype="float32", tp_leaves=2,
                 ops={"linear": "f", "fuse_same_input": True}, sources={"kernels": "k"},
                 platform={"torch_threads": 1}, selfcheck="passed", versions={"torch": "2"})
    assert c.to_json() == (
        '{"arch":"qwen3","dtype":"float32","gradient_leaves":"none","kernels":"exact","model_config":"m",'
        '"op.fuse_same_input":true,"op.linear":"f","platform.torch_threads":1,"quantization":"none",'
        '"selfcheck":"passed","source.kernels":"k","tp_leaves":2,"version.torch":"2"}')
    assert c.hash == hashlib.sha256(c.to_json().encode()).hexdigest()
    assert canonical_json({"b": 1, "a": "x"}) == canonical_json({"a": "x", "b": 1})
    with pytest.raises(TypeError, match="'eps' = 1e-06"):
        canonical_json({"eps": 1e-6})


def test_hash_is_the_same_in_a_fresh_process(base):
    code = ("import torch; torch.set_num_threads({}); from titan_rl.contract import contract_of; "
            "from titan_rl.models import qwen3; print(contract_of(qwen3.build('debug')).to_json())")
    r = subprocess.run([sys.executable, "-c", code.format(torch.get_num_threads())], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONHASHSEED="123"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.split("\n")[-2]) == json.loads(base.to_json())


def _refused(trainer_side, engine_side):
    with pytest.raises(ContractMismatch) as e:
        check(trainer_side, engine_side, when="before the first rollout")
    return str(e.value)


def test_dtype_is_refused_by_name(base):
    engine = contract_of(_model(), dtype=torch.bfloat16)
    assert diff(base, engine) == ["dtype"]
    msg = _refused(base, engine)
    assert "before the first rollout: trainer and engine differ in dtype (trainer 'float32', engine 'bfloat16')" in msg


def test_tp_leaves_is_refused_by_name(base):
    engine = contract_of(_model(tp_leaves=4))
    assert diff(base, engine) == ["tp_leaves"]
    assert "tp_leaves (trainer 0, engine 4)" in _refused(base, engine)


def test_thread_count_is_not_bit_relevant_and_the_self_check_proves_it(base):
    """The contract no longer records the thread count: the self-check compares every probed
    op at 1, 2 and the current count, and a kernel whose bits move with threads is refused."""
    from titan_rl.kernels import linear, selfcheck

    from _threads import threads

    with threads(1 if torch.get_num_threads() != 1 else 2):
        other = contract_of(_model())
    assert diff(base, other) == [] and other.hash == base.hash

    def threaded_linear(x, w):  # row-invariant, but its bits depend on the thread count
        return linear(x, w) * (1 + torch.get_num_threads() * 2.0**-20)

    with pytest.raises(selfcheck.PlatformNotInvariant, match=r"other bits at \d torch threads than at"):
        selfcheck.check_platform(torch.float32, ops={"linear": threaded_linear})


@pytest.mark.parametrize("which", ["kernels", "csrc"])
def test_a_changed_source_hash_is_refused_by_name(base, monkeypatch, which):
    real = contract.kernel_sources()
    monkeypatch.setattr(contract, "kernel_sources", lambda: {**real, which: "0" * 64})
    engine = contract_of(_model())
    assert diff(base, engine) == [f"source.{which}"]
    assert f"source.{which} (trainer '{real[which]}', engine '{'0' * 64}')" in _refused(base, engine)


def test_kernel_mode_is_refused_by_name(base):
    assert diff(base, replace(base, kernels="stock")) == ["kernels"]
    assert "kernels (trainer 'exact', engine 'stock')" in _refused(base, replace(base, kernels="stock"))
    stock = contract_of(_model("stock"))  # a stock model also calls other functions
    assert set(diff(base, stock)) == {"kernels", "selfcheck"} | OP_ENTRIES
    _refused(base, stock)


@pytest.mark.parametrize("entry, change", [
    ("quantization", {"quantization": "int8"}),
    ("model_config", {"model_config": "0" * 64}),
    ("selfcheck", {"selfcheck": "failed: linear"}),
])
def test_other_entries_are_refused_by_name(base, entry, change):
    assert diff(base, replace(base, **change)) == [entry]
    assert f"differ in {entry} (" in _refused(base, replace(base, **change))


def test_gradient_leaves_are_the_trainers_alone_but_change_its_hash(base):
    """The engine computes no gradients: the trainer's reduction is not compared with the
    engine's entry, but two trainers that reduce differently have different hashes."""
    trainer = replace(base, gradient_leaves="8 leaves, fixed tree")
    assert diff(trainer, base) == ["gradient_leaves"]
    assert check(trainer, base) == []
    assert trainer.hash != replace(base, gradient_leaves="collective").hash != base.hash


def test_a_changed_version_is_refused_by_name(base):
    engine = replace(base, versions={**base.versions, "vllm": "0.0.1"})
    assert diff(base, engine) == ["version.vllm"]
    assert "version.vllm" in _refused(base, engine)


def test_stock_mode_reports_the_op_entries_and_refuses_the_rest():
    trainer = contract_of(_model("stock"), dtype=torch.bfloat16)
    assert trainer.kernels == "stock" and trainer.selfcheck == contract.STOCK_SELFCHECK and trainer.tp_leaves == 0
    # the engine side of a stock engine: vLLM's built-in model, read from its HF config and parameters
    hf = SimpleNamespace(architectures=["Qwen3ForCausalLM"], to_dict=lambda: _model().cfg.hf_config())
    builtin = torch.nn.Linear(4, 4)
    engine = contract.builtin_contract(SimpleNamespace(hf_config=hf, dtype=torch.bfloat16), builtin)
    assert engine.ops["linear"] == "vllm built-in torch.nn.modules.linear.Linear"
    assert check(trainer, engine) == sorted(OP_ENTRIES)
    engine32 = contract.builtin_contract(SimpleNamespace(hf_config=hf, dtype=torch.float32), builtin)
    msg = _refused(trainer, engine32)
    assert "dtype (trainer 'bfloat16', engine 'float32')" in msg and "op.linear" not in msg


def _trainer(model):
    """The trainer's engine link with only what its contract check reads (no TorchTitan, no engine)."""
    from titan_rl.rl.engine_link import ColocatedEngine
    from titan_rl.rl.ranks import Ranks

    return ColocatedEngine(None, "", model, torch.float32, Ranks(), "4 leaves, fixed tree")


def test_trainer_logs_the_contract_and_refuses_a_perturbed_engine(monkeypatch):
    model = _model()
    t = _trainer(model)
    from titan_rl.vllm import engine_contract

    monkeypatch.setattr(engine_contract, "engine_contract", lambda llm: contract_of(model))
    t._check_contract("before the first rollout")
    first, second = t.contract_metrics(), t.contract_metrics()
    mine = contract_of(model, gradient_leaves="4 leaves, fixed tree")  # the trainer's side has its reduction
    assert first["contract"] == second["contract"] == mine.hash
    assert first["contract_entries"] == mine.entries()  # entries when the hash changes only
    assert "contract_entries" not in second and "contract_differs" not in first
    monkeypatch.setattr(engine_contract, "engine_contract", lambda llm: contract_of(_model(tp_leaves=2)))
    with pytest.raises(ContractMismatch, match=r"after the weight sync of step 3: trainer and engine differ in "
                                               r"tp_leaves \(trainer 0, engine 2\)\. The engine would not"):
        t._check_contract("after the weight sync of step 3")
    assert issubclass(ContractMismatch, RunStopped)  # titan_rl.train: one line, exit code 1
