"""RLTrainer: TorchTitan's Trainer with an RL step (see titan_rl/train.py for the flow).

TorchTitan owns: model build + parallelize (our ModelSpec), the optimizer and LR schedule
objects, DCP checkpoints (save every `checkpoint.interval`, resume on relaunch), the step
loop. We override `train_step`, and inside it clip gradients (`_optimizer_step`) and set
the LR per phase (`_set_phase_lr`) ourselves. A step's batch is global
(titan_rl.rl.global_batch: each data-parallel rank takes its share) and everything random
is a pure function of (training.seed, step, global index), never of the rank, so a run
resumed from a checkpoint replays the same prompts and the same sampling seeds and logs
the same metrics as an uninterrupted run, and every layout samples the same rollouts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Before torchtitan: importing titan_rl.titan installs the CPU shims its import needs.
from titan_rl.titan import cpu_compat

from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.trainer import Trainer

from titan_rl.algorithms import (
    PGLossConfig, apply_corrections, enabled, group_advantages, loss_count, policy_gradient_loss,
    warning_if_exact,
)
from titan_rl import contract
from titan_rl.checkpoint import checkpoint_fingerprint
from titan_rl.config import Config, deterministic_reduction, gradient_leaf_count
from titan_rl.kernels import log_softmax_fp32, tree_sum
from titan_rl.metrics import STEP_MISMATCH, expert_disagreement, logprob_mismatch
from titan_rl.registry import get_architecture
from titan_rl.rl.global_batch import gradient_leaves, rank_share
from titan_rl.rl.seeds import completion_seeds, prompt_seed, sft_seed
from titan_rl.rollout import Rollout, pad_sequences, response_mask
from titan_rl.tasks import load_task
from titan_rl.titan import leaf_reduction
from titan_rl.validation import RunStopped, UserError, check_reward, latest_checkpoint_step

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# -- TorchTitan components the Trainer insists on building; RL data comes from the task --
class _NullTokenizer(BaseTokenizer):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 0

    def __init__(self, config, tokenizer_path=None, **kw):
        super().__init__()
        self.n = config.vocab_size

    def encode(self, text, **kw):
        raise NotImplementedError("RL prompts come from the task's tokenizer")

    def decode(self, ids, **kw):
        raise NotImplementedError

    def get_vocab_size(self):
        return self.n


class _StepLoader(BaseDataLoader):
    """Never iterated: a step's prompts are a pure function of (seed, step)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        pass

    def __init__(self, config, **kw):
        pass

    def __iter__(self):
        while True:
            yield {}, torch.zeros(1, 1, dtype=torch.long)

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass



def _widen(t: torch.Tensor, width: int, fill) -> torch.Tensor:
    """t [B, w, ...] right-padded with `fill` to [B, width, ...]."""
    out = torch.full((t.shape[0], width, *t.shape[2:]), fill, dtype=t.dtype)
    out[:, :t.shape[1]] = t
    return out


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def build_titan_config(cfg: Config, run_dir: str) -> Trainer.Config:
    from dataclasses import replace

    from titan_rl.titan.sections import trainer_sections
    from titan_rl.titan.spec import model_spec

    fields, initial_load = {}, {}
    if cfg.model.checkpoint:  # a local HF folder: its config.json defines the model, TorchTitan loads it
        cfg_path = os.path.join(cfg.model.checkpoint, "config.json")
        if not os.path.isfile(cfg_path):
            raise SystemExit(f"model.checkpoint = {cfg.model.checkpoint!r}: no config.json in that folder")
        with open(cfg_path) as f:
            fields["model_config"] = get_architecture(cfg.model.name).config_from_hf(json.load(f))
        initial_load = dict(enable=True, initial_load_path=cfg.model.checkpoint, initial_load_in_hf=True,
                            initial_load_model_only=True)
    q = cfg.quantization
    if q.recipe != "none":  # in the model's own config: the engine gets it through config.json
        base = fields.get("model_config") or get_architecture(cfg.model.name).flavors[cfg.model.flavor]
        fields["model_config"] = replace(base, quant_recipe=q.recipe, quant_layers=tuple(q.layers))
    spec = model_spec(cfg.model.name, cfg.model.flavor, cfg.model.kernels, init_seed=cfg.model.seed,
                      init_std=cfg.model.init_std, tp_leaves=cfg.model.tp_leaves, **fields)
    sections = trainer_sections(cfg)
    # the keys titan_rl derives (refused in TOML): one sequence per row, as long as the engine's
    sections["training"].local_batch_size = 1
    sections["training"].seq_len = cfg.rollout.max_model_len
    sections["training"].mixed_precision_param = cfg.model.dtype
    config = Trainer.Config(
        model_spec=spec,
        hf_assets_path=run_dir,
        dump_folder=run_dir,
        tokenizer=_NullTokenizer.Config(vocab_size=spec.model.arch_config().vocab_size),
        dataloader=_StepLoader.Config(),
        loss=CrossEntropyLoss.Config(),
        checkpoint=replace(cfg.checkpoint, **initial_load),
        **sections,
    )
    cpu_compat.trainer_overrides(config)
    return config


