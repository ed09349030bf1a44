"""A small client for the fake vendor's /__admin/ control API (tests, POC runner, console page)."""

from __future__ import annotations

from typing import Any

import httpx


class ControlError(Exception):
    """The control API refused a call; `field` names the bad field of a rule."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body.get("detail") or f"HTTP {status}")
        self.status = status
        self.code = body.get("code")
        self.field = body.get("field")


class ControlUnreachable(ControlError):
    """The control API did not answer at all (not running, wrong address, timed out)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(0, {"detail": f"not reachable ({type(error).__name__})"})


class VendorControl:
    def __init__(self, base_url: str, admin_token: str, *, timeout: float = 10) -> None:
        self.base = base_url.rstrip("/")
        self.http = httpx.Client(
            base_url=self.base, headers={"Authorization": f"Bearer {admin_token}"}, timeout=timeout, trust_env=False
        )

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as error:
            raise ControlUnreachable(error) from error
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = {}
            raise ControlError(response.status_code, body)
        return response.json() if response.content else None

    def health(self) -> bool:
        try:
            return self.http.get("/__admin/health").status_code == 200
        except httpx.HTTPError:
            return False

    def rules(self) -> list[dict[str, Any]]:
        return self._call("GET", "/__admin/faults")["data"]

    def add_rule(self, rule: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/__admin/faults", json=rule)

    def delete_rule(self, rule_id: str) -> None:
        self._call("DELETE", f"/__admin/faults/{rule_id}")

    def clear_rules(self) -> None:
        self._call("DELETE", "/__admin/faults")

    def set_seed(self, seed: int) -> None:
        self._call("PUT", "/__admin/seed", json={"seed": seed})

    def reset(self, *, faults: bool = True, state: bool = True, journal: bool = True) -> None:
        self._call("POST", "/__admin/reset", json={"faults": faults, "state": state, "journal": journal})

    def journal(self, *, after_seq: int = 0, limit: int = 100000, detail: bool = False,
                **filters: Any) -> list[dict[str, Any]]:
        """Journal entries matching `filters` (method, path glob, endpoint, rule, status such as 503
        or "5xx", outcome, channel, client_ref, job_id, since, until, order="desc")."""
        params = {"after_seq": after_seq, "limit": limit, **({"detail": "1"} if detail else {}),
                  **{k: v for k, v in filters.items() if v not in (None, "")}}
        return self._call("GET", "/__admin/journal", params=params)["data"]

    def journal_count(self, **filters: Any) -> dict[str, Any]:
        """How many entries match, and how they split by status, outcome, endpoint and rule."""
        return self._call("GET", "/__admin/journal/count",
                          params={k: v for k, v in filters.items() if v not in (None, "")})

    def journal_entry(self, seq: int) -> dict[str, Any]:
        """One entry in full: the request's and the answer's headers and bodies (redacted)."""
        return self._call("GET", f"/__admin/journal/{int(seq)}")

    def scenarios(self) -> dict[str, str]:
        """Each scenario the rules name, and the state it is in."""
        return self._call("GET", "/__admin/scenarios")["data"]

    def reset_scenarios(self) -> dict[str, str]:
        return self._call("POST", "/__admin/scenarios/reset")["data"]

    def in_flight(self) -> list[dict[str, Any]]:
        """The vendor requests being answered right now, oldest first."""
        return self._call("GET", "/__admin/in-flight")["data"]

    def invariants(self) -> dict[str, Any]:
        return self._call("GET", "/__admin/invariants")

    def amnesia(self) -> dict[str, Any]:
        """The vendor forgets every upload, job and idempotency key (as after a restart); the
        ledger of what it billed stays."""
        return self._call("POST", "/__admin/amnesia")

    def ledger(self) -> list[dict[str, Any]]:
        """Every billed job of every channel, in billing order."""
        return self._call("GET", "/__admin/ledger")["data"]

    def create_job(self, *, channel: str, client_ref: str, api_key: str, kind: str = "transcription",
                   target_format: str = "txt", content: bytes = b"RIFF") -> dict[str, Any]:
        """Create (and so bill) a job through the vendor API itself, as a client would."""
        prefix = "" if channel == "default" else f"/{channel}"
        headers = {"Authorization": f"Bearer {api_key}"}
        response = httpx.post(f"{self.base}{prefix}/v1/jobs", content=content, timeout=10, trust_env=False,
                              params={"kind": kind, "target_format": target_format, "client_ref": client_ref},
                              headers={**headers, "Content-Type": "application/octet-stream"})
        if response.status_code >= 400:
            raise ControlError(response.status_code, response.json())
        return response.json()

    def channel(self, name: str, **values: Any) -> dict[str, Any]:
        if values:
            return self._call("PUT", f"/__admin/channels/{name}", json=values)
        return self._call("GET", f"/__admin/channels/{name}")

    def usage(self, channel: str, api_key: str) -> list[dict[str, Any]]:
        """The channel's whole usage ledger (through the vendor API itself)."""
        entries: list[dict[str, Any]] = []
        cursor = None
        prefix = "" if channel == "default" else f"/{channel}"
        while True:
            params: dict[str, Any] = {"limit": 1000}
            if cursor:
                params["cursor"] = cursor
            page = httpx.get(f"{self.base}{prefix}/v1/usage", params=params, timeout=10, trust_env=False,
                             headers={"Authorization": f"Bearer {api_key}"}).json()
            entries += page["data"]
            cursor = page.get("next_cursor")
            if not cursor:
                return entries
