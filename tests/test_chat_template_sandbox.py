"""Chat templates are code that comes with a model: they render in jinja2's immutable sandbox, with the helpers
transformers gives them, and a template that reaches for Python internals fails instead of running."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from fake_ring import FrontEnd

from ringsched.tokenizer import ChatTemplateError, ChatTemplateRaised, Tokenizer

MSGS = [{"role": "user", "content": "hi"}]


def _model_with_template(src: Path, dst: Path, template: str) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", dst)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


ESCAPES = [
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ joiner.__init__.__globals__['os'].system('touch MARKER') }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{{ messages.append({'role': 'x'}) }}",  # immutable: no mutating the caller's objects
]


@pytest.mark.parametrize("template", ESCAPES)
def test_templates_cannot_reach_python(smollm2_dir, tmp_path, template):
    marker = tmp_path / "pwned"
    d = _model_with_template(smollm2_dir, tmp_path / "m", template.replace("MARKER", str(marker)))
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json"):
        Tokenizer(d).render_chat(MSGS)
    assert not marker.exists()


def test_transformers_helpers_work(smollm2_dir, tmp_path):
    t = "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{% for m in messages %}{% break %}{% endfor %}"
    d = _model_with_template(smollm2_dir, tmp_path / "m", t)
    out = Tokenizer(d).render_chat([{"role": "user", "content": "café"}])
    assert out == '[{"role": "user", "content": "café"}]|4|'


def test_raise_exception_refuses_the_messages(smollm2_dir, tmp_path):
    d = _model_with_template(smollm2_dir, tmp_path / "m", "{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(ChatTemplateRaised, match="roles must alternate"):
        Tokenizer(d).render_chat(MSGS)


def test_the_server_answers_an_unsafe_template_with_a_clear_500(smollm2_dir, tmp_path):
    marker = tmp_path / "pwned"
    d = _model_with_template(smollm2_dir, tmp_path / "m", ESCAPES[0].replace("MARKER", str(marker)))
    fe = FrontEnd(str(d))
    try:
        r = httpx.post(f"{fe.url}/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2}, timeout=30)
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["code"] == "chat_template_error" and "tokenizer_config.json" in err["message"]
        assert "sandbox" in err["message"]
        r = httpx.post(f"{fe.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200  # completions do not use the template
        assert fe.wait_open(0) == 0
    finally:
        fe.close()
    assert not marker.exists()
