"""The RL trainer's optimizer step: the LR of the step's phase, gradient clipping by the
global norm, and the refusal of a non-finite loss or norm before any weight changes."""

from __future__ import annotations

import math
import warnings

import torch

from titan_rl.errors import RunStopped
from titan_rl.run_dir import latest_checkpoint_step
from titan_rl.titan import leaf_reduction


class OptimizerStep:
    def __init__(self, cfg, run_dir: str, model: torch.nn.Module, optimizers, lr_schedulers, ranks):
        self.cfg, self.run_dir, self.model, self.ranks = cfg, run_dir, model, ranks
        self.optimizers, self.lr_schedulers = optimizers, lr_schedulers
        self._base_lrs = [list(s.base_lrs) for s in lr_schedulers.schedulers]

    def __call__(self, loss: float, step: int) -> tuple[float, bool]:
        """Clip by the global grad norm and step: (the norm, whether the step was skipped). The
        LR schedule advances once per training step, in the trainer, however many updates a
        batch gets. The norm is taken over full gradients: under TP, parameters live on
        different meshes, which TorchTitan's clip_grad_norm_ cannot stack; full_tensor()
        gives every rank the same norm."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        total = leaf_reduction.grad_norm(self.model.parameters())
        # A NaN/inf here would reach every weight through the optimizer and be saved in
        # the next checkpoint; the loss is per rank, so the decision is taken by all ranks.
        if self.ranks.any(not (math.isfinite(loss) and bool(torch.isfinite(total)))):
            self.optimizers.zero_grad()
            what = f"non-finite loss {loss} / grad norm {float(total)} at step {step}"
            if self.cfg.algorithm.on_nonfinite == "stop":
                last = latest_checkpoint_step(self.cfg, self.run_dir) if self.cfg.checkpoint.enable else 0
                kept = f"the last checkpoint (step {last}) is intact" if last else "no checkpoint was written"
                raise RunStopped(f"{what}: stopped before the optimizer step, so no weight changed; {kept}. "
                                 "Lower optimizer.lr, or set algorithm.on_nonfinite = 'skip' to skip such steps")
            if self.ranks.rank == 0:
                print(f"WARNING: {what}: step skipped (algorithm.on_nonfinite = 'skip')", flush=True)
            return float(total), True
        coef = torch.clamp(self.cfg.training.max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        self.optimizers.step()
        self.optimizers.zero_grad()
        return float(total), False

    def set_phase_lr(self, step: int) -> None:
        """LR for this step = configured base x phase scale x schedule(step), recomputed
        from scratch every step: TorchTitan checkpoints only the schedule's step count
        (not base_lrs), so nothing here may depend on state a resume would lose."""
        scale = self.cfg.algorithm.rl_lr_scale if step > self.cfg.algorithm.sft_steps else 1.0
        for sched, base0 in zip(self.lr_schedulers.schedulers, self._base_lrs):
            sched.base_lrs = [b * scale for b in base0]
            with warnings.catch_warnings():  # get_lr() outside step() warns; it is the pure schedule here
                warnings.simplefilter("ignore", UserWarning)
                lrs = sched.get_lr()
            for group, lr in zip(sched.optimizer.param_groups, lrs):
                group["lr"] = lr
