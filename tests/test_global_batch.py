"""The global batch (titan_rl.rl.global_batch, titan_rl.rl.seeds): the data-parallel shares
of every layout concatenate to the batch a world of one draws (prompts, supervised pairs,
sampling seeds, rollout digests); the loss over shares sums to the global batch's; a batch
the ranks cannot share equally is refused, naming the keys. Pure functions, no torchrun."""

import os
import random
import subprocess
import sys

import pytest
import torch

from titan_rl import config
from titan_rl.algorithms import PGLossConfig, loss_count, policy_gradient_loss
from titan_rl.rl.global_batch import check_global_batch, data_parallel_degree, rank_share
from titan_rl.rl.seeds import completion_seeds, prompt_seed, sft_seed
from titan_rl.rollout import Rollout
from titan_rl.tasks import load_task

LAYOUTS = [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (4, 4)]  # (world, tensor_parallel_degree)


def _rank_draws(world: int, tp: int, seed: int, step: int, prompts: int, group: int, sft: int):
    """What each rank of the layout samples, in global rank order (TP innermost, as in
    TorchTitan's mesh): (prompt texts, completion seeds, supervised pairs)."""
    task = load_task("digit_reverse", min_len=2, max_len=7)
    dp = data_parallel_degree(world, tp)
    out = []
    for rank in range(world):
        dp_rank = rank // tp
        share = rank_share(prompts, dp, dp_rank)
        examples = task.sample(prompts, seed=prompt_seed(seed, step))[share.start:share.stop]
        pairs_share = rank_share(sft, dp, dp_rank)
        pairs = task.sft_pairs(sft, seed=sft_seed(seed, step))[pairs_share.start:pairs_share.stop]
        out.append(([ex.prompt_text for ex in examples], completion_seeds(seed, step, share, group), pairs))
    return out


def test_shares_of_every_layout_concatenate_to_the_world_of_one_batch():
    rng = random.Random()
    seed, step = rng.randrange(2**31), rng.randrange(1, 10_000)
    prompts, group, sft = 4 * rng.choice([1, 3, 5]), rng.choice([2, 3, 5]), 4 * rng.choice([1, 3, 7])
    ((texts, seeds, pairs),) = _rank_draws(1, 1, seed, step, prompts, group, sft)
    assert len(texts) == prompts and len(seeds) == prompts * group and len(pairs) == sft
    assert len(set(seeds)) == len(seeds)  # every completion of the step draws its own stream
    for world, tp in LAYOUTS:
        draws = _rank_draws(world, tp, seed, step, prompts, group, sft)
        groups = [draws[r:r + tp] for r in range(0, world, tp)]
        for g in groups:  # the TP ranks of one data-parallel group sample the same share
            assert all(d == g[0] for d in g), (world, tp)
        firsts = [g[0] for g in groups]
        assert sum((d[0] for d in firsts), []) == texts, (world, tp)
        assert sum((d[1] for d in firsts), []) == seeds, (world, tp)
        assert sum((d[2] for d in firsts), []) == pairs, (world, tp)
    assert completion_seeds(seed, step + 1, range(prompts), group) != seeds


