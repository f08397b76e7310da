"""Worker for tests/test_titan_parallel.py, run as
    torchrun --nproc_per_node=N tests/_titan_parallel_worker.py MODE OUT.json
MODE: fsdp (FSDP = world), tp (TP = world), fsdp_tp (FSDP = 2 x TP = world/2), tp_moe (MoE at TP = world),
tp_hybrid (the GDN hybrid at TP = world; tp_q35: Qwen3.5 and Qwen3.5-MoE), engine_tp (vLLM at tensor_parallel_size = world
vs the trainer at TP = world; it goes last: vLLM's engine shutdown ends the process group),
trainer (torchtitan's own Trainer with our ModelSpec, FSDP = world, synthetic data),
det_fsdp (deterministic leaf-tree reduction: 3 AdamW steps at FSDP = world vs FSDP = 1, dense/MoE/hybrid),
det_tp (the same at FSDP = world/2 x TP = 2 vs one process, tp_leaves > 0; det_tp_dense: dense only;
det_tp_q35: Qwen3.5 and Qwen3.5-MoE),
det_fsdp_dense (det_fsdp's dense cases, deterministic only: FSDP = 4 on four ranks),
ranks_tree (leaf_reduction.ranks_tree vs all_gather + tree_sum, world and strided subgroups),
gather_dp (Ranks.gather_dp vs all_gather_object);
"a+b" runs both in one launch. TITAN_TEST_SEED (env): the seed of tp_hybrid and engine_tp.

Every rank builds the same seeded debug model; the unsharded single-process forward on
the same tokens is the reference. Rank 0 writes the results as JSON; each check is a
boolean or a number the test asserts on.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

from titan_rl.titan import cpu_compat

cpu_compat.apply()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402

from titan_rl.titan.model import load_full_state_dict  # noqa: E402
from titan_rl.titan.parallelize import apply_fsdp, parallelize_fn  # noqa: E402
from titan_rl.titan.spec import model_config  # noqa: E402
from titan_rl.models.options import ModelOptions  # noqa: E402
from titan_rl.models.common import choice_points  # noqa: E402

SEED = 1234
B, L = 2, 40  # L not a multiple of the attention block: exercises the padding


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (B, L), generator=torch.Generator().manual_seed(7))


def build(tp_leaves: int = 0, meta: bool = False, **kw):
    cfg = model_config("qwen3", "debug", ModelOptions(tp_leaves=tp_leaves), init_seed=SEED, **kw)
    if meta:
        with torch.device("meta"):
            return cfg.build()
    return cfg.build().init_weights()


def model_file(tp_leaves: int):
    """The model file built directly (no TitanModel): what the rollout engine builds from
    a config.json with titan_tp_leaves = tp_leaves."""

    from titan_rl.models.qwen3 import FLAVORS
    from titan_rl.models.qwen3 import build as build_qwen3

    return build_qwen3(FLAVORS["debug"], ModelOptions(tp_leaves=tp_leaves)).init_weights(SEED)


def parallel_dims(dp_shard: int, tp: int) -> ParallelDims:
    pd = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=1,
                      world_size=dist.get_world_size(), spmd_backend="partial_dtensor")
    pd.build_mesh()
    return pd


def maxdiff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def ce_loss_sum(logits, tok):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tok[:, 1:].reshape(-1), reduction="sum")


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_fsdp(res: dict) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = build()
    tok = tokens(ref.cfg.vocab_size)
    with torch.no_grad():
        want = ref(tok)
    pd = parallel_dims(world, 1)

    # 1. forward: eager-built model, sharded afterwards.
    m = build()
    parallelize_fn(m, parallel_dims=pd)
    with torch.no_grad():
        got = m(tok)
    res["fsdp_forward_equal"] = torch.equal(got, want)
    res["fsdp_forward_maxdiff"] = maxdiff(got, want)

    # 2. the Trainer's order: meta build -> parallelize -> to_empty -> init_weights.
    mm = build(meta=True)
    parallelize_fn(mm, parallel_dims=pd)
    mm.to_empty(device="cpu")
    mm.init_weights()
    with torch.no_grad():
        res["fsdp_meta_init_forward_equal"] = torch.equal(mm(tok), want)

    # 2b. the same with tied embeddings: the tie survives meta -> FSDP -> to_empty -> init.
    from dataclasses import replace as dc_replace

    from titan_rl.models.qwen3 import FLAVORS

    tied = dc_replace(FLAVORS["debug"], tie_word_embeddings=True)
    mt = build(meta=True, model_config=tied)
    parallelize_fn(mt, parallel_dims=pd)
    mt.to_empty(device="cpu")
    mt.init_weights()
    with torch.no_grad():
        res["fsdp_tied_forward_equal"] = torch.equal(mt(tok), build(model_config=tied)(tok))
    res["fsdp_tied_still_tied"] = mt.lm_head.weight is mt.model.embed_tokens.weight

    # 3. bf16 compute (fp32 master weights, FSDP param_dtype=bf16) == the unsharded model in bf16.
    mb = build()
    apply_fsdp(mb, pd.get_mesh("fsdp"), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref_bf16 = build().to(torch.bfloat16)
    with torch.no_grad():
        res["fsdp_bf16_forward_equal"] = torch.equal(mb(tok), ref_bf16(tok))

    # 4. one training step on gloo: rank r trains on its chunk of rows; loss normalised by the
    #    global token count, FSDP gradient divide factor 1.0 (torchtitan's convention) and the
    #    leaf-tree reduction (titan_rl.titan.leaf_reduction: a chunk is a leaf), so the
    #    gradient is the one process's tree over the same chunks, bit for bit.
    from titan_rl.kernels import tree_sum
    from titan_rl.titan import leaf_reduction

    leaf_reduction.install(m)
    n_tok = tok[:, 1:].numel()
    chunks = tok.chunk(world)
    rows = chunks[rank]
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    loss = ce_loss_sum(m(rows), rows) / n_tok
    loss.backward()
    opt.step()
    opt.zero_grad()
    leaf_grads = []
    for c in chunks:
        (ce_loss_sum(ref(c), c) / n_tok).backward()
        leaf_grads.append([p.grad.clone() for p in ref.parameters()])
        ref.zero_grad()
    for p, *gs in zip(ref.parameters(), *leaf_grads):
        p.grad = tree_sum(torch.stack(gs))
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    with torch.no_grad():
        ref_loss = ce_loss_sum(build()(tok), tok) / n_tok
    res["fsdp_step_params_equal"] = all(torch.equal(full(p), q) for p, q in zip(m.parameters(), ref.parameters()))
    step_diff = max(maxdiff(full(p), q) for p, q in zip(m.parameters(), ref.parameters()))
    res["fsdp_step_param_maxdiff"] = step_diff
    moved = max(maxdiff(full(p), q) for p, q in zip(m.parameters(), build().parameters()))
    res["fsdp_step_param_moved"] = moved
    with torch.no_grad():
        after, ref_after = m(tok), ref(tok)
    res["fsdp_after_step_logits_equal"] = torch.equal(after, ref_after)
    res["fsdp_after_step_logits_maxdiff"] = maxdiff(after, ref_after)
    res["loss_before"] = ref_loss.item()
    with torch.no_grad():
        res["loss_after"] = (ce_loss_sum(ref_after, tok) / n_tok).item()

    # 5. activation checkpointing (FullAC) gives the same gradients.
    from torchtitan.distributed.activation_checkpoint import FullAC

    ma, mn = build(), build()
    parallelize_fn(ma, parallel_dims=pd, ac_config=FullAC.Config())
    parallelize_fn(mn, parallel_dims=pd)
    for mod in (ma, mn):
        (ce_loss_sum(mod(rows), rows) / n_tok).backward()
    res["fsdp_full_ac_grads_equal"] = all(
        torch.equal(full(p.grad), full(q.grad)) for p, q in zip(ma.parameters(), mn.parameters())
    )


def run_tp(res: dict, dp_shard: int = 1) -> None:
    world = dist.get_world_size()
    tp = world // dp_shard
    pd = parallel_dims(dp_shard, tp)
    ref = build()            # the model file's own kernels
    ref8 = build(tp_leaves=8)  # same weights, fixed 8 column blocks / 8 K-leaves
    direct8 = model_file(8)    # the model file itself, as the rollout engine builds it
    tok = tokens(ref.cfg.vocab_size)
    with torch.no_grad():
        want, want8, direct = ref(tok), ref8(tok), direct8(tok)
    res["leaf_tree_vs_plain_maxdiff"] = maxdiff(want8, want)
    res["titan_vs_model_file_equal"] = torch.equal(want8, direct)

    # 1. exact TP: tp_leaves = 8, eager-built then sharded.
    m = build(tp_leaves=8)
    parallelize_fn(m, parallel_dims=pd)
    with torch.no_grad():
        got = m(tok)
    res["tp_leaves_forward_equal"] = torch.equal(got, want8)
    res["tp_leaves_forward_maxdiff"] = maxdiff(got, want8)
    res["tp_leaves_vs_model_file_equal"] = torch.equal(got, direct)

    # 2. meta build -> parallelize -> to_empty -> init_weights (the Trainer's order).
    mm = build(tp_leaves=8, meta=True)
    parallelize_fn(mm, parallel_dims=pd)
    mm.to_empty(device="cpu")
    mm.init_weights()
    with torch.no_grad():
        res["tp_leaves_meta_init_forward_equal"] = torch.equal(mm(tok), want8)

    # 3. plain TP (tp_leaves = 0): all-reduce of rank partials, close to the model file's forward.
    m0 = build()
    parallelize_fn(m0, parallel_dims=pd)
    with torch.no_grad():
        got0 = m0(tok)
    res["tp_plain_forward_equal"] = torch.equal(got0, want)
    res["tp_plain_forward_maxdiff"] = maxdiff(got0, want)

    # 4. bf16 weights, exact TP.
    mb = build(tp_leaves=8).to(torch.bfloat16)
    parallelize_fn(mb, parallel_dims=pd)
    ref8b = build(tp_leaves=8).to(torch.bfloat16)
    with torch.no_grad():
        got_b = mb(tok)
        res["tp_leaves_bf16_forward_equal"] = torch.equal(got_b, ref8b(tok))
        res["tp_leaves_bf16_vs_model_file_equal"] = torch.equal(got_b, model_file(8).to(torch.bfloat16)(tok))

    # 5. backward + optimizer step: gradients close to the unsharded model's.
    n_tok = tok[:, 1:].numel()
    rows = tok.chunk(dp_shard)[pd.get_mesh("fsdp").get_local_rank()] if dp_shard > 1 else tok
    (ce_loss_sum(m(rows), rows) / n_tok).backward()
    (ce_loss_sum(ref8(tok), tok) / n_tok).backward()
    gdiff, gscale = 0.0, 0.0
    for (name, p), q in zip(m.named_parameters(), ref8.parameters()):
        gdiff = max(gdiff, maxdiff(full(p.grad), q.grad))
        gscale = max(gscale, q.grad.abs().max().item())
    res["tp_grad_maxdiff"] = gdiff
    res["tp_grad_scale"] = gscale
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    opt.step()
    with torch.no_grad():
        res["tp_after_step_logits_finite"] = bool(torch.isfinite(m(tok)).all())


def run_tp_moe(res: dict) -> None:
    """MoE (debug_moe, tp_leaves = 8) at TP = world: experts sharded like the dense MLP,
    router replicated. Forward logits and routes vs the model file (= the rollout
    engine's model), fp32 and bf16; routes replayed under TP are the forced ones."""

    from titan_rl.models import qwen3_moe

    pd = parallel_dims(1, dist.get_world_size())

    def titan(dtype):
        m = model_config("qwen3_moe", "debug_moe", ModelOptions(tp_leaves=8), init_seed=SEED).build().init_weights()
        with torch.no_grad():  # a decisive router, so routing varies across tokens
            for layer in m.model.layers:
                layer.mlp.gate.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(SEED))
        return m.to(dtype)

    direct = qwen3_moe.build(qwen3_moe.FLAVORS["debug_moe"], ModelOptions(tp_leaves=8))
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        ref = titan(dtype)
        direct.load_state_dict(ref.state_dict())
        direct.to(dtype)
        tok = tokens(ref.cfg.vocab_size)
        m = titan(dtype)
        parallelize_fn(m, parallel_dims=pd)
        with torch.no_grad():
            want = direct(tok)
            want_routes = [r.clone() for r in choice_points.used(direct, "routes")]
            got = m(tok)
        res[f"moe_tp_{tag}_forward_equal"] = torch.equal(got, want)
        res[f"moe_tp_{tag}_forward_maxdiff"] = maxdiff(got, want)
        res[f"moe_tp_{tag}_routes_equal"] = all(torch.equal(a, b) for a, b in zip(choice_points.used(m, "routes"), want_routes))
        res[f"moe_tp_{tag}_distinct_routes"] = len({tuple(r) for r in want_routes[0].tolist()})
    # replay under TP: a perturbed router still uses the forced experts
    g = torch.Generator().manual_seed(SEED + 1)
    forced = [torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tok.numel())]).to(torch.uint8)
              for _ in m.model.layers]
    with torch.no_grad():
        for layer in m.model.layers:
            w = layer.mlp.gate.weight
            w = w.to_local() if isinstance(w, DTensor) else w  # FSDP over 1 rank: the full weight
            w.add_(5 * torch.randn(w.shape, generator=g).to(w.dtype))
        choice_points.force(m, "routes", forced)
        m(tok)
    res["moe_tp_replay_forced"] = all(torch.equal(a, b) for a, b in zip(choice_points.used(m, "routes"), forced))
    choice_points.force(m, "routes", None)


