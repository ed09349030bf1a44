"""A scenario against another vendor dialect: its fault rules, channels and workload translated.

Scenarios are written against the native dialect (shared/contracts/vendor-api.md). For AssemblyAI
every rule's endpoint is renamed to its v2 equivalent (fakevendor/assemblyai.py), both channels
speak v2 (two-step, transcription only: AssemblyAI has no inline create and converts nothing),
and transcription results are subtitles (srt), so a result download is its own request as it
is natively. A scenario that is not written for a dialect does not run against it.
"""

from __future__ import annotations

from dataclasses import replace

from fakevendor import assemblyai
from tasks.poc.model import Scenario, Submit

DIALECTS = ("sluice", "assemblyai")
AUDIO = {"wav", "wav_long", "wav_big"}


class NotApplicable(Exception):
    """The scenario is not written for this dialect."""


def for_dialect(scenario: Scenario, dialect: str) -> Scenario:
    if dialect not in DIALECTS:
        raise NotApplicable(f"unknown dialect {dialect!r}; known: {', '.join(DIALECTS)}")
    if dialect not in scenario.dialects:
        raise NotApplicable(f"{scenario.name} is written for {', '.join(scenario.dialects)}, not {dialect}")
    if dialect == "sluice":
        return scenario
    channels = {}
    for name in ("primary", "fallback"):
        values = {**scenario.channels.get(name, {})}
        if values.get("enabled") is not False:
            values.update(dialect="assemblyai", mode="two_step", kinds=["transcription"])
        channels[name] = values
    return replace(
        scenario,
        dialect=dialect,
        faults=[assemblyai.translate_rule(rule) for rule in scenario.faults],
        channels=channels,
        workload=[_transcription(spec) for spec in scenario.workload],
    )


def _transcription(spec: Submit) -> Submit:
    content = spec.content if spec.content in AUDIO else "wav"
    label = spec.label if spec.content in AUDIO else "recording.wav"
    target = "srt" if spec.target_format in ("txt", "pdf", "html", "md") else spec.target_format
    return replace(spec, kind="transcription", target_format=target, content=content, label=label)


def native_endpoint(endpoint: str) -> str:
    """A journal entry's endpoint as the native dialect names it (for checks written natively)."""
    native = {wire: native for native, wire in assemblyai.ENDPOINTS.items()}
    native["GET /v2/transcript/*/vtt"] = "GET /v1/jobs/*/result"
    return native.get(endpoint, endpoint)
