"""A channel's per-lane rows (the local engine's converters: normal 2, heavy 1, unknown-risk 1)
decided without a database."""

from __future__ import annotations

from django.conf import settings

from tasks.models import VendorChannel
from tasks.scheduling.budgets import ChannelUsage, lane_rows
from tasks.scheduling.channels import ChannelRoom


def engine_room(jobs_by_lane: dict[str, int]) -> ChannelRoom:
    channel = VendorChannel(name="local", dialect="local", max_inflight_jobs=settings.ENGINE_SLOTS,
                            max_concurrent_uploads=settings.ENGINE_SLOTS * 2, reserved_for_interactive=1,
                            lane_slots=settings.ENGINE_LANE_SLOTS)
    usage = ChannelUsage(jobs=sum(jobs_by_lane.values()), uploads=0, jobs_by_lane=jobs_by_lane)
    return ChannelRoom(channel=channel, available=True, free_jobs=usage.free_jobs(channel), free_uploads=usage.free_uploads(channel),
                       free_by_row=usage.free_by_row(channel))


def test_the_shipped_engine_rows_are_normal_two_heavy_one_risky_one():
    assert {key: limit for key, (_, limit) in lane_rows(settings.ENGINE_LANE_SLOTS).items()} == \
        {"interactive+batch": 2, "heavy": 1, "unknown-risk": 1}
    assert lane_rows({"interactive+batch": 2})["interactive+batch"][0] == {"interactive", "batch"}
    assert settings.ENGINE_SLOTS >= sum(settings.ENGINE_LANE_SLOTS.values())


def test_a_busy_heavy_converter_holds_heavy_work_but_not_normal_work():
    room = engine_room({"heavy": 1})
    assert not room.fits("heavy")
    assert room.fits("interactive") and room.fits("batch") and room.fits("unknown-risk")


def test_normal_lanes_share_their_row_and_taking_counts_against_it():
    room = engine_room({})
    room.take("interactive")
    assert room.fits("interactive") and not room.fits("batch"), "batch never takes the converter kept for interactive"
    room.take("interactive")
    assert not room.fits("interactive") and not room.fits("batch"), "interactive and batch share two converters"
    assert room.fits("heavy") and room.fits("unknown-risk")
    room.take("heavy")
    assert not room.fits("heavy") and room.fits("unknown-risk"), "the risky row is not held back for interactive"
    room.take("unknown-risk")
    assert not room.fits("unknown-risk")


def test_batch_takes_one_normal_converter_and_leaves_the_other_to_interactive():
    room = engine_room({"batch": 1})
    assert not room.fits("batch") and room.fits("interactive")


def test_a_lane_no_row_names_is_bound_only_by_the_channel_budget():
    channel = VendorChannel(name="v", max_inflight_jobs=3, max_concurrent_uploads=3, reserved_for_interactive=0,
                            lane_slots={"heavy": 1})
    room = ChannelRoom(channel=channel, available=True, free_jobs=3, free_uploads=3, free_by_row={"heavy": 1})
    for _ in range(3):
        assert room.fits("interactive")
        room.take("interactive")
    assert not room.fits("interactive") and not room.fits("heavy")
