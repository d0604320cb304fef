"""Where a chat template comes from (`tokenizer.template_of`): `--chat-template` (a file or the template itself)
over the model's `tokenizer_config.json` (a string, or named templates) over `chat_template.jinja`; a flag that is
neither a file nor a template, or does not parse, is refused at start naming the flag."""

from __future__ import annotations

import json
import shutil

import pytest

from ringsched.config import ConfigError
from ringsched.server.options import ServerOptions
from ringsched.tokenizer import Tokenizer

SIMPLE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def model(tiny_llama_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").exists() else {}
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_chat_template_jinja_beside_the_config_is_read(model):
    assert Tokenizer(model).chat_template is None
    (model / "chat_template.jinja").write_text(SIMPLE)
    assert Tokenizer(model).render_chat(CHAT) == "<user>hi<a>"


def test_named_templates_take_the_default(model):
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": SIMPLE}]
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    (model / "chat_template.jinja").write_text("not this one")
    assert Tokenizer(model).render_chat(CHAT, add_generation_prompt=False) == "<user>hi"


def test_the_flag_wins_as_a_file_or_inline(model, tmp_path):
    (model / "chat_template.jinja").write_text("not this one")
    f = tmp_path / "t.jinja"
    f.write_text(SIMPLE.replace("<a>", "<assistant>"))
    assert Tokenizer(model, str(f)).render_chat(CHAT) == "<user>hi<assistant>"
    assert Tokenizer(model, SIMPLE).render_chat(CHAT) == "<user>hi<a>"
    long = "{# " + "a long comment " * 40 + "#}" + SIMPLE  # longer than a file name may be
    assert Tokenizer(model, long).render_chat(CHAT) == "<user>hi<a>"


@pytest.mark.parametrize(
    "given, says",
    [("/no/such/template.jinja", "neither a file nor a template"), ("{% for m in messages %}", "does not parse")],
)
def test_a_bad_flag_is_refused_at_start(given, says):
    with pytest.raises(ConfigError, match=says):
        ServerOptions(chat_template=given)


def test_chat_template_kwargs_reach_the_template(model, tmp_path):
    """Qwen3's `enable_thinking`: the request's `chat_template_kwargs` are the template's variables."""
    from ringsched.server.protocol import APIError, parse_chat
    from ringsched.server.request_limits import Limits

    (model / "chat_template.jinja").write_text(SIMPLE + "{% if enable_thinking is defined and not enable_thinking %}"
                                               "<think></think>{% endif %}")  # fmt: skip
    tok = Tokenizer(model)
    limits = Limits(512, 1 << 20, tok.vocab_size, "m")
    body = {"messages": CHAT, "max_tokens": 4}
    plain = parse_chat(body, tok, limits).prompt_ids
    off = parse_chat({**body, "chat_template_kwargs": {"enable_thinking": False}}, tok, limits).prompt_ids
    assert tok.decode(off).endswith("<think></think>") and not tok.decode(plain).endswith("</think>")
    with pytest.raises(APIError, match="may not set messages") as e:
        parse_chat({**body, "chat_template_kwargs": {"messages": []}}, tok, limits)
    assert e.value.param == "chat_template_kwargs"


def test_reasoning_effort_reaches_the_template(model):
    from ringsched.server.protocol import parse_chat
    from ringsched.server.request_limits import Limits

    (model / "chat_template.jinja").write_text(SIMPLE + "{% if reasoning_effort is defined %}"
                                               "[effort {{ reasoning_effort }}]{% endif %}")  # fmt: skip
    tok = Tokenizer(model)
    limits = Limits(512, 1 << 20, tok.vocab_size, "m")
    body = {"messages": CHAT, "max_tokens": 4, "reasoning_effort": "low"}
    assert tok.decode(parse_chat(body, tok, limits).prompt_ids).endswith("[effort low]")
