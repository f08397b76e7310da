"""RLTrainer: TorchTitan's Trainer with an RL step (see titan_rl/train.py for the flow).

TorchTitan owns the model build and parallelize (our ModelSpec), the optimizer and LR
schedule objects, DCP checkpoints (save every `checkpoint.interval`, resume on relaunch)
and the step loop. We override `train_step`; inside it we clip gradients and set the LR
per phase ourselves (titan_rl.rl.optimizer_step). The step uses three services: the engine
link (titan_rl.rl.engine_link: rollouts, possibly sampled ahead, the weight sync, the
proofs), the batch plan (titan_rl.rl.batch_plan: how the global batch is cut and reduced)
and the metrics file (titan_rl.run_dir); the recorded choices it replays and measures are
titan_rl.choices'. Everything random is a pure function of (training.seed, step, global
index), never of the rank, so a resumed run logs the same metrics as an uninterrupted one
and every layout samples the same rollouts.
"""

from __future__ import annotations

import resource
import time
from typing import TYPE_CHECKING

import torch

from titan_rl.titan import cpu_compat  # noqa: F401  (before torchtitan: the CPU shims)

from torchtitan.trainer import Trainer

from titan_rl.algorithms import (
    PGLossConfig, enabled, group_advantages, loss_count, policy_gradient_loss, warning_if_exact,
)
from titan_rl import contract
from titan_rl.choices import RunChoices, replay
from titan_rl.dtypes import DTYPES
from titan_rl.errors import UserError
from titan_rl.kernels import log_softmax_fp32
from titan_rl.kernels.reduction import fixed_sum
from titan_rl.registry import get_architecture
from titan_rl.rl.batch_plan import plan_for
from titan_rl.rl.evaluation import RunEvaluation
from titan_rl.rl.links import link_for
from titan_rl.rl.optimizer_step import OptimizerStep
from titan_rl.rl.global_batch import rank_share
from titan_rl.rl.ranks import Ranks
from titan_rl.rl.episodes import episode_metrics
from titan_rl.rl.requests import step_episodes
from titan_rl.rl.rewards import check_logprobs, step_rewards
from titan_rl.rl.seeds import sft_seed
from titan_rl.rollout import ScoredBatch, pad_sequences, response_mask
from titan_rl.run_dir import MetricsFile, console_line
from titan_rl.tasks import as_environment, load_task

if TYPE_CHECKING:
    from titan_rl.config import Config


