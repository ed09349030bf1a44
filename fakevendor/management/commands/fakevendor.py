"""`python manage.py fakevendor --port 9100 [--seed N] [--faults FILE.json]`: serve the fake vendor.

`--upstream URL` puts its fault rules in front of a real vendor instead (proxy mode), `--record
FILE` keeps the exchanges, `--playback FILE` serves them again without any upstream."""

from __future__ import annotations

import json
import os
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from fakevendor.config import ChannelConfig, ServerConfig
from fakevendor.faults import RuleError, parse_rule
from fakevendor.proxy import ProxyConfigError, check_upstream
from fakevendor.server import run

DEV_ADMIN_TOKEN = "dev-admin-token"


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Command(BaseCommand):
    help = "Serve the bundled fake vendor (shared/contracts/vendor-api.md) with fault injection."

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, default=9100, help="0 picks a free port.")
        parser.add_argument("--host", default="127.0.0.1", help="Bind address (loopback unless told otherwise).")
        parser.add_argument("--seed", type=int, default=None)
        parser.add_argument("--faults", help='JSON file: {"seed": 1, "rules": [...]}.')
        parser.add_argument("--channels", help='JSON file: {"primary": {"processing_ms": 500}, ...}.')
        parser.add_argument("--processing-ms", type=float, default=None, help="Default processing time of every channel.")
        parser.add_argument("--time-scale", type=float, default=None, help="Multiplies every interval (default: SLUICE_TIME_SCALE).")
        parser.add_argument("--data-dir", default=None, help="Where its own database and files live.")
        parser.add_argument("--ready-file", default=None, help="Write the bound port here once listening.")
        parser.add_argument("--upstream", default="", help="Proxy mode: forward every vendor request to this URL.")
        parser.add_argument("--record", default="", help="With --upstream: append every exchange to this file.")
        parser.add_argument("--playback", default="", help="Serve the exchanges a --record file holds (no upstream).")

    def handle(self, *args, **options):
        seed, rules = 0, []
        if options["faults"]:
            try:
                plan = json.loads(Path(options["faults"]).read_text())
            except (OSError, ValueError) as exc:
                raise CommandError(f"cannot read {options['faults']}: {exc}") from None
            seed = int(plan.get("seed", 0))
            rules = plan.get("rules", [])
            for index, rule in enumerate(rules):
                try:
                    parse_rule(rule, default_id=f"file{index}")
                except RuleError as exc:
                    raise CommandError(f"rule {index}: {exc}") from None
        if options["seed"] is not None:
            seed = options["seed"]
        channels: dict[str, ChannelConfig] = {}
        if options["channels"]:
            try:
                spec = json.loads(Path(options["channels"]).read_text())
            except (OSError, ValueError) as exc:
                raise CommandError(f"cannot read {options['channels']}: {exc}") from None
            for name, values in spec.items():
                channels[name] = ChannelConfig()
                try:
                    channels[name].update(values)
                except ValueError as exc:
                    raise CommandError(f"channel {name}: {exc}") from None
        time_scale = options["time_scale"] or float(settings.TIME_SCALE)
        if not 0 < time_scale <= 10:
            raise CommandError("--time-scale must be in (0, 10]")
        admin_token = os.environ.get("FAKEVENDOR_ADMIN_TOKEN") or DEV_ADMIN_TOKEN
        if admin_token == DEV_ADMIN_TOKEN and not _loopback(options["host"]):
            raise CommandError(
                f"Refusing to listen on {options['host']} with the published development admin token: anyone "
                "who can reach it could rewrite its faults. Set FAKEVENDOR_ADMIN_TOKEN, or bind 127.0.0.1."
            )
        upstream = options["upstream"]
        if upstream:
            try:
                upstream = check_upstream(upstream)
            except ProxyConfigError as exc:
                raise CommandError(str(exc)) from None
        if options["record"] and not upstream:
            raise CommandError("--record needs --upstream (the vendor whose answers it records)")
        if options["playback"] and upstream:
            raise CommandError("--playback serves a recording instead of an upstream: give one or the other")
        if options["playback"] and not Path(options["playback"]).is_file():
            raise CommandError(f"--playback: no recording at {options['playback']}")
        data_dir = options["data_dir"] or str(settings.DATA_DIR / f"fakevendor-{options['port']}")
        config = ServerConfig(
            host=options["host"],
            port=options["port"],
            api_keys=tuple(k.strip() for k in os.environ.get("FAKEVENDOR_API_KEYS", "dev-vendor-key").split(",") if k.strip()),
            admin_token=admin_token,
            seed=seed,
            time_scale=time_scale,
            data_dir=data_dir,
            channels=channels,
            upstream=upstream,
            record=options["record"],
            playback=options["playback"],
        )
        if options["processing_ms"] is not None:
            config.channel_defaults["processing_ms"] = options["processing_ms"]
            for channel in channels.values():
                channel.processing_ms = options["processing_ms"]
        run(config, rules=rules, ready_file=options["ready_file"])
