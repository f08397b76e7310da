"""The RL loop's engine link (titan_rl/rl/engine_link.py) against a real in-process vLLM
engine: it refuses an engine built with another bit-relevant choice than the trainer's
(dtype, tp_leaves, quantization recipe, kernel mode: the real engine is built so, the
contract is not patched), and after a sync it compares what the engine holds with what
the trainer's forward uses, per tensor, naming a tensor that differs (dense and quantized).
No TorchTitan here: the link is given a trainer-side model directly."""

import dataclasses
import gc
import os
import re

import pytest
import torch

pytest.importorskip("vllm")

import _zygote  # noqa: E402
from _folders import edit_config_in_place  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from titan_rl.rl.requests import prompt_episodes
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
    return link.collect(link.submit(1, prompt_episodes([r["prompt_token_ids"] for r in reqs], params)))


def _sample_wide(link):
    """Enough tokens (4 prompts of 13, 4 sampled each) that every expert of an 8-expert top-2
    layer sees some (with _sample's 15 tokens one expert went unused in a run, so corrupting its
    copy moved nothing): the log-probs of what the engine computes with every operand."""
    reqs = [{"prompt_token_ids": [(7 * i + 3 * j) % 900 + 2 for j in range(13)]} for i in range(4)]
    params = [SamplingParams(max_tokens=4, logprobs=0, seed=i, ignore_eos=True) for i in range(4)]
    return link.collect(link.submit(1, prompt_episodes([r["prompt_token_ids"] for r in reqs], params)))


def _built_otherwise(monkeypatch, change):
    """make_llm builds the real engine with one choice changed (`change(folder, kwargs)`,
    kwargs: the EngineSettings' fields)."""
    real = engine_mod.make_llm

    def make_llm(folder, settings):
        kwargs = dataclasses.asdict(settings)
        change(folder, kwargs)
        return real(folder, engine_mod.EngineSettings(**kwargs))

    monkeypatch.setattr(engine_mod, "make_llm", make_llm)


def _three_choices(folder, kw):
    kw.update(dtype="bfloat16")
    edit_config_in_place(folder, titan_tp_leaves=2, titan_quantization={
        "recipe": "fp8_rowwise", "layers": ["attention", "mlp", "experts", "linear_attention"]})


@pytest.mark.parametrize("case, change, messages", [
    # three choices in one engine (one engine build, not three): the contract compares entry by
    # entry, so the refusal names each with both values
    ("dtype+tp_leaves+recipe", _three_choices,
     [r"dtype \(trainer 'float32', engine 'bfloat16'\)", r"tp_leaves \(trainer 0, engine 2\)",
      r"quantization \(trainer 'none', engine 'fp8_rowwise:attention,mlp,experts,linear_attention'\)"]),
    ("kernels", lambda folder, kw: kw.update(kernels="stock"), [r"kernels \(trainer 'exact', engine 'stock'\)"]),
], ids=["dtype+tp_leaves+recipe", "kernels"])
def test_an_engine_built_otherwise_is_refused_by_name(tmp_path, monkeypatch, seed, case, change, messages):
    _built_otherwise(monkeypatch, change)
    link, _ = _link(tmp_path, seed, "--model.dtype=\"float32\"")
    with pytest.raises(ContractMismatch, match=r"execution contract before the first rollout: trainer and engine "
                                               r"differ in ") as e:
        _sample(link)
    listed = str(e.value).split("differ in ", 1)[1]
    for message in messages:
        assert re.search(message, listed), (message, str(e.value))
    assert link.llm is not None  # the engine was really built, then refused
    del link