class RLTrainer(Trainer):
    def __init__(self, config: Trainer.Config, rl: Config, run_dir: str, task=None, config_changes=None):
        self.rl, self.run_dir = rl, run_dir
        self.task = task if task is not None else load_task(rl.task.name, **rl.task.kwargs)
        self.config_changes = config_changes or {}
        self._skipped = False
        super().__init__(config)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # Each data-parallel rank takes its share of the global batch; the TP ranks of one
        # replica take the same share (their collectives are one computation).
        dp = self.parallel_dims.get_mesh("batch") if self.parallel_dims.dp_enabled else None
        self.dp_rank, self.dp_degree = (dp.get_local_rank(), dp.size()) if dp is not None else (0, 1)
        self.dp_group = dp.get_group() if dp is not None else None
        self.engine = None
        # (trainer side, engine side, entries allowed to differ) of the last contract check,
        # and the last contract hash metrics.jsonl holds (its entries are written when it changes)
        self._contract = None
        self._logged_contract = None
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        self._resumed_checked = False
        self.corrections = rl.correction
        self._warned_exact = False
        self._base_lrs = [list(s.base_lrs) for s in self.lr_schedulers.schedulers]
        self.is_moe = get_architecture(rl.model.name).moe
        # parallelism.deterministic_reduction: the step's global batch is cut into gradient
        # leaves, reduced by one fixed tree (titan_rl.titan.leaf_reduction); None: FSDP2's own
        self.leaves = leaf_reduction.install(self.model) if deterministic_reduction(rl) else None
        self.gradient_reduction = f"{gradient_leaf_count(rl)} leaves, fixed tree" if self.leaves else "collective"
        tok = self.task.tokenizer
        vocab = self.model_parts[0].cfg.vocab_size
        if tok.vocab_size > vocab:
            raise ValueError(f"task {rl.task.name!r} needs {tok.vocab_size} token ids; model vocab_size is {vocab}")

    # -- helpers ---------------------------------------------------------------------
    @property
    def model(self):
        return self.model_parts[0]

    def _full_state(self) -> dict[str, torch.Tensor]:
        dtype = DTYPES[self.rl.model.dtype]
        return {n: _full(p).detach().to(dtype).contiguous() for n, p in self.model.named_parameters()}

    def _optimizer_step(self, loss: float) -> float:
        """Clip by the global grad norm and step (the LR schedule advances once per training
        step, in train_step, however many updates a batch gets). The norm is taken
        over full gradients: under TP, parameters live on different meshes (TP-sharded
        linears vs FSDP-only norms/embeddings), which TorchTitan's clip_grad_norm_ cannot
        stack; full_tensor() gives every rank the same norm."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        total = leaf_reduction.grad_norm(self.model.parameters())
        # A NaN/inf here would reach every weight through the optimizer and be saved in
        # the next checkpoint; the loss is per rank, so the decision is taken by all ranks.
        if self._reduce(0.0 if math.isfinite(loss) and bool(torch.isfinite(total)) else 1.0, "max") > 0:
            self.optimizers.zero_grad()
            what = f"non-finite loss {loss} / grad norm {float(total)} at step {self.step}"
            if self.rl.algorithm.on_nonfinite == "stop":
                last = latest_checkpoint_step(self.rl, self.run_dir) if self.rl.checkpoint.enable else 0
                kept = f"the last checkpoint (step {last}) is intact" if last else "no checkpoint was written"
                raise RunStopped(f"{what}: stopped before the optimizer step, so no weight changed; {kept}. "
                                 "Lower optimizer.lr, or set algorithm.on_nonfinite = 'skip' to skip such steps")
            self._skipped = True
            if self.rank == 0:
                print(f"WARNING: {what}: step skipped (algorithm.on_nonfinite = 'skip')", flush=True)
            return float(total)
        coef = torch.clamp(self.rl.training.max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        self.optimizers.step()
        self.optimizers.zero_grad()
        return float(total)

    def _sampled_logprobs(self, batch, mask, kept=None) -> torch.Tensor:
        """log pi of the sampled tokens under the policy the sampler drew from (the same
        temperature, renormalised over the same top-k/top-p kept set: recomputed from our
        bitwise-equal logits, or replayed from the sampler's record), [B, L-1], 0 where
        mask is False. With temperature 1 and no top-k/top-p this is the plain log-softmax."""
        from titan_rl.kernels.sampling import sampled_logprobs

        s = self.rl.sampling
        rows = self.model(batch)[:, :-1][mask]
        pi = sampled_logprobs(rows, batch[:, 1:][mask], s.temperature, top_k=s.top_k or None,
                              top_p=s.top_p if s.top_p < 1.0 else None, kept=kept)
        return torch.zeros(mask.shape, dtype=pi.dtype).masked_scatter(mask, pi)

    def _token_logprobs(self, batch: torch.Tensor) -> torch.Tensor:
        """log pi of batch[:, 1:] given the prefix: [B, L-1] (fp32)."""
        logp = log_softmax_fp32(self.model(batch))
        return logp[:, :-1].gather(-1, batch[:, 1:, None])[..., 0]

    def _reduce(self, x: float, how: str, over_dp: bool = False) -> float:
        """x combined over all ranks, or over the data-parallel ranks (one value per share
        of the global batch; TP ranks of a replica hold the same one): "mean", "sum", "max"."""
        group, n = (self.dp_group, self.dp_degree) if over_dp else (None, self.world)
        if n == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if how == "max" else dist.ReduceOp.SUM, group=group)
        return float(t) / n if how == "mean" else float(t)

    def _parts(self, total: int, start: int) -> tuple[list[range], int]:
        """The pieces of this rank's share (items [start, start + share) of `total`) that get
        one forward and backward each, as local rows, and how many the whole step has:
        deterministic reduction: this rank's gradient leaves; else the share at once."""
        if self.leaves is None:
            return [range(0, total // self.dp_degree)], self.dp_degree
        n = gradient_leaf_count(self.rl)
        return [range(r.start - start, r.stop - start) for r in gradient_leaves(total, n, self.dp_degree,
                                                                                self.dp_rank)], n

    def _global_width(self, batch: torch.Tensor, pad: int) -> torch.Tensor:
        """Deterministic reduction: `batch` right-padded to the global batch's longest row, so
        every leaf has the same shape on every layout (a row's forward does not depend on
        padding after it)."""
        if self.leaves is None:
            return batch
        width = int(self._reduce(float(batch.shape[1]), "max", over_dp=True))
        return torch.nn.functional.pad(batch, (0, width - batch.shape[1]), value=pad)

    def _gather_dp(self, t: torch.Tensor) -> torch.Tensor:
        """The data-parallel ranks' `t` (any length along dim 0), concatenated in rank order:
        the global batch's values, for statistics that must not depend on the layout."""
        if self.dp_degree == 1:
            return t
        parts = [None] * self.dp_degree
        dist.all_gather_object(parts, t, group=self.dp_group)
        return torch.cat(parts)

    def _step_sum(self, values: list[torch.Tensor]) -> float:
        """Sum over the step's pieces and ranks: the leaf tree under deterministic reduction
        (the same value on every layout), else the ranks' sum."""
        if self.leaves is None:
            return self._reduce(float(sum(values)), "sum", over_dp=True)
        return float(tree_sum(self._gather_dp(torch.stack(values))))

    def _backward(self, j: int, parts: list, loss: torch.Tensor) -> None:
        if self.leaves is not None:
            self.leaves.last_leaf = j == len(parts) - 1
        loss.backward()

    def _rollout_sha256(self, rollout: Rollout, rewards: torch.Tensor) -> str:
        """sha256 over the per-request digests of the step's global batch, in global order:
        equal across layouts exactly when every rank sampled the same tokens, mu and rewards."""
        local = rollout.digests(rewards)
        parts = [local]
        if self.dp_degree > 1:
            parts = [torch.empty_like(local) for _ in range(self.dp_degree)]
            dist.all_gather(parts, local, group=self.dp_group)
        return hashlib.sha256(torch.cat(parts).numpy().tobytes()).hexdigest()

    # -- engine ------------------------------------------------------------------------
    def _make_engine(self):
        from titan_rl.checkpoint import save_hf_folder
        from titan_rl.vllm.engine import make_llm

        folder = os.path.join(self.run_dir, f"engine_weights_rank{self.rank}")
        save_hf_folder(self.model, folder, dtype=DTYPES[self.rl.model.dtype], arch=self.rl.model.name,
                       state_dict=self._full_state())
        r, a = self.rl.rollout, self.rl.algorithm
        self.engine = make_llm(folder, arch=self.rl.model.name, kernels=self.rl.model.kernels,
                               dtype=self.rl.model.dtype, seed=self.rl.training.seed,
                               kv_cache_mib=r.kv_cache_mib, max_model_len=r.max_model_len,
                               max_num_seqs=max(r.max_num_seqs, a.prompts_per_step // self.dp_degree * a.group_size),
                               enable_prefix_caching=r.enable_prefix_caching,
                               logprobs_mode="processed_logprobs", quantization=self.rl.quantization.recipe)
        self._check_contract("before the first rollout")

    def _check_contract(self, when: str) -> None:
        """The execution contract (titan_rl.contract) of the trainer's model against the
        engine's, computed from what each side holds; all ranks stop together if one
        refuses. The trainer computes in its FSDP mixed-precision dtype."""
        mine = contract.contract_of(self.model, dtype=DTYPES[self.config.training.mixed_precision_param],
                                    gradient_leaves=self.gradient_reduction)
        engine = contract.engine_contract(self.engine)
        error, differs = None, []
        try:
            differs = contract.check(mine, engine, when=when)
        except contract.ContractMismatch as e:
            error = e
        if self._reduce(1.0 if error else 0.0, "max") > 0:
            raise error or contract.ContractMismatch(
                f"execution contract {when}: another rank's engine differs from its trainer (that rank names "
                "the entries)")
        self._contract = (mine, engine, differs)

    def _contract_metrics(self) -> dict:
        """The step line's contract: its hash on every RL line, its entries on the first and
        whenever the hash changes; in stock mode also the engine's hash and the entries
        that differ by design."""
        mine, engine, differs = self._contract
        m: dict = {"contract": mine.hash}
        if differs:
            m.update(contract_engine=engine.hash, contract_differs=differs)
        if mine.hash != self._logged_contract:
            m["contract_entries"] = mine.entries()
            if differs:
                m["contract_engine_entries"] = engine.entries()
            self._logged_contract = mine.hash
        return m

    def sync_weights(self) -> bool | None:
        """Trainer weights -> engine (prefix cache reset); returns checksum equality
        (None for the stock engine, whose fused qkv/gate_up parameters have other names).
        Quantized linears: their weights are quantized once here and shipped as payload +
        scales; the checksum compares the trainer's fake-quantized weights with the
        engine's dequantized payloads (titan_rl.quant_weights)."""
        from titan_rl.quant_weights import engine_weights, fake_quantized_state, quantized_state, weight_recipes
        from titan_rl.vllm.engine import engine_model, update_weights

        state = self._full_state()
        recipes = weight_recipes(self.model)
        update_weights(self.engine, quantized_state(state, recipes))
        self._check_contract(f"after the weight sync of step {self.step}")
        if self.rl.model.kernels == "stock":
            return None
        engine_state = {n: w for n, w in engine_weights(engine_model(self.engine)).items() if n in state}
        same = checkpoint_fingerprint(fake_quantized_state(state, recipes)) == checkpoint_fingerprint(engine_state)
        if not same:
            raise RuntimeError("weight sync failed: engine and trainer weight checksums differ")
        return same

    # -- the step ------------------------------------------------------------------------
    def train_step(self, data_iterator):
        if not self._resumed_checked:
            self._truncate_metrics()
            self._resumed_checked = True
        t0 = time.perf_counter()
        self._skipped = False
        self.model.train()
        self._set_phase_lr()
        lr = self.optimizers.optimizers[0].param_groups[0]["lr"]
        if self.step <= self.rl.algorithm.sft_steps:
            m = self._sft_step()
        else:
            m = self._rl_step()
        self.lr_schedulers.step()
        m["step"] = self.step
        m["lr"] = lr
        m["step_seconds"] = time.perf_counter() - t0
        if self._skipped:
            m["skipped_nonfinite"] = True
        if self.config_changes:  # the first step after a relaunch that changed these keys
            m["config_changes"] = {k: list(v) for k, v in self.config_changes.items()}
            if self.rank == 0:
                listed = "; ".join(f"{k}: {o!r} -> {n!r}" for k, (o, n) in self.config_changes.items())
                print(f"WARNING: resumed at step {self.step} with changed config (allowed): {listed}", flush=True)
            self.config_changes = {}
        self._log(m)

    def _sft_step(self) -> dict:
        a, tok = self.rl.algorithm, self.task.tokenizer
        share = rank_share(a.sft_batch, self.dp_degree, self.dp_rank)
        pairs = self.task.sft_pairs(a.sft_batch, seed=sft_seed(self.rl.training.seed, self.step))
        pairs = pairs[share.start:share.stop]
        batch = self._global_width(pad_sequences([p + t for p, t in pairs], tok.pad_id), tok.pad_id)
        mask = response_mask([len(p) for p, _ in pairs], [len(t) for _, t in pairs], batch.shape[1] - 1)
        t0 = time.perf_counter()
        # the token mean over the global batch: the pieces' losses and gradients sum to it
        tokens = torch.tensor(self._reduce(float(mask.sum()), "sum", over_dp=True), dtype=torch.float32)
        parts, n_parts = self._parts(a.sft_batch, share.start)
        losses = []
        for j, rows in enumerate(parts):
            logp = self._token_logprobs(batch[rows.start:rows.stop])
            loss = -(logp * mask[rows.start:rows.stop]).sum() / tokens + self._aux_loss() / n_parts
            self._backward(j, parts, loss)
            losses.append(loss.detach())
        loss = self._step_sum(losses)
        grad_norm = self._optimizer_step(loss)
        return {"phase": "sft", "loss": loss, "grad_norm": grad_norm,
                "train_tokens_per_s": batch.numel() / (time.perf_counter() - t0)}

    def _rollout(self) -> tuple[list, Rollout, float]:
        """Sample this data-parallel rank's share of the step's global prompts: (the task
        example of each request, the rollout, seconds spent in generate)."""
        from vllm import SamplingParams

        if self.engine is None:
            self._make_engine()
        a, s, seed = self.rl.algorithm, self.rl.sampling, self.rl.training.seed
        share = rank_share(a.prompts_per_step, self.dp_degree, self.dp_rank)
        examples = self.task.sample(a.prompts_per_step, seed=prompt_seed(seed, self.step))[share.start:share.stop]
        seeds = iter(completion_seeds(seed, self.step, share, a.group_size))
        reqs, params = [], []
        for ex in examples:
            for _ in range(a.group_size):
                reqs.append({"prompt_token_ids": list(ex.prompt_ids)})
                params.append(SamplingParams(
                    temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=self.task.max_new_tokens,
                    stop_token_ids=[self.task.tokenizer.eos_id], logprobs=0, seed=next(seeds)))
        t0 = time.perf_counter()
        ks = rec = None
        with contextlib.ExitStack() as stack:
            if s.mask_mode == "replay":
                from titan_rl.vllm.sampling import capture_kept_sets

                ks = stack.enter_context(capture_kept_sets(self.engine))
            if self.is_moe:  # always recorded: disagreement is measured even without replay
                from titan_rl.vllm.routes import capture_routes

                rec = stack.enter_context(capture_routes(self.engine))
            outs = self.engine.generate(reqs, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        # read after the captures closed: closing is where they report unattributed steps
        rollout = Rollout.from_vllm(outs, kept_sets=ks, routes=rec)
        return [examples[j // a.group_size] for j in range(len(rollout))], rollout, dt

    def _set_phase_lr(self) -> None:
        """LR for this step = configured base x phase scale x schedule(step), recomputed
        from scratch every step: TorchTitan checkpoints only the schedule's step count
        (not base_lrs), so nothing here may depend on state a resume would lose."""
        scale = self.rl.algorithm.rl_lr_scale if self.step > self.rl.algorithm.sft_steps else 1.0
        for sched, base0 in zip(self.lr_schedulers.schedulers, self._base_lrs):
            sched.base_lrs = [b * scale for b in base0]
            with warnings.catch_warnings():  # get_lr() outside step() warns; it is the pure schedule here
                warnings.simplefilter("ignore", UserWarning)
                lrs = sched.get_lr()
            for group, lr in zip(sched.optimizer.param_groups, lrs):
                group["lr"] = lr

    def _rl_step(self) -> dict:
        a = self.rl.algorithm
        det = self.leaves is not None
        examples, rollout, t_roll = self._rollout()
        rewards = torch.tensor(self._rewards(examples, rollout.tokens), dtype=torch.float32)
        adv = group_advantages(rewards, a.group_size, scale=a.advantage_scale)
        pad = self.task.tokenizer.pad_id
        batch = self._global_width(rollout.batch(pad), pad)
        B, L = batch.shape
        mask, mu = _widen(rollout.mask(), L - 1, False), _widen(rollout.padded_mu(), L - 1, 0.0)
        loss_cfg = PGLossConfig(clip_eps=a.clip_eps or None, agg=a.loss_agg)
        metrics: dict = {}
        engine_routes = None
        if rollout.routes is not None:
            engine_routes = _widen(rollout.padded_routes(), L, -1)
            metrics["route_bytes_per_token"] = rollout.route_bytes_per_token
        replay = engine_routes is not None and self.rl.rollout.router_replay == "replay"
        parts, n_parts = self._parts(B * self.dp_degree, B * self.dp_rank)
        kept_at = [0, *mask.sum(1).cumsum(0).tolist()]  # rollout.kept rows: the masked tokens, row by row

        def forward(r: range, own: list | None) -> torch.Tensor:
            """log pi of rows r; `own`, if given, collects the router's own choices."""
            if replay:
                flat = engine_routes[r.start:r.stop].reshape(len(r) * L, *engine_routes.shape[2:])
                self.model.set_route_override([flat[:, layer] for layer in range(flat.shape[1])])
            kept = None if rollout.kept is None else rollout.kept[kept_at[r.start]:kept_at[r.stop]]
            logp = self._sampled_logprobs(batch[r.start:r.stop], mask[r.start:r.stop], kept)
            if own is not None and engine_routes is not None:
                own.append(torch.stack(self.model.last_own_routes, 1))
            return logp

        def at_rollout_weights(pi_old: torch.Tensor, own: list) -> None:
            """Engine vs trainer at the rollout's weights (mismatch, not policy lag), and
            the corrections that need it."""
            nonlocal ref, weights, loss_mask
            metrics.update(self._mismatch(pi_old[mask], mu[mask]))
            if engine_routes is not None:
                metrics["expert_disagreement"] = self._expert_disagreement(
                    engine_routes, torch.cat(own).view(B, L, *engine_routes.shape[2:]))
            if enabled(self.corrections):
                ref, weights, loss_mask, cstats = self._correct(pi_old, mu, mask, metrics)
                metrics.update(cstats)

        t = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        ref, weights, loss_mask = mu, None, mask
        for k in range(a.updates_per_batch):
            # corrections need the whole share's pi_old before the first leaf's loss
            pre = k == 0 and enabled(self.corrections) and len(parts) > 1
            own: list = []
            if pre:
                t0 = time.perf_counter()
                with torch.no_grad():
                    at_rollout_weights(torch.cat([forward(r, own) for r in parts]), own)
                t["forward"] += time.perf_counter() - t0
            logps, losses, auxes, clipped, lag = [], [], [], 0, float("-inf")
            for j, r in enumerate(parts):
                t0 = time.perf_counter()
                logp = forward(r, own if k == 0 and not pre else None)
                t1 = time.perf_counter()
                if k == 0 and len(parts) == 1:
                    at_rollout_weights(logp.detach(), own)
                if j == 0:  # the aggregate over the global batch: the pieces' losses and gradients sum to it
                    count = int(self._reduce(loss_count(loss_mask, a.loss_agg), "sum", over_dp=True))
                rows = slice(r.start, r.stop)
                loss, stats = policy_gradient_loss(logp, ref[rows], adv[rows], loss_mask[rows], loss_cfg,
                                                   weights=None if weights is None else weights[rows], count=count)
                aux = self._aux_loss()
                loss = loss + aux / n_parts
                t2 = time.perf_counter()
                self._backward(j, parts, loss)
                t3 = time.perf_counter()
                logps.append(logp.detach())
                losses.append(loss.detach())
                if self.is_moe:
                    auxes.append(self.model.aux_loss.detach())
                n_valid = int(loss_mask[rows].sum())
                clipped += round(stats["clip_fraction"] * n_valid) if n_valid else 0
                lag = max(lag, stats["log_ratio_abs_max"])
                t["forward"] += t1 - t0
                t["backward"] += t3 - t2
            if k == 0 and len(parts) > 1 and not pre:
                at_rollout_weights(torch.cat(logps), own)
            if k > 0:  # after an update the ratio moves by policy lag, reported apart from mismatch
                metrics["policy_lag_log_ratio_abs_max"] = self._reduce(lag, "max")
            t3 = time.perf_counter()
            step_loss = self._step_sum(losses)
            grad_norm = self._optimizer_step(step_loss)
            t["optimizer"] += time.perf_counter() - t3
        if self.is_moe:
            self.model.set_route_override(None)
            # included in "loss": the mean over the step's pieces
            metrics["aux_loss"] = (self._step_sum(auxes) / n_parts if det
                                   else self._reduce(float(self.model.aux_loss.detach()), "mean"))
        t0 = time.perf_counter()
        same = self.sync_weights()
        t["weight_sync"] = time.perf_counter() - t0
        t["rollout"] = t_roll
        t_train = t["forward"] + t["backward"] + t["optimizer"]
        n_tok = int(mask.sum())
        if det:  # statistics of the global batch itself: the same values on every layout
            tokens = self._reduce(float(loss_mask.sum()), "sum", over_dp=True)
            spread = {"reward_mean": float(self._gather_dp(rewards).mean()),
                      "response_length": self._reduce(n_tok, "sum", over_dp=True) / (B * self.dp_degree),
                      "clip_fraction": self._reduce(clipped, "sum", over_dp=True) / max(tokens, 1.0)}
        else:
            spread = {"reward_mean": self._reduce(float(rewards.mean()), "mean"),
                      "response_length": self._reduce(n_tok / B, "mean"),
                      "clip_fraction": self._reduce(stats["clip_fraction"], "mean")}
        metrics.update({
            "phase": "rl",
            "rollout_sha256": self._rollout_sha256(rollout, rewards),
            "reward_mean": spread["reward_mean"],
            "response_length": spread["response_length"],
            "loss": step_loss,
            "grad_norm": grad_norm,
            "clip_fraction": spread["clip_fraction"],
            "weights_checksum_equal": same,
            **self._contract_metrics(),
            "rollout_tokens_per_s": n_tok / t_roll,
            **({"kept_set_bytes_per_token": rollout.kept_bytes / max(n_tok, 1)} if rollout.kept is not None else {}),
            "train_tokens_per_s": batch.numel() * a.updates_per_batch / t_train,
            **{f"time_{k}_seconds": v for k, v in t.items()},
        })
        return metrics

    def _rewards(self, examples: list, tokens: list[list[int]]) -> list[float]:
        """The task's rewards of each request's sampled tokens, each checked finite (a NaN
        reward would make the advantages, the loss and then the weights NaN). All ranks
        stop together."""
        g, out, error = self.rl.algorithm.group_size, [], None
        for j, (ex, toks) in enumerate(zip(examples, tokens)):
            try:
                out.append(check_reward(self.task.reward(ex, toks), self.rl.task.name, j // g, ex, j % g, toks,
                                        self.task.tokenizer, self.step))
            except UserError as e:
                error = e
                break
        if self._reduce(1.0 if error else 0.0, "max") > 0:
            raise error or UserError(f"step {self.step}: another rank's task returned a non-finite reward")
        return out

    def _correct(self, pi_old, mu, mask, metrics):
        """Decoupled correction for a residual mismatch: the PPO ratio is taken against
        the trainer's own log-probs at the rollout weights (pi_old), and the sampler gap
        pi_old/mu goes into truncated weights and masks (titan_rl.algorithms.corrections).
        Under deterministic reduction they are computed on the global batch (the same masks
        and fractions on every layout) and this rank keeps its rows."""
        if self.leaves is not None:
            rows = slice(self.dp_rank * pi_old.shape[0], (self.dp_rank + 1) * pi_old.shape[0])
            weights, new_mask, cstats = apply_corrections(
                self._gather_dp(pi_old), self._gather_dp(mu), self._gather_dp(mask), self.corrections)
            weights, new_mask = weights[rows], new_mask[rows]
        else:
            weights, new_mask, cstats = apply_corrections(pi_old, mu, mask, self.corrections)
            cstats = {k: self._reduce(v, "mean") for k, v in cstats.items()}
        warning = warning_if_exact(self.corrections, metrics["max_abs_dlogp"])
        if warning and not self._warned_exact and self.rank == 0:
            print(f"WARNING: {warning}", flush=True)
            self._warned_exact = True
        return pi_old, weights, new_mask, cstats

    def _aux_loss(self):
        """MoE: router_aux_loss_coef x the load-balancing loss of the last forward; 0 otherwise."""
        if not self.is_moe or self.model.aux_loss is None:
            return 0.0
        return self.model.cfg.router_aux_loss_coef * self.model.aux_loss

    def _expert_disagreement(self, engine_routes: torch.Tensor, own: torch.Tensor) -> float:
        """Sampler-recorded experts vs the trainer router's own choice at the same
        positions, over the positions the sampler computed; under deterministic reduction
        over the global batch's positions, else the ranks' mean."""
        valid = engine_routes[:, :, 0, 0] >= 0
        if self.leaves is not None:
            return expert_disagreement(self._gather_dp(engine_routes[valid]), self._gather_dp(own[valid]))
        return self._reduce(expert_disagreement(engine_routes[valid], own[valid]), "mean")

    def _mismatch(self, pi: torch.Tensor, mu: torch.Tensor) -> dict:
        """titan_rl.metrics.logprob_mismatch of this rank's tokens, combined over ranks;
        under deterministic reduction, of the global batch's tokens."""
        if self.leaves is not None:
            m = logprob_mismatch(self._gather_dp(pi), self._gather_dp(mu))
            return {k: m[k] for k in STEP_MISMATCH}
        m = logprob_mismatch(pi, mu)
        return {k: self._reduce(m[k], how) for k, how in STEP_MISMATCH.items()}

    # -- metrics -------------------------------------------------------------------------
    def _truncate_metrics(self):
        """On resume, drop lines for steps the restored checkpoint has not reached, and
        remember the contract hash the kept lines end with."""
        if self.rank != 0 or not os.path.exists(self.metrics_path):
            return
        with open(self.metrics_path) as f:
            keep = [(ln, json.loads(ln)) for ln in f if ln.strip()]
        keep = [(ln, m) for ln, m in keep if m["step"] < self.step]
        self._logged_contract = next((m["contract"] for _, m in reversed(keep) if "contract" in m), None)
        with open(self.metrics_path, "w") as f:
            f.writelines(ln for ln, _ in keep)

    def _log(self, m: dict) -> None:
        if self.rank != 0:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(m) + "\n")
        if m["phase"] == "sft":
            line = f"step {m['step']:4d}/{self.rl.training.steps} sft  loss {m['loss']:.4f}"
        else:
            line = (f"step {m['step']:4d}/{self.rl.training.steps} rl   reward {m['reward_mean']:.3f}  "
                    f"len {m['response_length']:.1f}  loss {m['loss']:+.4f}  max|dlogp| {m['max_abs_dlogp']:.3g}  "
                    f"bitwise {m['bitwise_fraction']:.3f}  rollout {m['rollout_tokens_per_s']:.0f} tok/s")
        print(line, flush=True)
        logger = getattr(self.metrics_processor, "logger", None)
        if logger is not None:
            logger.log({k: float(v) for k, v in m.items() if isinstance(v, (int, float))}, m["step"])


def run(cfg: Config, run_dir: str, task=None, config_changes=None) -> int:
    """Train; `python -m titan_rl.train` has already run the start-up checks
    (titan_rl.validation) and passes the task they loaded and the allowed config changes."""
    from titan_rl.summary import summary_line

    # A plain `python -m titan_rl.train` is a world of one: TorchTitan keeps its FSDP mesh at
    # size 1, so bf16 gets the same mixed-precision policy (fp32 masters) as under torchrun.
    if "LOCAL_RANK" not in os.environ:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.makedirs(run_dir, exist_ok=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    t0 = time.perf_counter()
    trainer = RLTrainer(build_titan_config(cfg, run_dir), cfg, run_dir, task=task, config_changes=config_changes)
    try:
        trainer.train()
    finally:
        trainer.close()
    if trainer.rank == 0:
        _keep_latest(cfg, run_dir)
        line = summary_line(cfg, run_dir, time.perf_counter() - t0)
        if line:
            print(line, flush=True)
    return 0


def _keep_latest(cfg: Config, run_dir: str) -> None:
    """TorchTitan saves the last step without purging, so keep_latest_k = k left k + 1
    checkpoints; drop the oldest (after close(), which joins TorchTitan's purge thread)."""
    k = cfg.checkpoint.keep_latest_k
    folder = os.path.join(run_dir, cfg.checkpoint.folder)
    if not cfg.checkpoint.enable or k == 0 or not os.path.isdir(folder):
        return
    steps = sorted(int(d[5:]) for d in os.listdir(folder) if d.startswith("step-") and d[5:].isdigit())
    for step in steps[:-k]:
        shutil.rmtree(os.path.join(folder, f"step-{step}"), ignore_errors=True)


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def comparable(m: dict) -> dict:
    """A metrics line without wall-clock fields (for resume-equality checks)."""
    return {k: v for k, v in m.items() if not (k.endswith("_seconds") or k.endswith("_per_s"))}