def hybrid_config():
    """A small hybrid with odd-ish sizes: hidden 200, vocab 997, 3 value heads per key head,
    dk != dv, conv kernel 3, layers GDN / attention / GDN."""
    from titan_rl.models.qwen3_hybrid import Qwen3HybridConfig

    return Qwen3HybridConfig(
        vocab_size=997, hidden_size=200, intermediate_size=328, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=32, linear_value_head_dim=16,
        linear_conv_kernel_dim=3, full_attention_interval=2)


def run_tp_hybrid(res: dict, names: tuple[str, ...] = ("hybrid", "next")) -> None:
    """The GDN hybrids: ours and Qwen3-Next (gated attention, routed experts with a shared
    expert) with tp_leaves = 4, Qwen3.5 and Qwen3.5-MoE (unfused GDN projections; 6 value
    heads: tp_leaves = 2) at TP = world vs TitanModel at TP = 1 and vs the model file built
    directly (= the rollout engine's model), fp32 and bf16, on several batch compositions;
    the meta-init order; gradients through the sharded GDN close to TP = 1."""
    from titan_rl.models import qwen3_5, qwen3_5_moe, qwen3_hybrid, qwen3_next

    pd = parallel_dims(1, dist.get_world_size())
    seed = int(os.environ.get("TITAN_TEST_SEED", "7"))
    cases = {"hybrid": ("qwen3_hybrid", "debug_hybrid", hybrid_config(), qwen3_hybrid.build, 4),
             "next": ("qwen3_next", "debug_qwen3_next", qwen3_next.FLAVORS["debug_qwen3_next"], qwen3_next.build, 4),
             "q35": ("qwen3_5", "debug_qwen35", qwen3_5.FLAVORS["debug_qwen35"], qwen3_5.build, 2),
             "q35moe": ("qwen3_5_moe", "debug_qwen35_moe", qwen3_5_moe.FLAVORS["debug_qwen35_moe"],
                        qwen3_5_moe.build, 2)}
    for name in names:
        arch, flavor, cfg, build_file, leaves = cases[name]
        options = ModelOptions(tp_leaves=leaves)
        g = torch.Generator().manual_seed(seed)
        batches = [torch.randint(0, cfg.vocab_size, shape, generator=g) for shape in ((3, 37), (1, 61), (5, 9))]

        def titan(meta: bool = False):
            mc = model_config(arch, flavor, options, model_config=cfg, init_seed=SEED, init_std=0.05)
            if meta:
                with torch.device("meta"):
                    return mc.build()
            return mc.build().init_weights()

        for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            ref = titan().to(dtype)
            direct = build_file(cfg, options)
            direct.load_state_dict(ref.state_dict())
            direct.to(dtype)
            m = titan().to(dtype)
            parallelize_fn(m, parallel_dims=pd)
            eq_ref, eq_direct, diff = True, True, 0.0
            with torch.no_grad():
                for tok in batches:
                    want, got, file_ = ref(tok), m(tok), direct(tok)
                    eq_ref &= torch.equal(got, want)
                    eq_direct &= torch.equal(want, file_)
                    diff = max(diff, maxdiff(got, want))
            res[f"{name}_tp_{tag}_forward_equal"] = eq_ref
            res[f"{name}_tp_{tag}_forward_maxdiff"] = diff
            res[f"{name}_tp_{tag}_vs_model_file_equal"] = eq_direct
        gdn = m.model.layers[0].linear_attn
        if hasattr(gdn, "in_proj_qkvz"):
            res[f"{name}_tp_local_heads"] = [gdn.hk, gdn.hv, int(gdn.in_proj_qkvz.weight.to_local().shape[0])]
        else:  # in_proj_qkv stays whole; the rank computes its heads' q, k and v rows
            res[f"{name}_tp_local_heads"] = [gdn.hk, gdn.hv, int(gdn.in_proj_z.weight.to_local().shape[0]),
                                             sum(r.stop - r.start for r in gdn.tp_qkv_rows)]
        if name in ("next", "q35moe"):  # routing varies, so equal logits mean equal experts too
            res[f"{name}_tp_distinct_routes"] = len({tuple(r.tolist()) for r in choice_points.own(m, "routes")[0]})

        # the Trainer's order: meta build -> parallelize -> to_empty -> init_weights
        mm = titan(meta=True)
        parallelize_fn(mm, parallel_dims=pd)
        mm.to_empty(device="cpu")
        mm.init_weights()
        ref = titan()
        with torch.no_grad():
            res[f"{name}_tp_meta_init_forward_equal"] = all(torch.equal(mm(t), ref(t)) for t in batches)

        # backward through the sharded GDN (sliced conv / A_log / dt_bias, gated norm, copy_to_tp)
        tok = batches[0]
        n_tok = tok[:, 1:].numel()
        (ce_loss_sum(mm(tok), tok) / n_tok).backward()
        (ce_loss_sum(ref(tok), tok) / n_tok).backward()
        gdiff, gscale, missing = 0.0, 0.0, []
        for (pname, p), q in zip(mm.named_parameters(), ref.parameters()):
            if p.grad is None:
                missing.append(pname)
                continue
            gdiff = max(gdiff, maxdiff(full(p.grad), q.grad))
            gscale = max(gscale, q.grad.abs().max().item())
        res[f"{name}_tp_grad_maxdiff"] = gdiff
        res[f"{name}_tp_grad_scale"] = gscale
        res[f"{name}_tp_grad_missing"] = missing