class RLTrainer(Trainer):
    def __init__(self, config: Trainer.Config, rl: Config, run_dir: str, task=None, config_changes=None):
        self.rl, self.run_dir = rl, run_dir
        self.task = task if task is not None else load_task(rl.task.name, checkpoint=rl.model.checkpoint or None,
                                                            **rl.task.kwargs)
        self.env = as_environment(self.task)  # a Task is the one-turn case of the rollout loop
        self.config_changes = config_changes or {}
        self._skipped = False
        super().__init__(config)
        # the TP ranks of one data-parallel replica take the same share of the global batch
        self.ranks = Ranks.of(self.parallel_dims)
        self.plan = plan_for(rl, self.model, self.ranks)
        self.evaluation = RunEvaluation(rl, self.env, self.ranks) if rl.eval.interval else None
        compute_dtype = DTYPES[self.config.training.mixed_precision_param]
        contract.check_ranks(contract.contract_of(self.model, dtype=compute_dtype, gradient_leaves=self.plan.reduction))
        self.engine = link_for(rl, run_dir, self.model, compute_dtype, self.ranks, self.plan.reduction, self.env)
        self.metrics = MetricsFile(run_dir, self.ranks.rank)
        self._resumed_checked = False
        self.corrections = rl.correction
        self._warned_exact = False
        self.optimizer_step = OptimizerStep(rl, run_dir, self.model, self.optimizers, self.lr_schedulers, self.ranks)
        self.choices = RunChoices(rl, get_architecture(rl.model.name))
        vocab = self.model.cfg.vocab_size
        if self.task.tokenizer.vocab_size > vocab:
            raise UserError(f"task {rl.task.name!r} needs {self.task.tokenizer.vocab_size} token ids; model "
                            f"vocab_size is {vocab}")

    @property
    def model(self):
        return self.model_parts[0]

    def close(self) -> None:
        self.engine.close()
        super().close()

    # -- the step ------------------------------------------------------------------------
    def train_step(self, data_iterator):
        resumed_from = None
        if not self._resumed_checked:
            kept = self.metrics.resume(self.step)
            self.engine.resume(kept)
            self._resumed_checked = True
            if self.step > 1:  # TorchTitan restored the checkpoint of step - 1: a resume, not a restart
                resumed_from = self.step - 1
                if self.ranks.rank == 0:
                    print(f"resumed from the checkpoint of step {resumed_from} (kept its {len(kept)} metrics lines)",
                          flush=True)
        t0 = time.perf_counter()
        self._skipped = False
        self.model.train()
        self.optimizer_step.set_phase_lr(self.step)
        lr = self.optimizers.optimizers[0].param_groups[0]["lr"]
        if self.evaluation and self.evaluation.due_before(self.step):  # the weights RL starts from
            self._log(self.evaluation.run(self.engine, self.step, weights_step=self.step - 1))
        m = self._sft_step() if self.step <= self.rl.algorithm.sft_steps else self._rl_step()
        self.lr_schedulers.step()
        # peak_rss_mib: this process's high-water mark so far (with a colocated engine, its memory too)
        m.update(step=self.step, lr=lr, step_seconds=time.perf_counter() - t0,
                 peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        if self._skipped:
            m["skipped_nonfinite"] = True
        if resumed_from is not None:  # the relaunch's first line says where it began
            m["resumed_from_step"] = resumed_from
        if self.config_changes:  # the first step after a relaunch that changed these keys
            m["config_changes"] = {k: list(v) for k, v in self.config_changes.items()}
            if self.ranks.rank == 0:
                listed = "; ".join(f"{k}: {o!r} -> {n!r}" for k, (o, n) in self.config_changes.items())
                print(f"WARNING: resumed at step {self.step} with changed config (allowed): {listed}", flush=True)
            self.config_changes = {}
        self._log(m)
        if self.evaluation and self.evaluation.due_after(self.step):  # the engine holds this step's weights
            self._log(self.evaluation.run(self.engine, self.step, weights_step=self.step))

    def _sft_step(self) -> dict:
        a, tok = self.rl.algorithm, self.task.tokenizer
        share = rank_share(a.sft_batch, self.ranks.dp_degree, self.ranks.dp_rank)
        pairs = self.task.sft_pairs(a.sft_batch, seed=sft_seed(self.rl.training.seed, self.step))
        pairs = pairs[share.start:share.stop]
        batch = self.plan.widen(pad_sequences([p + t for p, t in pairs], tok.pad_id), tok.pad_id)
        mask = response_mask([len(p) for p, _ in pairs], [len(t) for _, t in pairs], batch.shape[1] - 1)
        t0 = time.perf_counter()
        # the token mean over the global batch: the pieces' losses and gradients sum to it
        tokens = torch.tensor(self.ranks.reduce(float(mask.sum()), "sum", over_dp=True), dtype=torch.float32)
        pieces, n_pieces = self.plan.pieces(a.sft_batch, share.start)
        losses = []
        for j, rows in enumerate(pieces):
            logp = log_softmax_fp32(self.model(batch[rows.start:rows.stop]))
            logp = logp[:, :-1].gather(-1, batch[rows.start:rows.stop, 1:, None])[..., 0]
            loss = -fixed_sum(logp * mask[rows.start:rows.stop]) / tokens + self.choices.aux_loss(self.model) / n_pieces
            self.plan.backward(loss, last=j == len(pieces) - 1)
            losses.append(loss.detach())
        loss = self.plan.step_sum(losses)
        grad_norm = self._step_optimizer(loss)
        return {"phase": "sft", "loss": loss, "grad_norm": grad_norm,
                "train_tokens_per_s": batch.numel() / (time.perf_counter() - t0)}

    def _rl_step(self) -> dict:
        a, r = self.rl.algorithm, self.ranks
        episodes, rollout, t_roll, version = self._rollout()
        lag = self.step - 1 - version  # the weights' age in optimizer steps (0 = on-policy)
        check_logprobs(rollout, r, self.step)
        rewards = step_rewards(self.rl, self.env, r, self.step, episodes, rollout)
        # group advantages over whole episodes; each of an episode's rows (its parts) carries its own
        parts = len(rollout) // len(episodes)
        adv = group_advantages(rewards[::parts], a.group_size, scale=a.advantage_scale).repeat_interleave(parts)
        pad = self.task.tokenizer.pad_id
        b = ScoredBatch.of(rollout, self.plan.widen(rollout.batch(pad), pad))
        B = b.tokens.shape[0]
        pieces, n_pieces = self.plan.pieces(B * r.dp_degree, B * r.dp_rank)
        metrics: dict = self.choices.bytes_metrics(rollout)
        times = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        if lag:  # engine vs trainer at the rollout's own (older) weights: the operator mismatch alone
            t0, own = time.perf_counter(), []  # and the model's own choices at those weights
            with torch.no_grad(), self.engine.versions.at(version):
                pi_behaviour = torch.cat([self._score(b, rows, own) for rows in pieces])
            times["forward"] += time.perf_counter() - t0
            self._at_rollout_weights(b, pi_behaviour, own, metrics)
        for k in range(a.updates_per_batch):
            # the first update also measures engine vs trainer at the rollout's weights; the
            # corrections need the whole share's pi_old before the first piece's loss
            own = [] if k == 0 and not lag else None
            if own is not None and enabled(self.corrections) and len(pieces) > 1:
                t0 = time.perf_counter()
                with torch.no_grad():
                    pi_old = torch.cat([self._score(b, rows, own) for rows in pieces])
                times["forward"] += time.perf_counter() - t0
                self._at_rollout_weights(b, pi_old, own, metrics)
                own = None
            update = self._update(b, adv, pieces, n_pieces, own, metrics, times)
            if k == 0:  # current weights vs the behaviour policy: the real off-policy movement
                metrics["lag_abs_dlogp"] = r.reduce(
                    float((update["logp"][b.mask] - b.mu[b.mask]).abs().max()) if bool(b.mask.any()) else 0.0, "max")
            if k > 0:  # after an update the ratio moves by policy lag, reported apart from mismatch
                metrics["policy_lag_log_ratio_abs_max"] = r.reduce(update["lag"], "max")
        self.choices.release(self.model)
        # included in "loss", times their coefficients; the last update's
        metrics.update({name: self.plan.piece_mean(values) for name, values in update["aux"].items()})
        t0 = time.perf_counter()
        check = self.engine.sync(self.step)
        times["weight_sync"], times["rollout"], times["env"] = time.perf_counter() - t0, t_roll, rollout.env_seconds
        n_tok = int(b.mask.sum())
        stats = self.plan.batch_stats(rewards, n_tok, B, b.loss_mask, update["pieces"])
        metrics.update({
            "phase": "rl",
            "rollout_sha256": r.digest_dp(rollout.digests(rewards)),
            **self._episode_metrics(rollout),
            "reward_mean": stats["reward_mean"],
            "response_length": stats["response_length"],
            "loss": update["loss"],
            "grad_norm": update["grad_norm"],
            "clip_fraction": stats["clip_fraction"],
            **(check.metrics() if check is not None else {"weights_checksum_equal": None}),
            "policy_lag": lag,
            **self.engine.metrics(),
            **self.engine.contract_metrics(),
            "rollout_tokens_per_s": n_tok / t_roll,
            "train_tokens_per_s": b.tokens.numel() * a.updates_per_batch / sum(times[k] for k in
                                                                                 ("forward", "backward", "optimizer")),
            **{f"time_{k}_seconds": v for k, v in times.items()},
        })
        return metrics

    def _update(self, b: ScoredBatch, adv, pieces: list[range], n_pieces: int, own: list | None, metrics: dict,
                times: dict) -> dict:
        """One optimizer update over this rank's pieces. `own` (a list): measure the mismatch
        at the rollout's weights from this update's forwards, collecting the model's own
        recorded choices into it (titan_rl.choices)."""
        a = self.rl.algorithm
        loss_cfg = PGLossConfig(clip_eps=a.clip_eps or None, agg=a.loss_agg)
        logps, losses, aux, stats_of_pieces, lag = [], [], {}, [], float("-inf")
        for j, rows in enumerate(pieces):
            t0 = time.perf_counter()
            logp = self._score(b, rows, own)
            t1 = time.perf_counter()
            if own is not None and len(pieces) == 1:
                self._at_rollout_weights(b, logp.detach(), own, metrics)
            if j == 0:  # the aggregate over the global batch: the pieces' losses and gradients sum to it
                count = int(self.ranks.reduce(loss_count(b.loss_mask, a.loss_agg), "sum", over_dp=True))
            s = slice(rows.start, rows.stop)
            loss, stats = policy_gradient_loss(logp, b.ref[s], adv[s], b.loss_mask[s], loss_cfg,
                                               weights=None if b.weights is None else b.weights[s], count=count)
            loss = loss + self.choices.aux_loss(self.model) / n_pieces
            t2 = time.perf_counter()
            self.plan.backward(loss, last=j == len(pieces) - 1)
            times["forward"] += t1 - t0
            times["backward"] += time.perf_counter() - t2
            logps.append(logp.detach())
            losses.append(loss.detach())
            for name, value in self.choices.aux_losses(self.model).items():
                aux.setdefault(name, []).append(value.detach())
            stats_of_pieces.append((stats["clip_fraction"], int(b.loss_mask[s].sum())))
            lag = max(lag, stats["log_ratio_abs_max"])
        if own is not None and len(pieces) > 1:
            self._at_rollout_weights(b, torch.cat(logps), own, metrics)
        t0 = time.perf_counter()
        step_loss = self.plan.step_sum(losses)
        grad_norm = self._step_optimizer(step_loss)
        times["optimizer"] += time.perf_counter() - t0
        return {"loss": step_loss, "grad_norm": grad_norm, "aux": aux, "pieces": stats_of_pieces, "lag": lag,
                "logp": torch.cat(logps)}

    def _score(self, b: ScoredBatch, rows: range, own: list | None) -> torch.Tensor:
        """log pi [len(rows), L - 1] of the sampled tokens of `rows` under the policy the
        sampler drew from (its temperature, renormalised over the same top-k/top-p kept set:
        recomputed from our bitwise-equal logits, or replayed from the sampler's record), 0
        off the mask. The engine's recorded choices the run replays are forced on the model
        (titan_rl.choices); `own` collects the model's own."""
        from titan_rl.kernels.sampling import sampled_logprobs

        replay(self.rl, self.model, b, rows)
        s, mask = self.rl.sampling, b.mask[rows.start:rows.stop]
        logits = self.model(b.tokens[rows.start:rows.stop])[:, :-1][mask]
        pi = sampled_logprobs(logits, b.tokens[rows.start:rows.stop, 1:][mask], s.temperature,
                              top_k=s.top_k or None, top_p=s.top_p if s.top_p < 1.0 else None, kept=b.kept_rows(rows))
        if own is not None:
            own.append(self.choices.own(self.model))
        return torch.zeros(mask.shape, dtype=pi.dtype).masked_scatter(mask, pi)

    def _at_rollout_weights(self, b: ScoredBatch, pi_old: torch.Tensor, own: list, metrics: dict) -> None:
        """Engine vs trainer at the rollout's weights (mismatch, not policy lag), and the
        corrections that need it: the PPO ratio is then taken against pi_old and the
        sampler gap pi_old/mu goes into truncated weights and masks."""
        metrics.update(self.plan.mismatch(pi_old[b.mask], b.mu[b.mask]))
        metrics.update(self.choices.disagreements(self.plan, b, own))
        if enabled(self.corrections):
            b.weights, b.loss_mask, cstats = self.plan.correct(pi_old, b.mu, b.mask, self.corrections)
            b.ref = pi_old
            metrics.update(cstats)
            warning = warning_if_exact(self.corrections, metrics["max_abs_dlogp"])
            if warning and not self._warned_exact and self.ranks.rank == 0:
                print(f"WARNING: {warning}", flush=True)
                self._warned_exact = True

    # -- the step's pieces -------------------------------------------------------------
    def _rollout(self) -> tuple[list, object, float, int]:
        """Run this data-parallel rank's share of the step's global episodes: (the episodes,
        the rollout, seconds spent in the loop, the training step whose weights sampled it)."""
        episodes = self._episodes(self.step)
        rollout, dt, version = self.engine.rollout(self.step, episodes, self._episodes, self.choices.capture)
        return episodes, rollout, dt, version

    def _episodes(self, step: int) -> list:
        return step_episodes(self.rl, self.env, self.ranks, step)

    def _episode_metrics(self, rollout) -> dict:
        """Turns, samples, render breaks, re-render divergence, environment errors and tokens
        sampled under other weights than the rollout's, over the global batch's episodes."""
        mine = episode_metrics(rollout)
        t = dict(zip(mine, self.ranks.reduce_sums(list(mine.values()), over_dp=True)))
        m = {"mixed_version_tokens": int(t["mixed_version_tokens"])}
        if self.env.max_turns > 1:
            n = t["episodes"]
            m.update(turns_per_episode=t["turns"] / n, samples_per_episode=t["samples"] / n,
                     render_breaks=int(t["render_breaks"]), rerender_divergence=int(t["rerender_divergence"]),
                     prefix_cached_tokens=int(t["cached_tokens"]))
        if t["env_errors"]:
            m["env_errors"] = int(t["env_errors"])
        return m

    def _step_optimizer(self, loss: float) -> float:
        grad_norm, skipped = self.optimizer_step(loss, self.step)
        self._skipped = self._skipped or skipped
        return grad_norm

    def _log(self, m: dict) -> None:
        self.metrics.append(m)
        if self.ranks.rank != 0:
            return
        print(console_line(m, self.rl.training.steps), flush=True)
        logger = getattr(self.metrics_processor, "logger", None)
        if logger is not None:
            step = m.get("weights_step", m["step"])  # an evaluation: of the weights after that step
            logger.log({k: float(v) for k, v in m.items() if isinstance(v, (int, float))}, step)

