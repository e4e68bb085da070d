"""Preference objectives on per-sequence log-probabilities: DPO and its variants (the numpy oracle, float64).

A pair is a prompt with a chosen and a rejected response; logπ(y) is the sum of the response tokens'
log-probabilities under the policy (the student with its adapter), logπ_ref(y) the same under the frozen
reference. With u = (logπ(c) - logπ_ref(c)) - (logπ(r) - logπ_ref(r)) and h = beta * u (the reward margin):

  sigmoid  L = -(1 - eps) log σ(h) - eps log σ(-h)       (DPO; eps = label_smoothing, conservative DPO)
  ipo      L = (u - 1 / (2 beta))^2                        (IPO)
  hinge    L = max(0, 1 - h)                               (SLiC / RSO hinge)

No-reference form (SimPO): logπ is averaged over the response tokens and the reference is dropped,
h = beta * (logπ(c) / |c| - logπ(r) / |r|) - gamma, then the same loss types (ipo: u = h / beta).
Rewards reported: beta * (logπ - logπ_ref) per response (SimPO: beta * logπ / |y|); margin = their difference.

The batch loss is the mean over the pairs that have both responses (len > 0); `d_chosen`, `d_rejected` are
dL/dlogπ of that mean, the per-sequence weights the CE head's backward scales d logπ / d logits by.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LOSS_TYPES = ("sigmoid", "ipo", "hinge")


@dataclass(frozen=True)
class DpoConfig:
    """beta (reward scale), loss_type, label_smoothing (sigmoid only), reference_free (SimPO) with margin gamma."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    reference_free: bool = False
    gamma: float = 0.0

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"DpoConfig.loss_type={self.loss_type!r} is not one of {LOSS_TYPES}")
        if not self.beta > 0:
            raise ValueError(f"DpoConfig.beta={self.beta} must be > 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"DpoConfig.label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError("DpoConfig.label_smoothing applies to loss_type sigmoid only")


@dataclass
class PairTerms:
    """Per-pair values of one batch and the gradient of the batch loss (the mean over valid pairs)."""

    loss: float  # mean over valid pairs
    pair_loss: np.ndarray  # [P] (0 where invalid)
    chosen_reward: np.ndarray  # [P]
    rejected_reward: np.ndarray  # [P]
    valid: np.ndarray  # [P] bool: both responses have tokens
    d_chosen: np.ndarray  # [P] dL/dlogπ(chosen)
    d_rejected: np.ndarray  # [P] dL/dlogπ(rejected)

    @property
    def margin(self) -> np.ndarray:
        return self.chosen_reward - self.rejected_reward

    def metrics(self) -> dict[str, np.ndarray]:
        """The evaluation arrays of the batch (what a preference engine's evaluate_batch returns besides logps):
        loss [1], pair_loss, margin, chosen_reward, rejected_reward, valid [P]."""
        return {
            "loss": np.array([self.loss], np.float64),
            "pair_loss": self.pair_loss,
            "margin": self.margin,
            "chosen_reward": self.chosen_reward,
            "rejected_reward": self.rejected_reward,
            "valid": self.valid,
        }


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(_log_sigmoid(x))


def preference_loss(
    policy_chosen: np.ndarray,
    policy_rejected: np.ndarray,
    ref_chosen: np.ndarray | None,
    ref_rejected: np.ndarray | None,
    len_chosen: np.ndarray,
    len_rejected: np.ndarray,
    cfg: DpoConfig,
) -> PairTerms:
    """The objective of `cfg` on P pairs of summed response log-probs (refs ignored, may be None, when
    reference_free), with dL/dlogπ per sequence. Computed in float64."""
    pc, pr = np.asarray(policy_chosen, np.float64), np.asarray(policy_rejected, np.float64)
    nc, nr = np.asarray(len_chosen, np.float64), np.asarray(len_rejected, np.float64)
    valid = (nc > 0) & (nr > 0)
    beta = cfg.beta
    if cfg.reference_free:
        sc, sr = beta / np.maximum(nc, 1), beta / np.maximum(nr, 1)  # d reward / d logπ
        chosen_reward, rejected_reward = sc * pc, sr * pr
        h = chosen_reward - rejected_reward - cfg.gamma
    else:
        if ref_chosen is None or ref_rejected is None:
            raise ValueError("preference_loss: reference log-probs are needed unless reference_free")
        sc = sr = np.full_like(pc, beta)
        chosen_reward = beta * (pc - np.asarray(ref_chosen, np.float64))
        rejected_reward = beta * (pr - np.asarray(ref_rejected, np.float64))
        h = chosen_reward - rejected_reward
    eps = cfg.label_smoothing
    if cfg.loss_type == "sigmoid":
        loss = -(1 - eps) * _log_sigmoid(h) - eps * _log_sigmoid(-h)
        dh = -(1 - eps) * _sigmoid(-h) + eps * _sigmoid(h)
    elif cfg.loss_type == "ipo":
        u = h / beta
        loss = (u - 1 / (2 * beta)) ** 2
        dh = 2 * (u - 1 / (2 * beta)) / beta
    else:  # hinge
        loss = np.maximum(0.0, 1 - h)
        dh = np.where(h < 1, -1.0, 0.0)
    n = max(1, int(valid.sum()))
    loss = np.where(valid, loss, 0.0)
    dh = np.where(valid, dh, 0.0) / n
    return PairTerms(
        loss=float(loss.sum() / n),
        pair_loss=loss,
        chosen_reward=chosen_reward,
        rejected_reward=rejected_reward,
        valid=valid,
        d_chosen=dh * sc,
        d_rejected=-dh * sr,
    )