def test_a_batch_the_ranks_cannot_share_is_refused_naming_the_keys():
    cfg = config.load(None, ["--algorithm.prompts_per_step=6", "--algorithm.sft_batch=10"])
    check_global_batch(cfg, 2)
    with pytest.raises(config.ConfigError, match=r"algorithm.prompts_per_step = 6 must be divisible by the "
                                                 r"data-parallel degree 4 \(WORLD_SIZE = 4 / "
                                                 r"parallelism.tensor_parallel_degree = 1\)"):
        check_global_batch(cfg, 4)
    cfg = config.load(None, ["--algorithm.prompts_per_step=4", "--algorithm.sft_batch=10",
                             "--parallelism.tensor_parallel_degree=2", "--model.tp_leaves=8"])
    check_global_batch(cfg, 4)  # 2 data-parallel groups of 2 TP ranks
    with pytest.raises(config.ConfigError, match=r"algorithm.sft_batch = 10 must be divisible by the data-parallel "
                                                 r"degree 4 \(WORLD_SIZE = 8 / parallelism.tensor_parallel_degree = 2"):
        check_global_batch(cfg, 8)
    cfg = config.load(None, ["--algorithm.prompts_per_step=4", "--algorithm.sft_batch=10", "--algorithm.sft_steps=0",
                             "--parallelism.gradient_leaves=4"])
    check_global_batch(cfg, 4)  # no SFT step: sft_batch is never drawn
    auto = config.load(None, ["--algorithm.prompts_per_step=4", "--algorithm.sft_steps=0"])
    with pytest.raises(config.ConfigError, match=r"parallelism.gradient_leaves = 2 \(0 = auto: .*\) must be divisible by "
                                                 r"the data-parallel degree 4 .* a power of two >= 4"):
        check_global_batch(auto, 4)
    with pytest.raises(ValueError, match="do not split"):
        rank_share(5, 2, 0)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_loss_over_shares_with_the_global_count_sums_to_the_global_loss(agg):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    B, T = 6, 13
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    mu = logp.detach() + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[2] = False  # a sequence without a valid token
    cfg = PGLossConfig(clip_eps=0.2, agg=agg)
    whole, _ = policy_gradient_loss(logp, mu, adv, mask, cfg)
    (grad_whole,) = torch.autograd.grad(whole, logp)
    count = loss_count(mask, agg)
    parts, grad = 0.0, torch.zeros_like(logp)
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6)):
        part, _ = policy_gradient_loss(logp[rows], mu[rows], adv[rows], mask[rows], cfg, count=count)
        parts = parts + part
        grad += torch.autograd.grad(part, logp)[0]
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_whole, rtol=1e-12, atol=1e-12)
    local, _ = policy_gradient_loss(logp[:2], mu[:2], adv[:2], mask[:2], cfg)  # a share's own mean
    assert not torch.allclose(local, policy_gradient_loss(logp[:2], mu[:2], adv[:2], mask[:2], cfg, count=count)[0])