def run_engine_tp(res: dict, out_dir: str) -> None:
    """vLLM at tensor_parallel_size = world (external launcher: one engine rank per
    process) on the dense debug model and the odd-sized hybrid, both with tp_leaves = 4:
    the recorded log-probs == the model file's (= engine TP = 1, tests/test_tp_leaves.py)
    == the trainer at TP = world, bit for bit, fp32 and bf16; after a weight update too."""

    import titan_rl.vllm  # noqa: F401  (vLLM's environment, before vllm is imported)
    from titan_rl.checkpoint import save_hf_folder
    from titan_rl.kernels import log_softmax_fp32
    from titan_rl.models import qwen3, qwen3_hybrid, qwen3_next
    from titan_rl.vllm.engine import EngineSettings, engine_model, make_llm, update_weights

    world, rank = dist.get_world_size(), dist.get_rank()
    pd = parallel_dims(1, world)
    seed = int(os.environ.get("TITAN_TEST_SEED", "7"))
    engines = []
    cases = {
        "dense": ("qwen3", qwen3.FLAVORS["debug"], qwen3.build),
        "hybrid": ("qwen3_hybrid", hybrid_config(), qwen3_hybrid.build),
        "next": ("qwen3_next", qwen3_next.FLAVORS["debug_qwen3_next"], qwen3_next.build),
    }
    dtypes = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16")}
    for tag, (arch, cfg, build_file) in cases.items():
        for dname, (dtype, dstr) in dtypes.items():
            key = f"engine_tp_{tag}_{dname}"
            t0 = time.time()
            folder = os.path.join(out_dir, key)
            file_model = build_file(cfg, ModelOptions(tp_leaves=4)).init_weights(seed, 0.05).to(dtype).eval()
            if rank == 0:
                save_hf_folder(file_model, folder, dtype=dtype)
            dist.barrier()
            trainer = model_config(arch, "debug", ModelOptions(tp_leaves=4), model_config=cfg).build().to(dtype)
            parallelize_fn(trainer, parallel_dims=pd)
            load_full_state_dict(trainer, file_model.state_dict())
            llm = make_llm(folder, EngineSettings(arch=arch, dtype=dstr, kv_cache_mib=32, max_model_len=256,
                                                  max_num_seqs=8, max_num_batched_tokens=48,
                                                  enable_prefix_caching=False, seed=seed, tensor_parallel_size=world))
            net = engine_model(llm)
            engines.append(llm)
            q_proj = next(m for name, m in net.named_modules() if name.endswith("self_attn.q_proj"))
            res[f"{key}_local_q_rows"] = int(q_proj.weight.shape[0])
            g = torch.Generator().manual_seed(seed)
            prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (23, 2, 90, 57, 7)]
            for step in ("initial", "updated"):
                if step == "updated":  # the trainer's full state dict into every rank's engine
                    with torch.no_grad():
                        for p in file_model.parameters():
                            p.add_(0.02 * torch.randn(p.shape, generator=g).to(dtype))
                    load_full_state_dict(trainer, file_model.state_dict())  # each rank its shards
                    update_weights(llm, file_model.state_dict())
                mus = _engine_logprobs(llm, prompts)
                equal, diff = True, 0.0
                with torch.no_grad():
                    for p, (toks, mu) in zip(prompts, mus):
                        for model in (file_model, trainer):
                            logp = log_softmax_fp32(model(torch.tensor([p + toks])))[0]
                            pi = logp[len(p) - 1: len(p) - 1 + len(toks)].gather(-1, torch.tensor(toks)[:, None])
                            pi = pi[:, 0].double()
                            equal &= torch.equal(pi, mu)
                            diff = max(diff, (pi - mu).abs().max().item())
                res[f"{key}_{step}_equal"] = equal
                res[f"{key}_{step}_maxdiff"] = diff
                res[f"{key}_{step}_tokens"] = sum(len(t) for t, _ in mus)
            res[f"{key}_seconds"] = round(time.time() - t0, 1)
    # vLLM 0.32's engine shutdown tears down torch.distributed (EngineCore.shutdown ->
    # cleanup_dist_env_and_memory), so the engines go last, all at once.
    engines.clear()
    gc.collect()


