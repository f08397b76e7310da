"""Trainer/sampler mismatch corrections on per-token log-ratios ``log(pi_old / mu)``.

``pi_old`` is the trainer's log-prob of each sampled token at the rollout's weights
(the mismatch side, detached) and ``mu`` the sampler's recorded log-prob. With exact
parity ``pi_old == mu`` bitwise and every correction here is a no-op at best; they exist
for stacks (or the "stock" mode) where a residual mismatch remains.

Corrections (each off by default, all combinable), with ``rho = exp(pi_old - mu)``:

* token-level truncated importance sampling (TIS): per-token weight ``min(rho, tis_cap)``;
* IcePop-style token band: valid tokens with ``rho`` outside ``[token_band_low,
  token_band_high]`` are masked out;
* sequence-level geometric-mean rejection: a sequence whose ``exp(mean over its valid
  tokens of (pi_old - mu))`` is outside ``[seq_geo_low, seq_geo_high]`` is dropped;
* outlier sequence mask: a sequence with any valid token ``|pi_old - mu| >
  outlier_log_ratio`` is dropped.

The sequence-level checks look at all of a sequence's tokens valid in the *input* mask
(independently of the token band), and all stats are fractions of the input mask's
valid tokens / sequences with at least one valid token. A non-finite log-ratio at a
valid token (nan / inf) counts as out of range for the band, geometric-mean and outlier
checks; masked positions never produce nan/inf (they are replaced by 0 before use).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from titan_rl.kernels.reduction import fixed_sum

__all__ = ["CorrectionConfig", "apply_corrections", "enabled", "warning_if_exact"]


def _check_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must not be nan, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (0 = off), got {value!r}")
    return value


def _check_band(prefix: str, low, high) -> None:
    lo_name, hi_name = f"{prefix}_low", f"{prefix}_high"
    low = _check_number(lo_name, low)
    high = _check_number(hi_name, high)
    if low == 0.0 and high == 0.0:
        return  # off
    if low > high:
        raise ValueError(
            f"{lo_name}={low!r} > {hi_name}={high!r}: the band [low, high] is empty "
            f"(set both to 0 to turn it off)"
        )
    if not (low <= 1.0 <= high):
        raise ValueError(
            f"the band [{lo_name}, {hi_name}] = [{low!r}, {high!r}] must contain 1.0, "
            f"otherwise exactly on-policy tokens (ratio 1) would be dropped"
        )


@dataclass
class CorrectionConfig:
    """Mismatch corrections; every field 0 means off (the default: all off).

    tis_cap: token-level truncated IS, weight ``min(rho, tis_cap)``; 0 = off, else >= 1
        (a cap below 1 would down-weight exactly on-policy tokens); ``inf`` = plain IS.
    token_band_low / token_band_high: IcePop token mask, keep tokens with
        ``low <= rho <= high``; 0/0 = off, else ``0 <= low <= 1 <= high``.
    seq_geo_low / seq_geo_high: drop a sequence whose geometric-mean ratio is outside
        ``[low, high]``; 0/0 = off, else ``0 <= low <= 1 <= high``.
    outlier_log_ratio: drop a sequence if any valid token has ``|pi - mu|`` above it;
        0 = off, else > 0.
    """

    tis_cap: float = 0.0
    token_band_low: float = 0.0
    token_band_high: float = 0.0
    seq_geo_low: float = 0.0
    seq_geo_high: float = 0.0
    outlier_log_ratio: float = 0.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field and value."""
        cap = _check_number("tis_cap", self.tis_cap)
        if 0.0 < cap < 1.0:
            raise ValueError(
                f"tis_cap must be 0 (off) or >= 1, got {self.tis_cap!r}: a cap in (0, 1) "
                f"would down-weight exactly on-policy tokens"
            )
        _check_band("token_band", self.token_band_low, self.token_band_high)
        _check_band("seq_geo", self.seq_geo_low, self.seq_geo_high)
        _check_number("outlier_log_ratio", self.outlier_log_ratio)


def _tis_on(cfg: CorrectionConfig) -> bool:
    return cfg.tis_cap > 0


def _band_on(cfg: CorrectionConfig) -> bool:
    return not (cfg.token_band_low == 0 and cfg.token_band_high == 0)


def _geo_on(cfg: CorrectionConfig) -> bool:
    return not (cfg.seq_geo_low == 0 and cfg.seq_geo_high == 0)


def _outlier_on(cfg: CorrectionConfig) -> bool:
    return cfg.outlier_log_ratio > 0


def _active(cfg: CorrectionConfig) -> list[str]:
    out = []
    if _tis_on(cfg):
        out.append(f"tis_cap={cfg.tis_cap!r}")
    if _band_on(cfg):
        out.append(f"token_band=[{cfg.token_band_low!r}, {cfg.token_band_high!r}]")
    if _geo_on(cfg):
        out.append(f"seq_geo=[{cfg.seq_geo_low!r}, {cfg.seq_geo_high!r}]")
    if _outlier_on(cfg):
        out.append(f"outlier_log_ratio={cfg.outlier_log_ratio!r}")
    return out


def enabled(cfg: CorrectionConfig) -> bool:
    """True when at least one correction is on."""
    return bool(_active(cfg))


