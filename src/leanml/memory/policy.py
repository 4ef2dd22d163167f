"""Policy evolution: watch compression error, outlier statistics and step time during training, and say
when they drift far enough from what the plan assumed that it should be re-profiled and re-solved."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class DriftThresholds:
    """When to re-plan.

    ``error_ratio``: a sampled compression error above ``error_ratio`` x the profiled one (and above
    ``error_floor``), or above the option's cap. ``outlier_ratio``: a group's outlier ratio (largest over
    median channel magnitude) changed by more than this factor either way. ``time_ratio``: the median
    step time of the last ``window`` steps is more than ``time_ratio`` x the median right after planning.
    """

    error_ratio: float = 1.5
    error_floor: float = 0.005
    outlier_ratio: float = 2.0
    time_ratio: float = 1.25
    window: int = 10


@dataclass
class DriftMonitor:
    """Keeps the reference statistics of the current plan and checks new samples against them."""

    thresholds: DriftThresholds
    ref_error: dict[str, float] = field(default_factory=dict)
    caps: dict[str, float] = field(default_factory=dict)
    ref_outlier: dict[str, float] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)
    ref_step: float | None = None

    def reset(self, ref_error: dict[str, float], caps: dict[str, float], ref_outlier: dict[str, float]) -> None:
        """Start over for a new plan."""
        self.ref_error, self.caps, self.ref_outlier = dict(ref_error), dict(caps), dict(ref_outlier)
        self.step_times.clear()
        self.ref_step = None

    def add_step_time(self, seconds: float) -> None:
        self.step_times.append(seconds)
        w = self.thresholds.window
        if self.ref_step is None and len(self.step_times) >= w + 1:  # skip the first (warm-up) step
            self.ref_step = statistics.median(self.step_times[1 : w + 1])

    def check(self, errors: dict[str, float], outliers: dict[str, float]) -> list[str]:
        """Reasons to re-plan (empty when the plan still holds)."""
        th = self.thresholds
        reasons = []
        for label, err in errors.items():
            ref = self.ref_error.get(label, 0.0)
            cap = self.caps.get(label)
            if cap is not None and err > cap:
                reasons.append(f"{label}: compression error {err:.4f} above cap {cap:.4f}")
            elif err > max(th.error_floor, th.error_ratio * ref):
                reasons.append(f"{label}: compression error {err:.4f} drifted from {ref:.4f}")
        for label, ratio in outliers.items():
            ref = self.ref_outlier.get(label)
            if ref and ratio > 0 and max(ratio / ref, ref / ratio) > th.outlier_ratio:
                reasons.append(f"{label}: outlier ratio {ratio:.1f} drifted from {ref:.1f}")
        w = th.window
        if self.ref_step is not None and len(self.step_times) >= 2 * w + 1:
            recent = statistics.median(self.step_times[-w:])
            if recent > th.time_ratio * self.ref_step:
                reasons.append(f"step time {recent:.3f}s drifted from {self.ref_step:.3f}s")
        return reasons