def _engine_logprobs(llm, prompts):
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        toks = list(c.token_ids)
        res.append((toks, torch.tensor([lp[t].logprob for t, lp in zip(toks, c.logprobs)], dtype=torch.float64)))
    return res


# -- deterministic, layout-invariant gradients (titan_rl.titan.leaf_reduction) -------------

DET_SEQS, DET_LEAVES, DET_STEPS = 8, 4, 3


def det_batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch: DET_SEQS rows of random lengths 5..23 (odd widths), zero
    padded to the longest, and the mask of their valid next-token targets."""
    g = torch.Generator().manual_seed(100 + step)
    lens = torch.randint(5, 24, (DET_SEQS,), generator=g)
    rows = torch.randint(0, vocab, (DET_SEQS, int(lens.max())), generator=g)
    pos = torch.arange(rows.shape[1] - 1)
    mask = pos[None, :] < (lens[:, None] - 1)
    return rows * (torch.arange(rows.shape[1])[None, :] < lens[:, None]), mask


CLIP_SCALES: list[float] = []  # every det_train step's clipping scale (the tests assert it clipped)


EP_ROWS: list[int] = []  # rows each expert-parallel det_train received from other ranks


def det_train(arch: str, flavor: str, mesh, deterministic: bool, param_dtype=None, tp_mesh=None,
              tp_leaves: int = 0, ep: bool = False) -> dict:
    """DET_STEPS steps of masked CE + MoE aux loss, global-norm clipping and AdamW on the
    global batch, this rank's share of it (TP on `tp_mesh` when given; `ep`: the routed
    experts expert-parallel over `mesh`, titan_rl/titan/expert_parallel.py); returns the full
    weights after the last step."""
    from titan_rl.rl.batch_plan import gradient_leaves
    from titan_rl.rl.global_batch import rank_share
    from titan_rl.titan import leaf_reduction
    from titan_rl.titan.parallelize import apply_tp

    m = model_config(arch, flavor, ModelOptions(tp_leaves=tp_leaves), init_seed=SEED).build().init_weights()
    if tp_mesh is not None:
        apply_tp(m, tp_mesh)
    xp, ignored = None, None
    if ep:
        from titan_rl.titan.expert_parallel import apply_ep, expert_parameters

        xp = apply_ep(m, mesh.get_group(), mesh, param_dtype=param_dtype, reduce_dtype=torch.float32)
        ignored = set(expert_parameters(m))
    apply_fsdp(m, mesh, param_dtype=param_dtype, reduce_dtype=torch.float32, gradient_divide_factor=1.0,
               ignored_params=ignored)
    red = leaf_reduction.install(m) if deterministic else None
    if not deterministic:  # MoE: an expert no token of one rank reached still joins the reduce-scatter
        for unit in m.modules():
            if isinstance(unit, FSDPModule):
                unit.set_reduce_scatter_unused_params(True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
    world, rank = mesh.size(), mesh.get_local_rank()
    coef = getattr(m.cfg, "router_aux_loss_coef", 0.0)
    for step in range(DET_STEPS):
        rows, mask = det_batch(step, m.cfg.vocab_size)
        n_tok = int(mask.sum())
        if deterministic:
            parts, n_parts = gradient_leaves(DET_SEQS, DET_LEAVES, world, rank), DET_LEAVES
        else:  # today's form: the rank's share in one forward, trimmed to its own longest row
            parts, n_parts = [rank_share(DET_SEQS, world, rank)], world
        for j, part in enumerate(parts):
            if red is not None:
                red.last_leaf = j == len(parts) - 1
            tok, msk = rows[part.start:part.stop], mask[part.start:part.stop]
            if not deterministic:
                width = int(msk.sum(1).max()) + 1
                tok, msk = tok[:, :width], msk[:, :width - 1]
            logits = m(tok)[:, :-1].float()
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tok[:, 1:].reshape(-1), reduction="none")
            loss = (ce * msk.reshape(-1)).sum() / n_tok
            if coef:
                loss = loss + coef * m.aux_loss / n_parts
            if getattr(m, "indexer_loss", None) is not None:  # GLM-5's indexers learn from their own loss
                loss = loss + m.indexer_loss / n_parts
            loss.backward()
            if xp is not None:
                xp.leaf_done(j == len(parts) - 1)
        norm = leaf_reduction.grad_norm(m.parameters())
        scale = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
        CLIP_SCALES.append(float(scale))
        for p in m.parameters():
            if p.grad is not None:  # GLM-5's selection biases take no gradient
                p.grad.mul_(scale.to(p.grad.dtype))
        opt.step()
        opt.zero_grad()
    if xp is not None:
        EP_ROWS.append(xp.rows_from_others)
    return {n: full(p).detach().clone() for n, p in m.named_parameters()}


EP_TAGS = ("moe", "glm5")  # scripts/matrix.py --layout ep2 runs the other two (docs/engines.md, docs/figures.md)


def run_det_fsdp(res: dict) -> None:
    """FSDP = world and FSDP = 1 (a size-1 mesh dim on each rank) train the same global
    batch; with the leaf-tree reduction the weights after DET_STEPS steps are torch.equal."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "solo"))
    cases = [("dense", "qwen3", "debug", None), ("dense_bf16", "qwen3", "debug", torch.bfloat16),
             ("moe", "qwen3_moe", "debug_moe", None), ("hybrid", "qwen3_hybrid", "debug_hybrid", None),
             ("next", "qwen3_next", "debug_qwen3_next", None), ("q35", "qwen3_5", "debug_qwen35", None),
             ("q35moe", "qwen3_5_moe", "debug_qwen35_moe", None), ("glm5", "glm_moe_dsa", "debug_glm5", None)]
    for tag, arch, flavor, dtype in cases:
        init = {n: p.detach().clone() for n, p in
                model_config(arch, flavor, init_seed=SEED).build().init_weights().named_parameters()}
        # The control (the collective's own sum) on the dense model only: that one
        # differing shows the equality below is the leaf tree's doing.
        for det in (True, False) if tag == "dense" else (True,):
            t0 = time.perf_counter()
            wide = det_train(arch, flavor, mesh["dp"], det, dtype)
            res.setdefault("case_seconds", {})[f"fsdp_wide_{tag}_{det}"] = round(time.perf_counter() - t0, 1)
            # the MoE models again with their experts expert-parallel (EP = FSDP = world)
            wide_ep = det_train(arch, flavor, mesh["dp"], det, dtype, ep=True) if tag in EP_TAGS else None
            if dist.get_rank() != 0:  # the one-process run talks to no other rank: rank 0's alone
                continue
            t0 = time.perf_counter()
            solo = det_train(arch, flavor, mesh["solo"], det, dtype)
            res["case_seconds"][f"fsdp_solo_{tag}_{det}"] = round(time.perf_counter() - t0, 1)
            key = f"{'det' if det else 'plain'}_{tag}"
            res[f"{key}_equal"] = all(torch.equal(wide[n], solo[n]) for n in wide)
            res[f"{key}_maxdiff"] = max(maxdiff(wide[n], solo[n]) for n in wide)
            res[f"{key}_moved"] = max(maxdiff(wide[n], init[n]) for n in wide)
            if wide_ep is not None:
                res[f"detep_{tag}_equal"] = all(torch.equal(wide_ep[n], solo[n]) for n in wide)
                res[f"detep_{tag}_maxdiff"] = max(maxdiff(wide_ep[n], solo[n]) for n in wide)
    res["det_min_clip_scale"] = min(CLIP_SCALES)
    res["ep_rows_from_others"] = EP_ROWS


