"""The kernel dispatcher (kernels/dispatch.py): one table, per op and device; the Ops, the
self-check and the execution contract all follow its choice. Running the Triton column
end to end is tests/test_triton_kernels.py's and tests/test_triton_glm5.py's (they need the
interpreter)."""

import pytest
import torch

import titan_rl.kernels as K
from titan_rl.contract import contract_of
from titan_rl.kernels import dispatch, selfcheck
from titan_rl.models import qwen3


def test_cpu_runs_torch_impl_and_cuda_triton_impl():
    for op in dispatch.TABLE:
        cpu = dispatch.implementation(op, "cpu")
        assert ".torch_impl" in cpu.__module__, op
        cuda = dispatch.implementation(op, "cuda")
        assert ".triton_impl" in cuda.__module__, op
    assert all("triton" in forms for forms in dispatch.TABLE.values())  # every op has a GPU form
    assert set(dispatch.choices("cuda")) == set(dispatch.TABLE)
    assert dispatch.backend_for("cpu") == "torch" and dispatch.backend_for(torch.device("cuda", 0)) == "triton"
    assert dispatch.choices("cpu")["linear"] == "titan_rl.kernels.matmul.torch_impl.linear"


def test_refusals_name_what_is_allowed(monkeypatch):
    with pytest.raises(ValueError, match="'mps'.*supported"):
        dispatch.backend_for("mps")
    with pytest.raises(ValueError, match="'cuda_graph'.*allowed"):
        with dispatch.use_backend("cuda_graph"):
            pass
    with pytest.raises(KeyError, match="'conv'"):
        dispatch.Dispatched("conv")
    # the one place Dispatched objects are made: every op of the table, bound in dispatch.py
    assert {name for name, v in vars(dispatch).items() if isinstance(v, dispatch.Dispatched)} == set(dispatch.TABLE)
    # an op without a form for a device says so by name (every op has both forms today)
    monkeypatch.setitem(dispatch.TABLE, "cpu_only_probe", {"torch": "matmul.torch_impl:tree_sum"})
    with pytest.raises(NotImplementedError, match="'cpu_only_probe' has no 'triton' implementation"):
        dispatch.implementation("cpu_only_probe", "cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with dispatch.use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.backend_for("cpu")


def test_dispatched_op_calls_what_the_table_holds_at_call_time(monkeypatch, rng):
    from titan_rl.kernels.rmsnorm import torch_impl as rn

    x, w = torch.randn(5, 24, generator=rng), torch.ones(24)
    assert torch.equal(K.rms_norm(x, w, 1e-6), rn.rms_norm(x, w, 1e-6))
    calls = []
    monkeypatch.setattr(rn, "rms_norm", lambda *a: calls.append(a) or a[0])
    K.rms_norm(x, w, 1e-6)
    assert len(calls) == 1


def test_ops_contract_and_selfcheck_follow_the_dispatcher():
    m = qwen3.build("debug")
    assert m.ops.linear is K.linear and m.ops.causal_attention is K.attention_dense
    e = contract_of(m).entries()
    assert e["op.linear"] == "titan_rl.kernels.matmul.torch_impl.linear"
    assert e["op.rms_norm"] == "titan_rl.kernels.rmsnorm.torch_impl.rms_norm"
    assert e["platform.backend"] == "torch"
    probed = selfcheck._default_ops("cpu")
    assert probed["linear"] is dispatch.implementation("linear", "cpu")
    # the CUDA column: what a model on a GPU would be probed with and recorded as
    probed = selfcheck._default_ops("cuda")
    assert all(".triton_impl" in fn.__module__ for fn in probed.values())


def test_every_op_of_every_architecture_has_a_triton_form():
    """What the contract names on a GPU, for each registered architecture at each of its
    flavors: no op "none on triton"; each one the dispatcher serves is its triton_impl form,
    and the two that are plain torch compositions (the lane-stable elementwise, the tie-low
    top-k) run as they are on any device."""
    from titan_rl.contract import OPS, _resolved_name
    from titan_rl.models.ops import MODE_OPS
    from titan_rl.registry import get_architecture, list_architectures

    device_agnostic = {"elementwise", "expert_topk"}
    for arch in list_architectures():
        spec = get_architecture(arch)
        for flavor in spec.flavors:
            m = spec.build(flavor)
            named = {op: _resolved_name(getattr(m.ops, op), torch.device("cuda")) for op in OPS}
            assert not [op for op, v in named.items() if v.startswith("none")], (arch, flavor, named)
            assert all(".triton_impl." in v for op, v in named.items() if op not in device_agnostic), (arch, named)
            assert all(named[op] == f"{MODE_OPS[op][0].__module__}.{MODE_OPS[op][0].__name__}"
                       for op in device_agnostic), named


@pytest.mark.parametrize("arch, dtype", [(a, torch.float32) for a in ("qwen3", "llama", "qwen3_moe", "qwen3_hybrid",
                                                                       "qwen3_5", "qwen3_5_moe", "qwen3_next",
                                                                       "glm_moe_dsa")] +
                         [(a, torch.bfloat16) for a in ("qwen3", "qwen3_hybrid", "glm_moe_dsa")])
def test_paged_decode_equals_trainer_dense_on_cpu(arch, dtype, rng):
    """titan_rl.paged_decode (the engine side gpu_check.py drives) on the CPU column, for every
    architecture: its KV pages, carried recurrent states or latent pages give the trainer's
    bits at every position (3 sequences of 37 tokens, chunks of 5..7 then decodes)."""
    from titan_rl.paged_decode import paged_logits
    from titan_rl.registry import get_architecture, list_architectures

    assert sorted(list_architectures()) == sorted(test_paged_decode_equals_trainer_dense_on_cpu.archs)
    spec = get_architecture(arch)
    m = spec.build(next(iter(spec.flavors))).init_weights(int(torch.randint(0, 2**31, (1,), generator=rng)), 0.05)
    m = m.to(dtype).eval()
    tokens = torch.randint(0, m.cfg.vocab_size, (3, 37), generator=rng)
    with torch.no_grad():
        dense = m(tokens)
    assert torch.equal(dense, paged_logits(m, tokens, prefill=5))


test_paged_decode_equals_trainer_dense_on_cpu.archs = ["qwen3", "llama", "qwen3_moe", "qwen3_hybrid", "qwen3_5",
                                                       "qwen3_5_moe", "qwen3_next", "glm_moe_dsa"]


def test_paged_decode_needs_the_carried_state_and_the_pages(rng, monkeypatch):
    """The parity above is not vacuous: a hybrid whose decode steps start from zero states, or
    a GLM-5 whose latent rows land one page off, no longer gives the trainer's logits."""
    from titan_rl import paged_decode
    from titan_rl.models import qwen3_hybrid
    from titan_rl.registry import get_architecture

    tokens = torch.randint(0, 900, (2, 21), generator=rng)
    hybrid = qwen3_hybrid.build("debug_hybrid").init_weights(5, 0.05).eval()
    glm = get_architecture("glm_moe_dsa").build("debug_glm5").init_weights(5, 0.05).eval()
    with torch.no_grad():
        want = {"hybrid": hybrid(tokens), "glm": glm(tokens)}
    with monkeypatch.context() as mp:
        mp.setattr(paged_decode._CarriedState, "initial", lambda self, i: (None, None))
        assert not torch.equal(paged_decode.paged_logits(hybrid, tokens), want["hybrid"])
    with monkeypatch.context() as mp:
        slots = paged_decode._Pages.slots
        mp.setattr(paged_decode._Pages, "slots",
                   lambda self, o, p: (slots(self, o, p) + self.page) % (self.n_pages * self.page))
        try:  # rows read from the wrong pages: other bits, or NaN that the router refuses
            assert not torch.equal(paged_decode.paged_logits(glm, tokens), want["glm"])
        except ValueError as e:
            assert "NaN" in str(e)
    assert torch.equal(paged_decode.paged_logits(glm, tokens), want["glm"])


def test_torchtitan_on_cuda_gets_no_cpu_shims():
    """On a machine with an accelerator, importing titan_rl.titan leaves TorchTitan alone:
    its device is "cuda" (so NCCL and FSDP2/TP as TorchTitan sets them up). Run in a child
    process that reports a CUDA device to torch before anything imports torchtitan."""
    import subprocess
    import sys

    code = ("import torch, torch._utils as u; u._get_available_device_type = lambda: 'cuda'\n"
            "import titan_rl.titan\nfrom titan_rl.titan import cpu_compat\nimport torchtitan.tools.utils as tu\n"
            "print(cpu_compat.on_cpu(), tu.device_type)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == ["False", "cuda"], r.stdout


def test_gpu_check_help_says_what_it_runs_and_how_long():
    """scripts/gpu_check.py is the one command a user with a GPU runs (the suite never has
    one): its --help names every section, the traps and how long it takes."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for words in ("(a) invariance", "(a') the compiler", "(b) parity", "(c) speed", "(d) recipes",
                  "K = 512, 1024, 2048, 4096", "TF32", "How long", "What it prints", "--cpu-interpret"):
        assert words in r.stdout, words