@pytest.mark.parametrize("recipe", ["none", "fp8_rowwise"])
def test_a_sync_that_leaves_the_engine_other_weights_stops_naming_the_tensor(tmp_path, monkeypatch, seed, recipe):
    link, model = _link(tmp_path, seed, "--model.dtype=\"bfloat16\"", f"--quantization.recipe=\"{recipe}\"")
    _sample(link)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    check = link.sync(step=1)  # the engine holds exactly the trainer's forward operands
    assert len(check.engine) == 64 and check.engine == check.trainer and check.metrics()["weights_checksum_equal"]
    bad = "model.layers.2.mlp.up_proj.weight"
    named = [bad]
    if engine_model(link.llm).get_submodule(bad.removesuffix(".weight")).packed_rows is not None:
        named.insert(0, "model.layers.2.mlp.packed_gate_up")  # the quantized GEMM's fused operand it is read from
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
                                         rf"than the trainer's forward uses: {', '.join(named).replace('.', '[.]')} \("):
        link.sync(step=2)
    held = engine_model(link.llm).get_submodule(bad.removesuffix(".weight"))
    assert (held.qweight is not None) == (recipe != "none")  # quantized: the engine's own payload was hit
    del link


# -- the operands the engine prepares once per load ----------------------------------------
# Each kind (models.layers.engine_operands): fused [q; k; v] and [gate; up], a Linear's own
# GEMM weight, GLM-5's absorbed per-head weights, the LM head's copy; under a recipe the
# packed payloads of the quantized GEMM (PackedQuant: fp8 codes; nvfp4 nibbles + block
# scales) or the dequantized weights of the dense form (fp8_block). Per (architecture, flavor,
# recipe): the kinds its engine holds; the corrupted one is the first of each in module order
# (a hybrid's first GEMM weight is its GDN layer's, an MoE's first [gate; up] an expert's).
_DENSE = ["packed_qkv", "packed_gate_up", "gemm_weight", "lm_head"]
_QUANT = ["packed_qkv", "packed_gate_up", "gemm_weight"]
PREPARED_CASES = {
    # packed_qkv:few_rows: the dot-product copy decode reads at 1-4 rows (bf16 where the CPU's
    # bf16 GEMM is native: kernels/matmul/torch_impl.py)
    ("qwen3", "debug", "none"): [*_DENSE, "packed_qkv:few_rows"],
    ("llama", "debug", "none"): _DENSE,
    ("qwen3_moe", "debug_moe", "none"): _DENSE,
    ("qwen3_hybrid", "debug_hybrid", "none"): _DENSE,
    ("qwen3_next", "debug_qwen3_next", "none"): [*_DENSE, "shared_expert_gate.gemm_weight"],  # N = 1
    ("qwen3_5", "debug_qwen35", "none"): _DENSE,
    ("qwen3_5_moe", "debug_qwen35_moe", "none"): _DENSE,
    ("glm_moe_dsa", "debug_glm5", "none"): ["absorbed.w_uk_t", "absorbed.w_uv", "packed_gate_up", "gemm_weight",
                                            "lm_head"],
    # a PackedQuant: the field the forward reads on this CPU (no suffix: expanded blocks on AVX2,
    # the packed payload elsewhere), and each of its slots by name
    ("qwen3", "debug", "fp8_rowwise"): [*_QUANT, *(f"packed_qkv:{f}" for f in ("packed", "col_scale", "expanded"))],
    ("qwen3", "debug", "nvfp4"): [*_QUANT, *(f"packed_gate_up:{f}" for f in ("packed", "block_scales", "col_scale",
                                                                            "expanded"))],
    ("qwen3", "debug", "fp8_block"): _QUANT,
}


@pytest.fixture(scope="module")
def prepared_engine(tmp_path_factory):
    """(architecture, flavor, recipe) -> its colocated engine, built once for the module's tests
    of that case (they run together; one engine is held at a time)."""
    from _seeds import draw_seed

    held = {}

    def get(case):
        if case not in held:
            held.clear()
            gc.collect()  # the last engine is gone before the next is built (its teardown resets vLLM's groups)
            name, flavor, recipe = case
            link, model = _link(tmp_path_factory.mktemp(name), draw_seed(), f"--model.name={name}",
                                f"--model.flavor={flavor}", "--model.dtype=\"bfloat16\"",
                                f"--quantization.recipe=\"{recipe}\"")
            _sample(link)  # builds the engine
            held[case] = {"link": link, "step": 0}
        return held[case]

    yield get
    held.clear()