def run_ranks_tree(res: dict) -> None:
    """leaf_reduction.ranks_tree (the exchange of shards + the tree on one shard) against the
    tree it replaces: every rank's whole flat gathered, tree_sum over ranks in rank order,
    this rank's shard kept. On the world group and, with four ranks, on the two
    strided subgroups {0, 2} and {1, 3} (the FSDP groups of a 2 x 2 FSDP x TP mesh). Values
    span 1e-30..1e30 with both signs and signed zeros, so any other order or pairing of the
    adds would show in the bits."""
    from titan_rl.kernels import tree_sum
    from titan_rl.titan.leaf_reduction import ranks_tree

    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [("world", None, list(range(world)))]
    if world == 4:
        for members in ([0, 2], [1, 3]):
            g = dist.new_group(members)  # every rank creates every group, in the same order
            if rank in members:
                groups.append(("strided", g, members))
    checked, ok = 0, True
    for name, group, members in groups:
        d, me = len(members), members.index(rank)
        for dtype in (torch.float32, torch.bfloat16):
            for shard in (1, 7, 4099):
                gen = torch.Generator().manual_seed(1000 * shard + me)
                flat = torch.randn(d * shard, generator=gen) * 10.0 ** torch.randint(-30, 31, (d * shard,),
                                                                                     generator=gen)
                flat[::5] = 0.0
                flat[1::7] = -0.0
                flat = flat.to(dtype)
                everyone = [torch.empty_like(flat) for _ in range(d)]
                dist.all_gather(everyone, flat, group=group)
                want = tree_sum(torch.stack([f.view(d, -1)[me] for f in everyone]))
                out = torch.full((shard,), float("nan"), dtype=dtype)
                ranks_tree(flat, out, group)
                same = torch.equal(out, want) and torch.equal(torch.signbit(out), torch.signbit(want))
                if not same:
                    ok = False
                    res.setdefault("ranks_tree_differ", []).append([name, str(dtype), shard, rank])
                checked += 1
    flags = [None] * world
    dist.all_gather_object(flags, ok)
    res["ranks_tree_equal"], res["ranks_tree_cases"] = all(flags), checked


