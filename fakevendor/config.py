"""Configuration of the fake vendor process and of each channel it serves.

One process serves any number of channels, each under its own path prefix
(`http://127.0.0.1:9100/primary/v1/...`); `/v1/...` is the channel "default". A channel's
behaviour (processing time, prices, limits) can be changed at runtime through /__admin/channels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChannelConfig:
    processing_ms: float = 2000
    queue_ms: float = 100
    price_cents: dict[str, int] = field(default_factory=lambda: {"audio_minute": 2, "page": 1})
    max_upload_bytes: int = 4 * 1024**3
    upload_ttl_s: float = 3600
    result_ttl_s: float = 86400
    # Global token bucket on every vendor request of the channel; 0 disables it.
    rate_limit_per_s: float = 0
    rate_limit_burst: int = 50
    # Jobs queued or processing at once; 0 disables the limit. Excess: "reject" (429) or "queue".
    max_concurrent_jobs: int = 0
    concurrency_mode: str = "reject"
    # A cancel takes effect this long after it is asked for (0: at once).
    cancel_delay_ms: float = 0
    webhook_secret: str = "dev-webhook-secret"
    callback_attempts: int = 5

    def update(self, values: dict[str, Any]) -> None:
        names = {f.name: f for f in dataclasses.fields(self)}
        for key, value in values.items():
            if key not in names:
                raise ValueError(f"unknown channel setting {key!r}")
            current = getattr(self, key)
            if isinstance(current, bool) or current is None:
                setattr(self, key, value)
            elif isinstance(current, (int, float)) and not isinstance(value, (int, float)):
                raise ValueError(f"{key} must be a number")
            elif isinstance(current, dict) and not isinstance(value, dict):
                raise ValueError(f"{key} must be an object")
            elif key == "concurrency_mode" and value not in ("reject", "queue"):
                raise ValueError("concurrency_mode must be reject or queue")
            else:
                setattr(self, key, type(current)(value) if isinstance(current, (int, float)) else value)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 9100
    api_keys: tuple[str, ...] = ("dev-vendor-key",)
    admin_token: str = "dev-admin-token"
    seed: int = 0
    time_scale: float = 1.0
    data_dir: str = "var/fakevendor"
    channels: dict[str, ChannelConfig] = field(default_factory=dict)
    # Settings given to every channel created on first use.
    channel_defaults: dict[str, Any] = field(default_factory=dict)
    # Proxy mode: forward every vendor request here (fakevendor/proxy.py); record: append the
    # exchanges to this file; playback: serve a recording instead of any upstream.
    upstream: str = ""
    record: str = ""
    playback: str = ""

    def channel(self, name: str) -> ChannelConfig:
        if name not in self.channels:
            config = ChannelConfig()
            config.update(self.channel_defaults)
            self.channels[name] = config
        return self.channels[name]

    def scaled_s(self, nominal_s: float) -> float:
        return nominal_s * self.time_scale
