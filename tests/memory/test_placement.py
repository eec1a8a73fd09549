"""The placement and disk I/O enums are their strings wherever a string is expected:
configs, JSON, flags and dicts keyed by the string see no difference."""

import json

import pytest

from offload.config import DISK_IO, DiskOffloadConfig, OffloadConfig
from offload.memory.placement import DiskIO, Placement


@pytest.mark.parametrize("member", [*Placement, *DiskIO])
def test_a_member_is_its_string_everywhere(member):
    text = member.value
    assert member == text and str(member) == text and f"{member}" == text
    assert f"{member:>12}" == f"{text:>12}"
    assert {text: 1}[member] == 1 and {member: 1}[text] == 1  # hashed as its string
    assert json.dumps({member: member}) == json.dumps({text: text})


def test_the_config_parses_the_string_and_writes_it_back():
    config = OffloadConfig.from_dict({"cpu_memory_gb": 1, "disk_io": "page-cache"})
    assert config.disk.disk_io is DiskIO.PAGE_CACHE
    written = config.to_dict()["disk"]["disk_io"]
    assert written == "page-cache" and type(written) is str
    assert DISK_IO == ("auto", "direct", "page-cache", "mmap")


def test_a_bad_disk_io_keeps_its_message():
    with pytest.raises(ValueError, match=r"disk.disk_io must be one of auto, direct, "):
        DiskOffloadConfig(disk_io="o_direct")