def _operand_name(m, kind: str) -> str:
    """The first prepared operand of `kind` the engine holds (module order)."""
    from titan_rl.models.layers import LM_HEAD_OPERAND, held_operands

    if kind == "lm_head":
        return LM_HEAD_OPERAND
    names = [n for n in m.weight_digests() if n.endswith("." + kind) or f".{kind}." in n]
    order = [n for n, _ in held_operands(m._net)]
    return min(names, key=lambda n: next(i for i, b in enumerate(order) if n == b or n.startswith(b + ".")))


def _named(m, name: str, field: str = "") -> list[str]:
    """What the check names for a change of operand `name`'s first element: the operand, and
    where it is a quantized GEMM's packed payload or its scales, the weight whose row 0 that is
    (the engine reads each weight back from them too: Linear.held_weight); not for the AVX2
    form's expanded blocks, which only the forward reads."""
    from titan_rl.models.layers import held_operands

    op = dict(held_operands(m._net)).get(name)
    if hasattr(op, "read_fields") and (field or op.read_fields()[0]) == "expanded":
        return [name]
    rows = [f"{n}.weight" for n, mod in m._net.named_modules()
            if getattr(mod, "packed_rows", None) is not None and mod.packed_rows[0] is op and mod.packed_rows[1] == 0]
    return sorted([name, *rows])


@pytest.mark.parametrize("case, kind", [(case, kind) for case, kinds in PREPARED_CASES.items() for kind in kinds],
                         ids=[f"{c[0]}-{c[2]}-{k}" for c, ks in PREPARED_CASES.items() for k in ks])
def test_a_corrupted_prepared_operand_stops_the_run_naming_it(prepared_engine, monkeypatch, case, kind):
    """One element of one prepared operand changed after the load: the forward's log-probs
    move (it is what the engine multiplies by) and the post-sync check names that operand
    (and nothing else but, for a packed quantized payload, the weight it reads back as), in
    one line. The same engine synced untouched passes first."""
    from titan_rl.vllm.worker_extension import corrupt_operand

    from titan_rl.models.layers import held_operands

    kind, _, field = kind.partition(":")
    s = prepared_engine(case)
    link = s["link"]
    s["step"] += 1
    check = link.sync(step=s["step"])  # uncorrupted: every digest agrees
    assert check.engine == check.trainer
    if "clean" not in s:  # the same weights every sync (the trainer's do not change): sampled once
        s["clean"] = _sample_wide(link)[0].mu
    clean = s["clean"]
    name = _operand_name(engine_model(link.llm), kind)
    op = dict(held_operands(engine_model(link.llm)._net)).get(name)  # None: an element of a dict / the LM head
    if field and getattr(op, field) is None:
        pytest.skip(f"{name} holds no {field} copy on this CPU")
    # a PackedQuant slot the forward does not read on this CPU (the payload beside AVX2's
    # expanded blocks): the check still names it, and the forward must not move
    read = not hasattr(op, "read_fields") or not field or field in op.read_fields()
    real = TitanForCausalLM.load_weights

    def corrupting_load(self, weights):
        loaded = real(self, weights)
        corrupt_operand(self._net, name, self._lm_head_prepared, field or None)
        return loaded

    monkeypatch.setattr(TitanForCausalLM, "load_weights", corrupting_load)
    s["step"] += 1
    named = ", ".join(_named(engine_model(link.llm), name, field)).replace(".", "[.]")
    with pytest.raises(RunStopped, match=rf"^weights after the weight sync of step {s['step']}: the engine holds other "
                                         rf"weights than the trainer's forward uses: {named} \(") as e:
        link.sync(step=s["step"])
    assert "\n" not in str(e.value)
    monkeypatch.undo()
    moved = any(not torch.equal(a, b) for a, b in zip(clean, _sample_wide(link)[0].mu))
    assert moved == read, f"{name}{':' + field if field else ''}: the forward {'did not move' if read else 'moved'}"