def run_gather_dp(res: dict) -> None:
    """titan_rl.rl.ranks.Ranks.gather_dp (tensors as rows of bytes, lengths exchanged first
    unless same_shape) returns what all_gather_object + cat returned: every dtype the step
    gathers (bool masks, int16/int32 MoE routes, bf16/fp32/fp64 values, int64), ranks with
    different and with zero lengths, 1-3 dims."""
    from titan_rl.rl.ranks import Ranks

    world, rank = dist.get_world_size(), dist.get_rank()
    ranks = Ranks(rank, world, rank, world, None)
    gen = torch.Generator().manual_seed(rank)
    ok, cases = True, 0
    for dtype in (torch.bool, torch.int16, torch.int32, torch.int64, torch.bfloat16, torch.float32, torch.float64):
        for shape in ((5,), (3, 4), (0,), (0, 3), (2, 3, 2)):
            for same in (False, True):
                n = shape[0] if same else (shape[0] + rank if shape[0] else rank % 2)
                t = (torch.randn(n, *shape[1:], generator=gen) * 100).to(dtype)
                every = [None] * world
                dist.all_gather_object(every, t)
                want, got = torch.cat(every), ranks.gather_dp(t, same_shape=same)
                ok = ok and got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
                cases += 1
    flags = [None] * world
    dist.all_gather_object(flags, ok)
    res["gather_dp_equal"], res["gather_dp_cases"] = all(flags), cases


