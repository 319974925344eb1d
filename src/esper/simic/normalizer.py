"""Running mean/variance normalisation of policy observations, kept on the device.

Observation features live on very different scales (losses, accuracies, epoch counts,
parameter fractions); the policy learns faster on standardised inputs. The statistics
are module buffers, so they travel in ``state_dict`` (and with it in Lightning
checkpoints: a resumed run normalises exactly as before) and move with ``.to(device)``.

It is meant to be updated once per rollout with all of that rollout's observations:
the statistics then stay fixed while PPO optimises on the rollout, so the policy's
inputs do not drift between the rollout and its update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from esper.contracts.config_errors import owned_by, require_number

#: Dtype of the running statistics. The sample count outgrows float32's exact integers
#: (2**24) after a few thousand rollouts, and the merge subtracts nearby means.
STATS_DTYPE = torch.float64


@dataclass(frozen=True)
class NormalizerConfig:
    """How observations are standardised.

    Attributes:
        eps: added to the variance under the square root, so a constant feature maps to
            0, not NaN.
        clip: normalised values are clipped to [-clip, clip], bounding what an outlier
            feeds the policy.
    """

    #: Added to the variance under the square root, so a constant feature maps to 0, not NaN.
    eps: float = 1e-8
    #: Normalised values are clipped to ``[-clip, clip]``, bounding what an outlier feeds the policy.
    clip: float = 10.0

    def __post_init__(self) -> None:
        with owned_by(self):
            for name in ("eps", "clip"):
                require_number(name, getattr(self, name), above=0.0)


class RunningObsNormalizer(nn.Module):
    """Standardises ``[..., n_features]`` observations with running per-feature statistics.

    Buffers (all float64, see :data:`STATS_DTYPE`):
        mean: ``[n_features]`` running mean; 0 before any update.
        var: ``[n_features]`` running population variance; 1 before any update, so an
            unfitted normaliser only clips.
        count: ``[]`` number of observations merged so far.

    ``module.to(dtype)`` would also cast these buffers; keep the normaliser out of
    whole-model dtype casts (e.g. "bf16-true" precision) so the count stays exact.
    """

    mean: Tensor
    var: Tensor
    count: Tensor

    def __init__(self, n_features: int, config: NormalizerConfig | None = None) -> None:
        super().__init__()
        if isinstance(n_features, bool) or not isinstance(n_features, int) or n_features < 1:
            raise ValueError(
                f"RunningObsNormalizer.n_features must be an int >= 1, got {n_features!r}"
            )
        self.n_features = n_features
        self.config = config if config is not None else NormalizerConfig()
        self.register_buffer("mean", torch.zeros(n_features, dtype=STATS_DTYPE))
        self.register_buffer("var", torch.ones(n_features, dtype=STATS_DTYPE))
        self.register_buffer("count", torch.zeros((), dtype=STATS_DTYPE))

    def _check_features(self, x: Tensor, where: str) -> None:
        if not isinstance(x, Tensor) or x.ndim < 1 or x.shape[-1] != self.n_features:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"RunningObsNormalizer.{where}: x must be [..., {self.n_features}] "
                f"(n_features={self.n_features}), got {got}"
            )
        if not x.is_floating_point():
            raise ValueError(
                f"RunningObsNormalizer.{where}: x must be a floating tensor, got {x.dtype}"
            )

    @torch.no_grad()
    def update(
        self,
        x: Tensor,
        valid: Tensor | None = None,
        reduce_sum: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        """Merge a batch of observations into the running statistics.

        Uses the parallel (Chan et al.) combination of two (count, mean, M2) summaries,
        so merging batches one by one gives the statistics of their concatenation. Runs
        entirely on the device: rows are weighted by ``valid`` rather than selected
        (boolean selection would read the mask on the host), and an all-invalid batch
        leaves the statistics unchanged without a host-side branch.

        Args:
            x: ``[..., n_features]`` observations, e.g. a whole rollout's ``[E, T, D]``.
            valid: ``x.shape[:-1]`` bool, rows to count (padding and rolled-back steps
                are False and may hold anything, NaN included); None counts every row.
            reduce_sum: under data parallelism, an all-reduce (sum) over ranks; the batch's
                count, sum and sum of squares are reduced in one call so every rank merges
                the same global batch and the statistics stay identical across ranks.
        """
        self._check_features(x, "update")
        if x.device != self.mean.device:
            raise ValueError(
                f"RunningObsNormalizer.update: x is on {x.device} but the statistics on "
                f"{self.mean.device}; move the normaliser with .to(device)"
            )
        rows = x.reshape(-1, self.n_features).to(STATS_DTYPE)  # [N, D]
        if valid is None:
            weights = torch.ones(rows.shape[0], dtype=STATS_DTYPE, device=rows.device)
        else:
            if (
                not isinstance(valid, Tensor)
                or valid.dtype != torch.bool
                or tuple(valid.shape) != tuple(x.shape[:-1])
                or valid.device != x.device
            ):
                got = (
                    f"{tuple(valid.shape)} {valid.dtype} on {valid.device}"
                    if isinstance(valid, Tensor)
                    else type(valid).__name__
                )
                raise ValueError(
                    "RunningObsNormalizer.update: valid must be a bool tensor of shape "
                    f"x.shape[:-1] = {tuple(x.shape[:-1])} on {x.device}, got {got}"
                )
            flat_valid = valid.reshape(-1, 1)  # [N, 1]
            # where, not multiply: 0 * NaN is NaN, and invalid rows may hold garbage.
            rows = torch.where(flat_valid, rows, 0.0)
            weights = flat_valid.reshape(-1).to(STATS_DTYPE)

        w = weights.unsqueeze(1)  # [N, 1]
        batch_count = weights.sum()  # []
        if reduce_sum is None:
            safe_batch_count = batch_count.clamp_min(1.0)
            batch_mean = (w * rows).sum(0) / safe_batch_count  # [D]
            batch_m2 = (w * (rows - batch_mean).square()).sum(0)  # [D]
        else:
            d = self.n_features
            moments = torch.cat([batch_count[None], (w * rows).sum(0), (w * rows.square()).sum(0)])
            moments = reduce_sum(moments)
            batch_count = moments[0]
            safe_batch_count = batch_count.clamp_min(1.0)
            batch_mean = moments[1 : 1 + d] / safe_batch_count
            batch_m2 = (moments[1 + d :] - batch_count * batch_mean.square()).clamp_min(0.0)

        total = self.count + batch_count
        safe_total = total.clamp_min(1.0)
        delta = batch_mean - self.mean
        new_mean = self.mean + delta * (batch_count / safe_total)
        m2 = (
            self.var * self.count
            + batch_m2
            + delta.square() * (self.count * batch_count / safe_total)
        )
        # With nothing merged yet and an empty batch, keep the prior variance of 1.
        new_var = torch.where(total > 0, m2 / safe_total, self.var)

        self.mean.copy_(new_mean)
        self.var.copy_(new_var)
        self.count.copy_(total)

    def normalize(self, x: Tensor) -> Tensor:
        """``(x - mean) / sqrt(var + eps)`` clipped to ``±clip``; ``[..., D]`` in, same out.

        The result has ``x``'s dtype; the statistics are not updated.
        """
        self._check_features(x, "normalize")
        inv_std = torch.rsqrt(self.var + self.config.eps).to(x.dtype)
        centred = x - self.mean.to(x.dtype)
        clip = self.config.clip
        return (centred * inv_std).clamp(-clip, clip)

    def forward(self, x: Tensor) -> Tensor:
        """Same as :meth:`normalize`, so the module can sit in front of the policy."""
        return self.normalize(x)

    def extra_repr(self) -> str:
        return f"n_features={self.n_features}, eps={self.config.eps}, clip={self.config.clip}"
