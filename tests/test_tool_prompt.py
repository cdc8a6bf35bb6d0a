"""Tools for a chat template that takes none: what exod writes into the conversation (`exod.runner.tool_prompt`)."""

from __future__ import annotations

import json

from exod.runner.tool_prompt import call_head, takes_tools, with_tools

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_a_template_that_never_names_tools_does_not_take_them():
    assert takes_tools("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}")
    assert not takes_tools("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}")
    assert takes_tools([{"name": "tool_use", "template": "{{ tools }}"}])  # a list of named templates


def test_the_tools_go_into_the_system_turn_kept_or_made():
    kept = with_tools([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], [TOOL])
    made = with_tools([{"role": "user", "content": "Hi"}], [TOOL])
    for messages in (kept, made):
        assert [m["role"] for m in messages] == ["system", "user"]
        assert json.dumps(TOOL) in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert kept[0]["content"].startswith("Be brief.\n\n# Tools")


def test_earlier_calls_and_their_results_become_text_the_model_can_read():
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "18 C", "tool_call_id": "c1"},
    ]
    rendered = with_tools(messages, [TOOL])
    assert rendered[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    }
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    # the form a forced call's prompt begins and its grammar writes (`exod.runner.grammar`)
    assert rendered[2]["content"].startswith("<tool_call>\n" + call_head("get_weather"))
    assert messages[1]["content"] is None  # the caller's messages are left as they were