def test_a_separate_engine_with_a_corrupted_prepared_operand_stops_the_run(tmp_path):
    """rollout.placement = "separate": the engine checks in its own process (the worker
    extension's titan_verify_weights). On the GDN hybrid (GDN and attention layers): its first GDN
    input projection, its attention layer's fused q/k/v, then its LM head copy, changed there
    (titan_corrupt_operand) after it loaded a transfer: the run stops naming the operand, in
    one line; untouched syncs pass before each. In a fresh process (tests/_separate_corrupt.py):
    an engine in its own process cannot start from one that ran an in-process engine."""
    import sys

    script = os.path.join(os.path.dirname(__file__), "_separate_corrupt.py")
    r = _zygote.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("PASSED ", "STOPPED "))]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [ln.split(" ", 3)[:3] for ln in lines] == [
        [("PASSED", "STOPPED")[step % 2 == 0], "qwen3_hybrid", str(step)] for step in range(1, 7)], r.stdout[-3000:]
    names = ["model.layers.0.linear_attn.in_proj_qkvz.gemm_weight", "model.layers.3.self_attn.packed_qkv",
             "lm_head.prepared"]
    for line, name in zip(lines[1::2], names):
        arch, step = line.split(" ", 3)[1:3]
        assert "\\n" not in line  # one line (the script writes a newline as a visible \\n)
        assert re.fullmatch(rf"STOPPED {arch} {step} weights after the weight sync of step {step}: engine 0 holds "
                            rf"other weights than the trainer's forward uses: {re.escape(name)} \(sha256 of what "
                            r"each side multiplies by, computed in each process\)\. .*", line), line


@pytest.mark.parametrize("arch, flavor", sorted({(c[0], c[1]) for c in PREPARED_CASES}))
def test_every_prepared_operand_is_read_by_the_forward(arch, flavor):
    """No prepared copy is dead weight the checksum would vouch for: for each role (the operand
    names with their layer / expert / head index dropped) of the engine's prepared model (the
    vLLM wrapper's net, prepared by models.layers.prepare_for_engine), one changed element of
    one of its operands moves the forward's logits. The LM head's copy is the wrapper's (the
    test above)."""
    from titan_rl.weight_digests import operand_digests
    from titan_rl.models.layers import held_operands, prepare_for_engine
    from titan_rl.vllm.worker_extension import corrupt_operand

    net = get_architecture(arch).build(flavor).init_weights(2, 0.05).to(torch.bfloat16).eval()
    prepare_for_engine(net)
    tokens = torch.arange(3, 43).view(1, 40)  # longer than GLM-5 debug's index_topk: the indexer selects
    with torch.no_grad():
        base = net(tokens)
    roles = {}
    for n, op in held_operands(net):
        for leaf in operand_digests(n, op):
            roles.setdefault(re.sub(r"\.\d+(?=\.|$)", ".N", leaf), []).append(leaf)

    def moves(leaf: str) -> bool:
        corrupt_operand(net, leaf)
        with torch.no_grad():
            moved = not torch.equal(net(tokens), base)
        prepare_for_engine(net)
        return moved

    assert roles
    for role, leaves in roles.items():  # the first that moves (an expert these tokens route to)
        assert any(moves(leaf) for leaf in leaves), f"{role}: prepared, hashed, and never read by the forward"


def test_compiled_is_the_stock_engines_only():
    """EngineSettings.compiled (vLLM's default CPU configuration, torch.compile: the benchmarks'
    faster stock column) is refused for the exact engine, whose bits are its eager kernels'."""
    with pytest.raises(ValueError, match=r"compiled = True is vLLM's compiled stock engine; the exact engine runs "
                                         r"eager"):
        engine_mod.make_llm("/nonexistent", engine_mod.EngineSettings(kernels="exact", compiled=True))
