"""RL algorithms: advantages, policy-gradient losses, and off-policy corrections."""

from titan_rl.algorithms.corrections import CorrectionConfig, apply_corrections, enabled, warning_if_exact
from titan_rl.algorithms.grpo import PGLossConfig, group_advantages, loss_count, policy_gradient_loss

__all__ = ["CorrectionConfig", "PGLossConfig", "apply_corrections", "enabled", "group_advantages",
           "loss_count", "policy_gradient_loss", "warning_if_exact"]
