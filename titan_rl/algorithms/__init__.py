"""RL algorithms: advantages and policy-gradient losses."""

from titan_rl.algorithms.grpo import PGLossConfig, group_advantages, policy_gradient_loss

__all__ = ["PGLossConfig", "group_advantages", "policy_gradient_loss"]