def run_det_fsdp_dense(res: dict) -> None:
    """FSDP = world (four ranks: one leaf each, the exchange over four ranks) vs FSDP = 1,
    dense fp32 and bf16 compute, the leaf-tree reduction only."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "solo"))
    for tag, dtype in (("dense", None), ("dense_bf16", torch.bfloat16)):
        wide = det_train("qwen3", "debug", mesh["dp"], True, dtype)
        if dist.get_rank() != 0:  # the one-process run talks to no other rank: rank 0's alone
            continue
        solo = det_train("qwen3", "debug", mesh["solo"], True, dtype)
        res[f"det_{tag}_equal"] = all(torch.equal(wide[n], solo[n]) for n in wide)
        res[f"det_{tag}_maxdiff"] = max(maxdiff(wide[n], solo[n]) for n in wide)
    # EP = FSDP = 4 (GLM-5: 5 experts, 2/1/1/1 a rank) vs one process
    for tag, arch, flavor in (("glm5", "glm_moe_dsa", "debug_glm5"),):
        wide = det_train(arch, flavor, mesh["dp"], True, ep=True)
        if dist.get_rank() == 0:
            solo = det_train(arch, flavor, mesh["solo"], True)
            res[f"detep_{tag}_equal"] = all(torch.equal(wide[n], solo[n]) for n in wide)
            res[f"detep_{tag}_maxdiff"] = max(maxdiff(wide[n], solo[n]) for n in wide)
    res["det_min_clip_scale"] = min(CLIP_SCALES)
    res["ep_rows_from_others"] = EP_ROWS


DET_TP_LEAVES = 8


def run_det_tp(res: dict, tags: tuple[str, ...] = ("dense", "dense_bf16", "moe", "hybrid", "next", "glm5")) -> None:
    """TP = 2 (FSDP = world / 2: 1 on two ranks, 2 on four) and one process (TP = 1), both
    with tp_leaves > 0 and the leaf-tree reduction, train the same global batch: the
    weights after DET_STEPS steps are torch.equal (fixed-shape backward pieces, fixed
    trees over column blocks, heads, leaves and ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    solo = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "solo"))["solo"]
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    cases = [("dense", "qwen3", "debug", None), ("dense_bf16", "qwen3", "debug", torch.bfloat16),
             ("moe", "qwen3_moe", "debug_moe", None), ("hybrid", "qwen3_hybrid", "debug_hybrid", None),
             ("next", "qwen3_next", "debug_qwen3_next", None), ("q35", "qwen3_5", "debug_qwen35", None),
             ("q35moe", "qwen3_5_moe", "debug_qwen35_moe", None), ("glm5", "glm_moe_dsa", "debug_glm5", None)]
    # the odd flavors' value heads: 2 x 6 in Qwen3-Next's in_proj_ba, 6 in Qwen3.5's in_proj_b / a
    odd_leaves = {"next": 4, "q35": 2, "q35moe": 2}
    for tag, arch, flavor, dtype in (case for case in cases if case[0] in tags):
        leaves = odd_leaves.get(tag, DET_TP_LEAVES)
        t0 = time.perf_counter()
        tp = det_train(arch, flavor, mesh["dp"], True, dtype, tp_mesh=mesh["tp"], tp_leaves=leaves)
        res.setdefault("case_seconds", {})[f"tp_wide_{tag}"] = round(time.perf_counter() - t0, 1)
        if dist.get_rank() != 0:  # the one-process run talks to no other rank: rank 0's alone
            continue
        t0 = time.perf_counter()
        one = det_train(arch, flavor, solo, True, dtype, tp_leaves=leaves)
        res["case_seconds"][f"tp_solo_{tag}"] = round(time.perf_counter() - t0, 1)
        res[f"dettp_{tag}_equal"] = all(torch.equal(tp[n], one[n]) for n in one)
        res[f"dettp_{tag}_maxdiff"] = max(maxdiff(tp[n], one[n]) for n in one)
        res[f"dettp_{tag}_differ"] = sorted(n for n in one if not torch.equal(tp[n], one[n]))[:8]
    res["dettp_min_clip_scale"] = min(CLIP_SCALES)


