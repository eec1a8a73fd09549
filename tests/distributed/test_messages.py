"""What the ranks send each other reads back as it was sent, as JSON only: a payload
that is not one of the calls (a pickle, another kind, missing fields) is one clear
error, and nothing in it runs."""

from __future__ import annotations

import pickle

import pytest

from offload.distributed import messages as m
from offload.distributed.channel import PipelineError
from offload.engine.kv_room import Keep, Move
from offload.engine.spec_tree import Tree

ROW = m.RowView(start=2, column=9, input_token=5, is_live=True, eager=False, prompt_ids=[1, 2])
GROUP = m.GroupView(first=1, width=4, every_position=True, rows=[ROW, ROW])


@pytest.mark.parametrize(
    "message",
    [
        m.Hello(2, "LlamaForCausalLM", 30, 2**31),
        m.Layout([[0, 3], [3, 6]]),
        m.Ready(1, "out of memory"),
        m.Open(3, 8, 512, [3, 64, 64], False, 2),
        m.Close(3),
        m.Release(3, [4, 0, 7]),
        m.MoveRows(3, [Move(2, 0, 17), Keep(1, 5)]),
        m.CopyPrompt(3, GROUP),
        m.ForgetStep(3),
        m.KeepPaths(3, [ROW], [[0, 2]]),
        m.Prefill(3, GROUP, 0, 4),
        m.PrefillPacked(3, [GROUP, GROUP], [[0, 4], [2, 4]]),
        m.Mixed(3, [ROW, ROW], [GROUP, GROUP], [[4, 8], [0, 3]]),
        m.Decode(3, [ROW]),
        m.Verify(3, [ROW, ROW], [Tree([4, 5, 6], [-1, 0, 0]), None]),
        m.Ping(),
        m.Stop(),
    ],
)
def test_every_message_reads_back_as_sent(message):
    back = m.decode(m.encode(message))
    assert back == message and type(back) is type(message)
    if isinstance(message, m.MoveRows):
        assert [type(x) for x in back.moves] == [Move, Keep]


@pytest.mark.parametrize(
    "payload",
    [
        pickle.dumps(m.Stop()),
        b'{"kind": "Popen", "body": {}}',
        b'{"kind": "Decode", "body": {"runner": 1}}',
        b"not json",
    ],
)
def test_a_payload_that_is_not_a_call_is_one_clear_error(payload):
    with pytest.raises(PipelineError, match="a pipeline message could not be read") as info:
        m.decode(payload)
    assert "\n" not in str(info.value)
