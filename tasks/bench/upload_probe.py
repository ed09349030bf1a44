"""Upload a file through the vendor client in a fresh process; print the answer, the peak RSS
before and after (MiB) and the seconds the upload took.

`python -m tasks.bench.upload_probe PATH CHANNEL two_step|inline` with the database in the
environment (the benchmarks and the 1 GiB test run it).
"""

import hashlib
import os
import sys
import time
from pathlib import Path

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
django.setup()

from tasks.models import VendorChannel
from tasks.vendors.dialects import adapter_for
from tasks.vendors.protocol import JobRequest, Operation


def peak_rss_mb() -> float:
    """VmHWM: this process image's peak (ru_maxrss would include the parent's memory before exec)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def main() -> None:
    path, channel_name, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    channel = VendorChannel.objects.get(name=channel_name)
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1024 * 1024):
            digest.update(chunk)
    before = peak_rss_mb()
    vendor = adapter_for(channel)
    operation = Operation(client_ref="rss-1", idempotency_key="rss-1")
    started = time.monotonic()
    if mode == "two_step":
        receipt = vendor.upload(Path(path), size=size, sha256=digest.hexdigest(), operation=operation)
        answer = receipt.upload_id
    else:
        created = vendor.create_job(JobRequest(kind="transcription", target_format="txt", operation=operation,
                                               inline_path=Path(path), size=size, sha256=digest.hexdigest()))
        answer = created.job.id
    elapsed = time.monotonic() - started
    peak = peak_rss_mb()
    print(f"{answer} {before:.1f} {peak:.1f} {elapsed:.3f}")


if __name__ == "__main__":
    main()