# -- torchtitan's Trainer end to end (synthetic tokenizer and data: no downloads) ---------

def run_trainer(res: dict) -> None:
    import tempfile
    from dataclasses import dataclass

    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.trainer import Trainer

    from titan_rl.titan.spec import model_spec

    spec = model_spec("qwen3", "debug", init_seed=SEED)
    vocab = spec.model.arch_config().vocab_size

    class SynthTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = vocab

        def __init__(self, config, tokenizer_path=None, **kw):
            super().__init__()
            self.n = config.vocab_size
            self.eos_id = 1

        def encode(self, text, **kw):
            return [ord(c) % self.n for c in text]

        def decode(self, ids, **kw):
            return " ".join(map(str, ids))

        def get_vocab_size(self):
            return self.n

    class SynthLoader(BaseDataLoader):
        """Fixed seeded token rows; rank r of the batch mesh reads its own rows."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config, *, dp_world_size, dp_rank, tokenizer, seq_len, local_batch_size, **kw):
            self.seq_len, self.bs, self.rank, self.world = seq_len, local_batch_size, dp_rank, dp_world_size
            self.vocab = tokenizer.get_vocab_size()

        def __iter__(self):
            step = 0
            while True:
                g = torch.Generator().manual_seed(1000 + step)
                rows = torch.randint(0, self.vocab, (self.bs * self.world, self.seq_len + 1), generator=g)
                mine = rows[self.rank * self.bs:(self.rank + 1) * self.bs]
                yield {"input": mine[:, :-1]}, mine[:, 1:]
                step += 1

        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            pass

    world = int(os.environ["WORLD_SIZE"])
    dump = tempfile.mkdtemp(prefix="titan_trainer_")
    config = Trainer.Config(
        model_spec=spec,
        hf_assets_path=dump,
        dump_folder=dump,
        tokenizer=SynthTokenizer.Config(),
        dataloader=SynthLoader.Config(),
        loss=CrossEntropyLoss.Config(),
        optimizer=default_adamw(lr=1e-3),
        training=TrainingConfig(local_batch_size=2, seq_len=32, steps=3,
                                mixed_precision_param="float32"),
        parallelism=ParallelismConfig(data_parallel_shard_degree=world),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
    )
    cpu_compat.trainer_overrides(config)
    trainer = Trainer(config)
    orig = trainer.train_step

    def train_step(it):
        out = orig(it)
        return out

    trainer.train_step = train_step
    model = trainer.model_parts[0]
    res["trainer_model_class"] = type(model).__name__
    res["trainer_param_names_hf"] = [n for n, _ in model.named_parameters()][:3]
    # The Trainer's model after its own init (meta -> FSDP -> to_empty -> init_weights):
    # the same logits as an unsharded model initialised with the same seed.
    tok = tokens(vocab)
    with torch.no_grad():
        res["trainer_init_forward_equal"] = torch.equal(model(tok), build()(tok))
    before = [full(p).clone() for p in model.parameters()]
    trainer.train()
    res["trainer_steps"] = trainer.step
    res["trainer_params_moved"] = max(maxdiff(full(p), q) for p, q in zip(model.parameters(), before))
    with torch.no_grad():
        res["trainer_after_logits_finite"] = bool(torch.isfinite(model(tok)).all())
    trainer.close()


def main() -> int:
    mode, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    if mode != "trainer":  # the Trainer initialises the process group itself
        dist.init_process_group("gloo")
    res: dict = {"mode": mode, "world": int(os.environ["WORLD_SIZE"])}
    t0 = time.time()
    ok = True
    runs = {
        "fsdp": lambda: run_fsdp(res),
        "tp": lambda: run_tp(res),
        "trainer": lambda: run_trainer(res),
        "fsdp_tp": lambda: run_tp(res, dp_shard=2),
        "tp_moe": lambda: run_tp_moe(res),
        "tp_hybrid": lambda: run_tp_hybrid(res),
        "tp_q35": lambda: run_tp_hybrid(res, ("q35", "q35moe")),
        "det_tp_q35": lambda: run_det_tp(res, ("q35", "q35moe")),
        "engine_tp": lambda: run_engine_tp(res, os.path.dirname(os.path.abspath(out))),
        "det_fsdp": lambda: run_det_fsdp(res),
        "det_tp": lambda: run_det_tp(res),
        "det_tp_dense": lambda: run_det_tp(res, ("dense", "dense_bf16")),
        "ranks_tree": lambda: run_ranks_tree(res),
        "gather_dp": lambda: run_gather_dp(res),
        "det_fsdp_dense": lambda: run_det_fsdp_dense(res),
    }
    try:
        for part in mode.split("+"):  # "a+b": both in one launch, in that order
            if part not in runs:
                raise ValueError(f"mode {part!r}; allowed: {sorted(runs)}")
            runs[part]()
    except Exception:
        ok = False
        res["error"] = traceback.format_exc()
        print(res["error"], file=sys.stderr, flush=True)
    res["seconds"] = round(time.time() - t0, 2)
    if int(os.environ["RANK"]) == 0:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
