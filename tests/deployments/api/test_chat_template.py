"""deployments/api/chat_template.py and the shipped smollm2_tools template: without tools it renders what the
embedded model's own template renders; with tools it shows them, the calls and their results in the hermes format."""

import json

import pytest
from pydantic import ValidationError

from deployments.api.chat_template import chat_template_for, chat_template_text
from deployments.config import SpecServeConfig
from engine.models.loading import load_tokenizer, resolve

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More?"}],
    [{"role": "developer", "content": "d"}, {"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_tokenizer(resolve("smollm2"))


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_without_tools_smollm2_tools_renders_what_the_model_s_own_template_renders(smollm2_tokenizer, messages,
                                                                                  generation_prompt):
    own = smollm2_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    shipped = smollm2_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                    chat_template=chat_template_text("smollm2_tools"))
    assert shipped == own


def test_with_tools_it_shows_the_tools_the_calls_and_their_results(smollm2_tokenizer):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "snow"},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    text = smollm2_tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                                 chat_template=chat_template_text("smollm2_tools"))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(TOOLS[0]) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call><|im_end|>\n') in text
    assert ("<|im_start|>user\n<tool_response>\nsnow\n</tool_response>\n<tool_response>\n-3 C\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n") in text
    assert text.count("Be brief.") == 1


def test_auto_is_the_model_s_own_template_except_for_the_embedded_model(tmp_path):
    assert chat_template_for("auto", "smollm2") == chat_template_text("smollm2_tools")
    assert chat_template_for("auto", "/models/Qwen2.5-7B-Instruct") is None
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert chat_template_for(str(path), "x") == "{{ messages[0]['content'] }}"
    assert chat_template_for("{% for m in messages %}{% endfor %}", "x") == "{% for m in messages %}{% endfor %}"
    with pytest.raises(ValidationError, match="neither a shipped template"):
        SpecServeConfig.model_validate({"model": {"chat_template": "no_such_template"}})
