"""The `runtime_guard.detectors` config section: one sub-section per detector.

Every detector has `enabled` and `action` ("report", or "dump": report plus an evidence bundle).
These sections, and `incidents`, may be changed on a live server by editing the config file
(see `guard/config/reload.py`); the other keys need a restart.
"""

from __future__ import annotations

import dataclasses

from guard.config.schema import ACTIONS, GuardConfigError, choices, value_range


@dataclasses.dataclass(frozen=True)
class LogitsFiniteConfig:
    """NaN/Inf in the logits before sampling, per request row (also the spec-decode verify path)."""

    enabled: bool = True
    action: str = dataclasses.field(default="report", metadata=choices(*ACTIONS))
    # false: the row check is copied off the device without waiting and read after sampling;
    # true: read at once (forces a device sync each wave; the incident names the wave exactly
    # even if the process dies right after)
    sync_gate: bool = False


@dataclasses.dataclass(frozen=True)
class TokenRepeatConfig:
    """Loops and n-gram repeats in each request's sampled stream, over a sliding window."""

    enabled: bool = True
    action: str = dataclasses.field(default="report", metadata=choices(*ACTIONS))
    # tokens of history kept per request
    window: int = dataclasses.field(default=128, metadata=value_range(8, 4096))
    # a loop is a block of at most max_period tokens repeated at least min_repeats times in a
    # row, covering at least min_span tokens
    max_period: int = dataclasses.field(default=16, metadata=value_range(1, 512))
    min_repeats: int = dataclasses.field(default=4, metadata=value_range(2, 1000))
    min_span: int = dataclasses.field(default=32, metadata=value_range(2, 4096))
    # an n-gram seen ngram_max_count times within the window (not necessarily in a row)
    ngram_size: int = dataclasses.field(default=4, metadata=value_range(2, 64))
    ngram_max_count: int = dataclasses.field(default=8, metadata=value_range(2, 4096))

    def check(self, path: str) -> None:
        if self.max_period * self.min_repeats > self.window:
            raise GuardConfigError(
                f"{path}.max_period: {self.max_period} x min_repeats {self.min_repeats} exceeds "
                f"window {self.window}; a loop that long cannot be seen"
            )
        if self.ngram_size * 2 > self.window:
            raise GuardConfigError(
                f"{path}.ngram_size: {self.ngram_size} is more than half of window {self.window}"
            )


@dataclasses.dataclass(frozen=True)
class SpecAcceptanceConfig:
    """Acceptance of draft tokens, per request and per wave, against a band over a window."""

    enabled: bool = True
    action: str = dataclasses.field(default="report", metadata=choices(*ACTIONS))
    min_rate: float = dataclasses.field(default=0.05, metadata=value_range(0.0, 1.0))
    max_rate: float = dataclasses.field(default=1.0, metadata=value_range(0.0, 1.0))
    # waves in the engine-wide window
    window_waves: int = dataclasses.field(default=64, metadata=value_range(1, 100_000))
    # waves with drafts in each request's window
    request_window: int = dataclasses.field(default=64, metadata=value_range(1, 100_000))
    # a window judged on fewer drafts than this is not judged
    min_drafts: int = dataclasses.field(default=32, metadata=value_range(1, 100_000))
    # a window this far above the engine's baseline acceptance is an incident too (0: off):
    # repetitive, degenerate output makes drafts easy to accept
    jump_above: float = dataclasses.field(default=0.4, metadata=value_range(0.0, 1.0))
    # the baseline: an average of the per-wave rate over about this many waves
    baseline_waves: int = dataclasses.field(default=512, metadata=value_range(2, 1_000_000))

    def check(self, path: str) -> None:
        if self.min_rate > self.max_rate:
            raise GuardConfigError(
                f"{path}.min_rate: {self.min_rate} is above max_rate {self.max_rate}"
            )


@dataclasses.dataclass(frozen=True)
class LogitsStatsConfig:
    """max |logit| and mean entropy, every N waves, exported as metrics."""

    enabled: bool = True
    every_n_waves: int = dataclasses.field(default=16, metadata=value_range(1, 1_000_000))
    # an incident when max |logit| reaches this (0: never); drift before it becomes NaN
    max_abs_limit: float = dataclasses.field(default=0.0, metadata=value_range(0.0, 1e38))


@dataclasses.dataclass(frozen=True)
class TokenRangeConfig:
    """A sampled token id outside [0, vocab size): the mark of an all-NaN row on some kernels."""

    enabled: bool = True
    action: str = dataclasses.field(default="report", metadata=choices(*ACTIONS))


@dataclasses.dataclass(frozen=True)
class DumpConfig:
    """Evidence bundles written for detectors whose action is "dump"."""

    # default: $ASCEND_GUARD_STATE_DIR/dumps (/var/lib/ascend-guard/dumps), not the container's $TMPDIR
    directory: str = ""
    max_bytes: int = dataclasses.field(default=64 << 20, metadata=value_range(4096, 1 << 40))
    # all bundles together; beyond it new dumps are skipped (and say so)
    max_total_bytes: int = dataclasses.field(default=1 << 30, metadata=value_range(4096, 1 << 50))
    # never leave less free space than this on the dump's filesystem
    min_free_bytes: int = dataclasses.field(default=1 << 30, metadata=value_range(0, 1 << 50))
    recent_tokens: int = dataclasses.field(default=256, metadata=value_range(0, 1 << 20))
    include_kv: bool = True


@dataclasses.dataclass(frozen=True)
class DetectorsConfig:
    logits_finite: LogitsFiniteConfig = dataclasses.field(default_factory=LogitsFiniteConfig)
    token_repeat: TokenRepeatConfig = dataclasses.field(default_factory=TokenRepeatConfig)
    spec_acceptance: SpecAcceptanceConfig = dataclasses.field(default_factory=SpecAcceptanceConfig)
    logits_stats: LogitsStatsConfig = dataclasses.field(default_factory=LogitsStatsConfig)
    token_range: TokenRangeConfig = dataclasses.field(default_factory=TokenRangeConfig)
    dump: DumpConfig = dataclasses.field(default_factory=DumpConfig)
