"""A request's JSON read strictly: each wrong type or value is a 400 naming the field and
what it takes (no string read as a bool or a number, no value clamped silently)."""

import pytest

from offload.server.protocol import APIError, messages_of, sampling_params


def _refusal(body: dict, chat: bool = False) -> APIError:
    with pytest.raises(APIError) as caught:
        if "messages" in body:
            messages_of(body)
        sampling_params(body, chat=chat)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize("value", ["inf", 1e308, 100.5, -101, float("nan"), True, "5", None])
def test_a_logit_bias_beyond_100_or_not_a_number_is_refused(value):
    error = _refusal({"logit_bias": {"5": value}})
    assert error.param == "logit_bias"
    assert "numbers in [-100, 100]" in error.message


@pytest.mark.parametrize("token", ["x", "-1", " 5", "5_0", "\u0665"])  # (U+0665: Arabic 5)
def test_a_logit_bias_key_must_be_plain_digits(token):
    assert "token ids (digits)" in _refusal({"logit_bias": {token: 1}}).message


def test_a_logit_bias_in_range_is_kept_exactly():
    params = sampling_params({"logit_bias": {"5": -100, "7": 2.5, "9": 100}}, chat=False).params
    assert params.logit_bias == {5: -100.0, 7: 2.5, 9: 100.0}


@pytest.mark.parametrize("value", ["no", "false", 0, 1, None, []])
def test_include_usage_must_be_a_json_boolean(value):
    body = {"stream": True, "stream_options": {"include_usage": value}}
    if value is None:  # null: the field's default, as unset
        assert sampling_params(body, chat=True).include_usage is False
        return
    error = _refusal(body, chat=True)
    assert error.param == "stream_options" and "true or false" in error.message


def test_stream_options_need_a_stream():
    body = {"stream_options": {"include_usage": True}}
    assert "needs stream=true" in _refusal(body).message
    streamed = sampling_params({**body, "stream": True}, chat=False)
    assert streamed.include_usage is True


@pytest.mark.parametrize(
    ("field", "value"),
    [("stream", "true"), ("ignore_eos", "no"), ("n", "2"), ("temperature", "0.5"),
     ("max_tokens", 1.0), ("seed", "3"), ("skip_special_tokens", 1)],
)  # fmt: skip
def test_no_field_reads_a_string_or_another_type_loosely(field, value):
    assert _refusal({field: value}).param == field


@pytest.mark.parametrize("text", [5, 1.5, ["a"], {"t": 1}, None, True])
def test_a_content_part_whose_text_is_not_a_string_is_400(text):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    error = _refusal(body, chat=True)
    assert error.param == "messages" and "messages[0].content[].text" in error.message


def test_content_parts_other_than_text_are_refused_by_name():
    image = {"type": "image_url", "image_url": {"url": "x"}}
    body = {"messages": [{"role": "user", "content": ["plain", image]}]}
    assert "text only" in _refusal(body, chat=True).message
    parts = [{"type": "text", "text": "a"}, {"text": "b"}]
    assert messages_of({"messages": [{"role": "user", "content": parts}]})[0]["content"] == "ab"
