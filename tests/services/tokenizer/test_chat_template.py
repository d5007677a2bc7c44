"""Chat templates: our rendering equals transformers' apply_chat_template on the same template and messages;
template sources and their precedence; TGI's template_error cases."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from services.tokenizer.chat_template import ChatTemplates, TemplateError, flatten_content
from tests.tiny_models import CHAT_TEMPLATE

# A Hub-style template exercising what real ones use: a system message taken out first, raise_exception,
# namespace, loop controls, tojson of tools, bos/eos, add_generation_prompt, a chat_template_kwargs variable.
HUB_STYLE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = 'You are tiny.' %}
{%- endif %}
{{- '[SYS]' + system + '[/SYS]\\n' }}
{%- if tools %}
    {{- '[TOOLS]' + tools | tojson + '[/TOOLS]\\n' }}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {{- raise_exception('System role only at the start') }}
    {%- endif %}
    {%- if message['content'] == '' %}{% continue %}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '[' + message['role'] | upper + ']' + message['content'] | trim }}
    {%- if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}
    {{- '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '[ASSISTANT]' }}
    {%- if enable_thinking is defined and not enable_thinking %}{{ '(no thinking)' }}{% endif %}
{%- endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city <now>",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

CHATS = {
    "one user turn": [{"role": "user", "content": "Hello there"}],
    "system and turns": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": 'Ünïcödé & <tags> "quotes"'},
    ],
    "empty turn skipped": [{"role": "user", "content": ""}, {"role": "user", "content": "x"}],
}


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(str(tiny_dir))


def hf_render(hf_tokenizer, messages, template=None, tools=None, **kwargs):
    continuing = messages[-1]["role"] == "assistant"
    return hf_tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=not continuing,
        continue_final_message=continuing,
        **kwargs,
    )


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, HUB_STYLE], ids=["tiny", "hub-style"])
@pytest.mark.parametrize("chat", list(CHATS), ids=list(CHATS))
@pytest.mark.parametrize("with_tools", [False, True], ids=["no-tools", "tools"])
def test_equals_transformers(tiny_dir, hf_tokenizer, template, chat, with_tools):
    ours = ChatTemplates.load(tiny_dir, override=template)
    tools = TOOLS if with_tools else None
    expected = hf_render(hf_tokenizer, CHATS[chat], template, tools)
    assert ours.render(CHATS[chat], tools) == expected
    if with_tools:
        assert "get_weather" in expected and "<now>" in expected  # tojson without HTML escaping


def test_model_template_equals_transformers(tiny_dir, hf_tokenizer):
    # no override: the folder's chat_template.jinja, as transformers also loads it
    messages = CHATS["system and turns"]
    assert ChatTemplates.load(tiny_dir).render(messages) == hf_render(hf_tokenizer, messages)
    assert hf_tokenizer.chat_template == CHAT_TEMPLATE


def test_list_of_parts_content(tiny_dir, hf_tokenizer):
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Look at "}, {"type": "text", "text": "this: "}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/cat.png"}}]},
    ]
    flat = [{"role": "user", "content": "Look at this: "}, {"role": "user", "content": "![](https://x/cat.png)"}]
    for template in (CHAT_TEMPLATE, HUB_STYLE):
        ours = ChatTemplates.load(tiny_dir, override=template).render(parts)
        assert ours == hf_render(hf_tokenizer, flat, template)
    # TGI's rewrite for multimodal templates: messages[0]['content'][0]['text'] reads the flattened string
    multimodal = (
        "{{ messages[0]['content'][0]['text'] }}|{% generation %}{{ messages[0]['content'] }}{% endgeneration %}"
    )
    assert ChatTemplates.load(tiny_dir, override=multimodal).render(parts) == "Look at this: |Look at this: "


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, HUB_STYLE], ids=["tiny", "hub-style"])
def test_continued_final_assistant_message(tiny_dir, hf_tokenizer, template):
    messages = [{"role": "user", "content": "Count: one"}, {"role": "assistant", "content": "two, three"}]
    ours = ChatTemplates.load(tiny_dir, override=template).render(messages)
    assert ours == hf_render(hf_tokenizer, messages, template)
    assert ours.endswith("two, three")  # no end of turn, no generation prompt: the model continues the message


def test_continued_message_trims_trailing_space_as_tgi(tiny_dir):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is  "}]
    # TGI cuts after the content and trims the end; transformers keeps the spaces where the template does
    assert ChatTemplates.load(tiny_dir).render(messages).endswith("\nThe answer is")


def test_continued_message_found_after_a_copy_of_its_text(tiny_dir):
    # TGI's rfind would match the later "assistant" of a generation prompt; the last copy of the content is cut
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}<end>"
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "assistant"}]
    out = ChatTemplates.load(tiny_dir, override=template).render(messages)
    assert out == "<user>x</user><assistant>assistant"


def test_chat_template_kwargs(tiny_dir, hf_tokenizer):
    messages = CHATS["one user turn"]
    ours = ChatTemplates.load(tiny_dir, override=HUB_STYLE).render(messages, kwargs={"enable_thinking": False})
    assert ours.endswith("[ASSISTANT](no thinking)")
    assert ours == hf_render(hf_tokenizer, messages, HUB_STYLE, enable_thinking=False)
    # the fixed variables are not overridable through kwargs
    fixed = ChatTemplates.load(tiny_dir).render(messages, kwargs={"messages": [], "bos_token": "X"})
    assert fixed == ChatTemplates.load(tiny_dir).render(messages)


def test_strftime_now(tiny_dir):
    import datetime

    year = ChatTemplates.load(tiny_dir, override="{{ strftime_now('%Y') }}").render([])
    assert year in {str(datetime.date.today().year), str(datetime.date.today().year + 1)}


def copy_tokenizer(tiny_dir, folder):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, folder / name)
    return folder


def set_config_template(folder, value):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = value
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_sources_precedence(tiny_dir, tmp_path):
    folder = copy_tokenizer(tiny_dir, tmp_path)
    assert ChatTemplates.load(folder).sources == {}
    set_config_template(folder, "config")
    assert ChatTemplates.load(folder).render([]) == "config"
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "json"}))
    assert ChatTemplates.load(folder).render([]) == "json"
    (folder / "chat_template.jinja").write_text("jinja")
    assert ChatTemplates.load(folder).render([]) == "jinja"
    assert ChatTemplates.load(folder, override="override {{ bos_token }}").render([]) == "override <bos>"


def test_named_templates(tiny_dir, tmp_path):
    folder = copy_tokenizer(tiny_dir, tmp_path)
    set_config_template(
        folder,
        [
            {"name": "default", "template": "default:{{ messages[0].content }}"},
            {"name": "tool_use", "template": "tools:{{ tools[0].function.name }}"},
        ],
    )
    ours = ChatTemplates.load(folder)
    hf = AutoTokenizer.from_pretrained(str(folder))
    messages = CHATS["one user turn"]
    assert ours.render(messages) == "default:Hello there" == hf_render(hf, messages)
    assert ours.render(messages, TOOLS) == "tools:get_weather" == hf_render(hf, messages, tools=TOOLS)
    set_config_template(folder, [{"name": "other", "template": "x"}])
    with pytest.raises(TemplateError) as e:
        ChatTemplates.load(folder).render(messages)  # TGI uses only the one named default
    assert e.value.full_message == "Template error: template not found"


def test_special_tokens_as_objects(tiny_dir, tmp_path):
    folder = copy_tokenizer(tiny_dir, tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(bos_token={"content": "<s>", "lstrip": False}, eos_token=None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    # an AddedToken object gives its content; a missing token is undefined (renders empty), not "None"
    assert ChatTemplates.load(folder, override="{{ bos_token }}|{{ eos_token }}").render([]) == "<s>|"


ERRORS = [
    # (template, messages, exact message or prefix)
    (None, CHATS["one user turn"], "Template error: template not found"),
    (
        HUB_STYLE,
        [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
        "Template error: syntax error: System role only at the start (in <string>:15)",
    ),
    ("{% for m in messages %}{{ m.content }", [], "Template error: syntax error: "),
    ("{{ messages[0].content.nope.deeper }}", CHATS["one user turn"], "Template error: undefined value: "),
    # the sandbox: a template cannot mutate its inputs or reach Python internals
    ("{{ messages.append(1) }}", [], "Template error: invalid operation: access to attribute 'append' of 'list'"),
    ("{{ (messages.__class__)() }}", [], "Template error: invalid operation: access to attribute '__class__'"),
]


@pytest.mark.parametrize("template,messages,message", ERRORS)
def test_template_errors(tiny_dir, tmp_path, template, messages, message):
    if template is None:  # a model folder without any template
        templates = ChatTemplates.load(copy_tokenizer(tiny_dir, tmp_path))
    else:
        templates = ChatTemplates.load(tiny_dir, override=template)
    with pytest.raises(TemplateError) as e:
        templates.render(messages)
    assert e.value.error_type == "template_error"
    assert e.value.full_message.startswith(message)


def test_flatten_content():
    assert flatten_content({"role": "user", "content": "plain"}) == "plain"
    tool_calls = [{"id": "0", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]
    assert (
        flatten_content({"role": "assistant", "content": None, "tool_calls": tool_calls})
        == '[{"id":"0","type":"function","function":{"name":"f","arguments":{"a":1}}}]'
    )
    assert (
        flatten_content({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})
        == "ab"
    )