def _outside(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    # written as "not inside" so that nan counts as outside
    return ~((x >= low) & (x <= high))


def apply_corrections(
    pi_old: torch.Tensor,
    mu: torch.Tensor,
    mask: torch.Tensor,
    cfg: CorrectionConfig,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Apply the enabled corrections.

    pi_old, mu: [B, T] log-probs (trainer at the rollout's weights / sampler); mask:
    [B, T] bool or 0/1, True marks a valid token.

    Returns ``(weights, new_mask, stats)``:

    * weights: [B, T] float (``pi_old``'s dtype promoted to at least float32), no
      gradient; ``min(rho, tis_cap)`` at valid tokens when TIS is on, 1.0 elsewhere
      (and everywhere when TIS is off).
    * new_mask: [B, T] bool, the input mask minus band-masked tokens and rejected
      sequences.
    * stats (python floats): ``tis_clipped_fraction`` (valid tokens with rho > cap),
      ``token_band_masked_fraction`` (valid tokens outside the band),
      ``seq_geo_rejected_fraction`` and ``outlier_seq_masked_fraction`` (of sequences
      with >= 1 valid token), ``tokens_kept_fraction`` (new valid / input valid tokens;
      1.0 when there are no valid tokens). Fractions are 0.0 for a correction that is
      off or when the denominator is 0.
    """
    if pi_old.ndim != 2:
        raise ValueError(f"pi_old must be 2-D [B, T], got shape {tuple(pi_old.shape)}")
    if mu.shape != pi_old.shape or mask.shape != pi_old.shape:
        raise ValueError(
            f"pi_old, mu and mask must have the same shape, got {tuple(pi_old.shape)}, "
            f"{tuple(mu.shape)} and {tuple(mask.shape)}"
        )
    cfg.validate()

    out_dtype = torch.promote_types(
        pi_old.dtype if pi_old.is_floating_point() else torch.float32, torch.float32
    )
    with torch.no_grad():
        valid = mask.detach().bool()
        zero = torch.zeros((), dtype=torch.float64, device=pi_old.device)
        # float64 so that decisions at the band edges follow rho = exp(pi - mu) closely
        log_ratio = torch.where(valid, pi_old.detach().to(torch.float64), zero) - torch.where(
            valid, mu.detach().to(torch.float64), zero
        )  # exactly 0 at masked positions, whatever pi_old / mu hold there
        rho = torch.exp(log_ratio)

        tokens_per_seq = valid.sum(dim=1)
        n_tokens = int(tokens_per_seq.sum().item())
        has_tokens = tokens_per_seq > 0
        n_seqs = int(has_tokens.sum().item())

        def tok_frac(x: torch.Tensor) -> float:
            return (x & valid).sum().item() / n_tokens if n_tokens else 0.0

        def seq_frac(x: torch.Tensor) -> float:
            return (x & has_tokens).sum().item() / n_seqs if n_seqs else 0.0

        stats = {
            "tis_clipped_fraction": 0.0,
            "token_band_masked_fraction": 0.0,
            "seq_geo_rejected_fraction": 0.0,
            "outlier_seq_masked_fraction": 0.0,
        }
        weights = torch.ones(pi_old.shape, dtype=out_dtype, device=pi_old.device)
        new_mask = valid.clone()

        if _tis_on(cfg):
            cap = float(cfg.tis_cap)
            # clamp in log space: an overflowing rho (log-ratio >= ~710) still gives cap
            w = torch.exp(torch.clamp(log_ratio, max=math.log(cap)))
            weights = torch.where(valid, w, torch.ones_like(w)).to(out_dtype)
            stats["tis_clipped_fraction"] = tok_frac(rho > cap)

        if _band_on(cfg):
            band_out = _outside(rho, float(cfg.token_band_low), float(cfg.token_band_high))
            band_out &= valid
            stats["token_band_masked_fraction"] = tok_frac(band_out)
            new_mask &= ~band_out

        if _geo_on(cfg):
            mean_log = fixed_sum(log_ratio, 1) / tokens_per_seq.clamp(min=1)
            geo = torch.exp(mean_log)
            rejected = _outside(geo, float(cfg.seq_geo_low), float(cfg.seq_geo_high))
            rejected &= has_tokens
            stats["seq_geo_rejected_fraction"] = seq_frac(rejected)
            new_mask &= ~rejected.unsqueeze(1)

        if _outlier_on(cfg):
            limit = float(cfg.outlier_log_ratio)
            bad_tok = ~(log_ratio.abs() <= limit) & valid  # nan counts as an outlier
            outlier = bad_tok.any(dim=1)
            stats["outlier_seq_masked_fraction"] = seq_frac(outlier)
            new_mask &= ~outlier.unsqueeze(1)

        kept = int(new_mask.sum().item())
        stats["tokens_kept_fraction"] = kept / n_tokens if n_tokens else 1.0
    return weights, new_mask, stats


def warning_if_exact(cfg: CorrectionConfig, max_abs_dlogp: float) -> str | None:
    """A warning when corrections are on although the measured mismatch is exactly 0.

    With bitwise trainer/sampler parity ``max |pi - mu| == 0`` there is nothing to
    correct: a correction can only delete signal (mask or down-weight tokens). Returns
    None when no correction is enabled or the mismatch is not exactly 0.
    """
    active = _active(cfg)
    if not active or max_abs_dlogp != 0.0:
        return None
    return (
        f"mismatch corrections enabled ({', '.join(active)}) but the measured "
        f"trainer/sampler mismatch max|pi - mu| is exactly 0 (bitwise parity): there is "
        f"nothing to correct, the correction can only delete signal; turn it off"
    )
