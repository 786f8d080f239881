"""The `mirror` setting: where a run directory's durable copy lives (an fsspec URL), and how hard to try."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dream_trainer.errors import ConfigError

# The fsspec package each store needs, for the message when it is missing (the extra that installs it).
STORE_PACKAGES = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
                  "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"), "abfss": ("adlfs", "azure")}  # fmt: skip


@dataclass
class MirrorConfig:
    """`DreamTrainerConfig.mirror`: a copy of each run directory in an object store (or any fsspec URL).

    The run writes into its local directory under `root_dir` as always; a background thread copies it to
    `<url>/<run name>/`: each checkpoint, then its commit marker (`<checkpoint>.commit`, written last, so a
    checkpoint is visible only once all its bytes are there), and the other files (run.json, config.yaml, the
    loggers' files). `fit(ckpt_path="last")` on a machine whose `root_dir` is empty continues from the newest
    committed checkpoint in the store. Credentials come from the store's standard places (for S3: the
    AWS_* environment variables, ~/.aws; fsspec's own config for other options). See docs/object-store.md.
    """

    url: str
    """The store's prefix, e.g. "s3://bucket/runs" (s3fs), "gs://…" (gcsfs), "az://…" (adlfs), "file:///…"."""
    retries: int = 5
    """Attempts after the first for each upload, download or delete that fails (throttling, a 5xx, a reset
    connection), with exponential backoff; each retry is counted in run.json's "mirror"."""
    backoff_s: float = 0.5
    """The first retry's wait; each later one waits twice as long (at most 30 s), with jitter."""
    sync_every_s: float = 30.0
    """How often the other files of the run (run.json, logs) are copied while it trains."""
    flush_timeout_s: float = 25.0
    """At the end of a fit (a signal's stop included), how long to wait for uploads still running before the
    process exits: keep it under the scheduler's grace period (Slurm's KillWait, 30 s by default)."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or "://" not in self.url or self.url.startswith("://"):
            raise ConfigError(
                f"mirror.url = {self.url!r} is invalid: expected a URL with its scheme, e.g. 's3://bucket/runs'."
            )
        self.url = self.url.rstrip("/")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"mirror.retries = {self.retries!r} is invalid: expected an int >= 0.")
        for name in ("backoff_s", "sync_every_s", "flush_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"mirror.{name} = {value!r} is invalid: expected seconds > 0.")

    @property
    def protocol(self) -> str:
        return self.url.split("://", 1)[0]


def as_mirror(value: Any) -> MirrorConfig | None:
    """The setting as a `MirrorConfig`: a URL string, or a dict of its fields (a YAML config); None: off."""
    if value is None or isinstance(value, MirrorConfig):
        return value
    if isinstance(value, str):
        return MirrorConfig(url=value)
    if isinstance(value, Mapping):
        known = set(MirrorConfig.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"mirror: unknown field(s) {unknown}; the fields are {sorted(known)}.")
        if "url" not in value:
            raise ConfigError("mirror: 'url' is missing, e.g. mirror={'url': 's3://bucket/runs'}.")
        return MirrorConfig(**value)
    raise ConfigError(
        f"mirror = {value!r} is invalid: expected a URL such as 's3://bucket/runs', a MirrorConfig, or None."
    )


def check_store(config: MirrorConfig) -> None:
    """The store's fsspec implementation is installed (at construction, not at the first save)."""
    try:
        import fsspec

        fsspec.get_filesystem_class(config.protocol)
    except (ImportError, ValueError) as exc:
        package, extra = STORE_PACKAGES.get(config.protocol, (None, None))
        hint = (
            f'pip install "dream-trainer[{extra}]" (it installs {package})'
            if extra
            else 'pip install "dream-trainer[mirror]" (fsspec) and the package of that store'
        )
        raise ConfigError(f"mirror.url = {config.url!r} needs the {config.protocol!r} store: {hint}.\n{exc}") from exc