def _rollout(n: int, g: torch.Generator) -> Rollout:
    prompts = [torch.randint(0, 19, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    tokens = [torch.randint(0, 19, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
              for _ in range(n)]
    mu = [-torch.rand(len(t), generator=g, dtype=torch.float64) for t in tokens]
    return Rollout([str(i) for i in range(n)], prompts, tokens, mu, [None] * n)


def test_rollout_digests_are_per_request_and_see_every_bit():
    g = torch.Generator().manual_seed(random.randrange(2**31))
    whole = _rollout(7, g)
    rewards = torch.rand(7, generator=g)
    d = whole.digests(rewards)
    assert d.shape == (7, 32) and d.dtype == torch.uint8
    first = Rollout(whole.request_ids[:3], whole.prompts[:3], whole.tokens[:3], whole.mu[:3], whole.full[:3])
    rest = Rollout(whole.request_ids[3:], whole.prompts[3:], whole.tokens[3:], whole.mu[3:], whole.full[3:])
    assert torch.equal(torch.cat([first.digests(rewards[:3]), rest.digests(rewards[3:])]), d)
    flipped = whole.mu[4].clone()
    flipped.view(torch.int64)[0] ^= 1  # one bit of one sampler log-prob
    changed = Rollout(whole.request_ids, whole.prompts, whole.tokens, whole.mu[:4] + [flipped] + whole.mu[5:],
                      whole.full)
    diff = (changed.digests(rewards) != d).any(dim=1)
    assert diff.tolist() == [i == 4 for i in range(7)]
    r2 = rewards.clone()
    r2[6] = torch.nextafter(r2[6], torch.tensor(2.0))
    assert (whole.digests(r2) != d).any(dim=1).tolist() == [i == 6 for i in range(7)]


def test_engine_pieces_joined_and_cut_into_shares_keep_every_request_and_record():
    """Separate engines: each engine's piece is a Rollout with its records; `join` then `rows`
    (one rank's share) must give each request its own kept rows, routes and bytes whatever the cut."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    whole = _rollout(7, g)
    n_tok = whole.num_tokens
    whole.kept = torch.rand(n_tok, 11, generator=g) < 0.5
    whole.kept_bytes_each = torch.randint(1, 50, (7,), generator=g).tolist()
    whole.routes = [torch.randint(0, 5, (len(p) + len(t) - 1, 3, 2), generator=g, dtype=torch.uint8)
                    for p, t in zip(whole.prompts, whole.tokens)]
    whole.route_bytes_per_token = 6
    for cut in ([0, 3, 7], [0, 0, 5, 7], [0, 1, 2, 6, 7]):
        pieces = [whole.rows(a, b) for a, b in zip(cut, cut[1:])]
        again = Rollout.join(pieces)
        assert again.tokens == whole.tokens and again.prompts == whole.prompts
        assert torch.equal(again.kept, whole.kept) and again.kept_bytes == whole.kept_bytes
        assert all(torch.equal(x, y) for x, y in zip(again.routes, whole.routes)) and len(again.routes) == 7
        for piece, a, b in zip(pieces, cut, cut[1:]):
            at = sum(map(len, whole.tokens[:a]))
            assert torch.equal(piece.kept, whole.kept[at:at + piece.num_tokens])
            assert piece.kept_bytes == sum(whole.kept_bytes_each[a:b]) and piece.route_bytes_per_token == 6


def test_the_command_line_refuses_it_at_start_in_one_line(tmp_path):
    """`python -m titan_rl.train` checks the share before anything starts (WORLD_SIZE as
    torchrun sets it): one line, exit code 2."""
    env = dict(os.environ, WORLD_SIZE="2", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "titan_rl.train", "--run-dir", str(tmp_path / "run"),
                        "--algorithm.prompts_per_step=3"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.strip() == ("config error: algorithm.prompts_per_step = 3 must be divisible by the data-parallel "
                                "degree 2 (WORLD_SIZE = 2 / parallelism.tensor_parallel_degree = 1): it counts the "
                                "whole step, and each data-parallel rank takes an equal share")


def test_gradient_leaves_tile_the_global_batch_in_aligned_runs():
    """Every layout's ranks own equal, consecutive runs of the same leaves, which tile the
    global batch in order; the leaf count is a function of the config alone."""
    from titan_rl import layout
    from titan_rl.rl.batch_plan import gradient_leaves

    for dp in (1, 2, 4, 8):
        runs = [gradient_leaves(48, 8, dp, r) for r in range(dp)]
        assert [leaf for run in runs for leaf in run] == [range(6 * j, 6 * j + 6) for j in range(8)]
        assert all(len(run) == 8 // dp for run in runs)
        assert all(run[0].start == r * 48 // dp for r, run in enumerate(runs))
    for bad in ((48, 6, 1), (50, 8, 1), (48, 8, 16)):
        with pytest.raises(ValueError):
            gradient_leaves(*bad, 0)
    auto = config.load(None, ["--algorithm.prompts_per_step=3", "--algorithm.group_size=4", "--algorithm.sft_batch=16"])
    assert layout.leaf_count(auto) == layout.AUTO_MAX_LEAVES == 2  # 12 and 16 sequences
    odd = config.load(None, ["--algorithm.prompts_per_step=1", "--algorithm.group_size=3", "--algorithm.sft_steps=0"])
    assert layout.leaf_count(odd) == 1  # 3 sequences: no power of two above 1 divides them
    assert layout.uses_leaf_tree(auto)  # on by default in exact mode
    assert not layout.uses_leaf_tree(config.load(None, ["--model.kernels=\"stock\""]))


def test_tree_stack_adds_in_tree_sums_order():
    """TreeStack (the per-unit accumulator of titan_rl.titan.leaf_reduction) gives
    tree_sum's balanced tree, bit for bit, not the sequential sum's."""
    from titan_rl.kernels import tree_sum
    from titan_rl.titan.leaf_reduction import TreeStack

    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 4, 8, 16):
        leaves = torch.randn(n, 1001, generator=g) * torch.logspace(-3, 3, 1001)
        stack = TreeStack()
        for leaf in leaves:
            stack.push(leaf.clone())
        assert torch.equal(stack.pop(), tree_sum(leaves))
    stack = TreeStack()
    for leaf in leaves[:3]:
        stack.push(leaf)
    with pytest.raises(RuntimeError, match="power of two"):
        stack.pop()


def test_deterministic_reduction_refusals_name_the_key():
    cases = [
        (["--model.kernels=\"stock\"", "--parallelism.deterministic_reduction=true"],
         r"parallelism.deterministic_reduction = true cannot be honoured with model.kernels = 'stock'"),
        (["--parallelism.gradient_leaves=6"], r"parallelism.gradient_leaves = 6: must be 0 \(auto\) or a power of two"),
        (["--parallelism.gradient_leaves=16", "--algorithm.prompts_per_step=2", "--algorithm.group_size=4"],
         r"parallelism.gradient_leaves = 16 must divide algorithm.prompts_per_step x group_size = 8"),
    ]
    for overrides, match in cases:
        with pytest.raises(config.ConfigError, match=match):
            config.load(None, overrides)
    cfg = config.load(None, ["--parallelism.gradient_leaves=2", "--algorithm.prompts_per_step=4",
                             "--algorithm.sft_batch=16"])
    with pytest.raises(config.ConfigError, match=r"parallelism.gradient_leaves = 2 must be divisible by the "
                                                 r"data-parallel degree 4"):
        check_global_batch(cfg, 4)
    check_global_batch(config.load(None, ["--parallelism.deterministic_reduction=false",
                                          "--parallelism.gradient_leaves=2", "--algorithm.prompts_per_step=4",
                                          "--algorithm.sft_batch=16"]), 4)


def test_expert_parallel_refusals_name_the_key_and_what_is_allowed():
    """parallelism.expert_parallel_degree (titan_rl/titan/expert_parallel.py): refused at start, by key,
    where it is not built; allowed with an MoE model, the leaf tree and EP = the data-parallel degree."""
    moe = ["--model.name=\"qwen3_moe\"", "--model.flavor=\"debug_moe\""]
    cases = [
        (["--parallelism.expert_parallel_degree=2"],
         r"parallelism.expert_parallel_degree = 2 needs a mixture-of-experts model; model.name = 'qwen3'"),
        ([*moe, "--parallelism.expert_parallel_degree=0"], r"parallelism.expert_parallel_degree = 0: must be >= 1"),
        ([*moe, "--parallelism.expert_parallel_degree=2", "--activation_checkpoint.mode=full"],
         r"expert_parallel_degree = 2 with activation_checkpoint.mode = 'full' is not built .*allowed: "
         r"activation_checkpoint.mode = 'none'"),
        ([*moe, "--parallelism.expert_parallel_degree=2", "--parallelism.tensor_parallel_degree=2",
          "--model.tp_leaves=2"],
         r"expert_parallel_degree = 2 with parallelism.tensor_parallel_degree = 2 is not built"),
        ([*moe, "--parallelism.expert_parallel_degree=2", "--parallelism.deterministic_reduction=false"],
         r"expert_parallel_degree = 2 needs the leaf tree"),
        ([*moe, "--parallelism.expert_parallel_degree=2", "--model.kernels=\"stock\""],
         r"expert_parallel_degree = 2 needs the leaf tree"),
        ([*moe, "--parallelism.expert_parallel_degree=16"],
         r"expert_parallel_degree = 16 must be <= the model's routed experts \(8\)"),
        ([*moe, "--parallelism.expert_parallel_degree=2", "--quantization.recipe=\"fp8_rowwise\""],
         r"expert_parallel_degree = 2 with quantization.recipe = 'fp8_rowwise' is not built"),
    ]
    for overrides, match in cases:
        with pytest.raises(config.ConfigError, match=match):
            config.load(None, overrides)
    cfg = config.load(None, [*moe, "--parallelism.expert_parallel_degree=2"])
    check_global_batch(cfg, 2)
    for world in (1, 4):
        with pytest.raises(config.ConfigError, match=rf"parallelism.expert_parallel_degree = 2 must equal the "
                                                     rf"data-parallel degree {world} \(WORLD_SIZE = {world}"):
            check_global_batch(cfg, world)
