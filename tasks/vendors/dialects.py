"""Which adapter speaks for a channel: its `dialect`, narrowed by what the operator declared."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from tasks.models import VendorChannel
from tasks.vendors import assemblyai, aws_transcribe, local, memory, sluice
from tasks.vendors.capabilities import Capabilities
from tasks.vendors.protocol import VendorAdapter

AdapterFactory = Callable[..., VendorAdapter]

DIALECTS: dict[str, tuple[AdapterFactory, Capabilities]] = {
    "sluice": (sluice.SluiceAdapter, sluice.CAPABILITIES),
    "assemblyai": (assemblyai.AssemblyAIAdapter, assemblyai.CAPABILITIES),
    "local": (local.LocalEngineAdapter, local.CAPABILITIES),
    "aws_transcribe": (aws_transcribe.AWSTranscribeAdapter, aws_transcribe.CAPABILITIES),
    # In-memory, for tests of the steps' decisions (never offered in the console).
    "memory": (memory.MemoryAdapter, memory.CAPABILITIES),
}


def adapter_for(channel: VendorChannel, *, task_id: Any = None, generation: int | None = None,
                deadline: datetime | None = None) -> VendorAdapter:
    """The channel's adapter, on behalf of a task attempt; no call it makes outlives `deadline`."""
    factory, _ = DIALECTS[channel.dialect]
    return factory(channel, task_id=task_id, generation=generation, deadline=deadline)


def capabilities_for(channel: VendorChannel) -> Capabilities:
    """What this channel can do: its dialect's capabilities, narrowed by the channel's overrides."""
    if channel.dialect == "memory" and channel.name in memory.MemoryVendor.vendors:
        return memory.MemoryVendor.vendors[channel.name].capabilities.narrowed(channel.capability_overrides)
    _, capabilities = DIALECTS[channel.dialect]
    return capabilities.narrowed(channel.capability_overrides)
