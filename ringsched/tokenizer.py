"""Tokenization and chat templates from a model directory (`tokenizer.json`, `tokenizer_config.json`).

Chat templates come with the model (or a GGUF's metadata), so they are untrusted code: they render in jinja2's
immutable sandbox with the helpers transformers gives them (`raise_exception`, `strftime_now`, `tojson`), and a
template that reaches for Python internals fails with `ChatTemplateError` instead of running.
"""

from __future__ import annotations

import datetime
import json
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

# Texts longer than this are encoded through `encode_batch`, which releases the GIL (`encode` holds it: a
# megabyte of text would stall the server's event loop for a second or more).
_GIL_FREE_CHARS = 10_000


class ChatTemplateError(RuntimeError):
    """The model's chat template is broken or unsafe: the server's problem, not the request's."""


class ChatTemplateRaised(ValueError):
    """The template refused the messages (its `raise_exception`, or messages it cannot render)."""


class Tokenizer:
    def __init__(self, model_dir: str | Path, chat_template: str | None = None) -> None:
        """`chat_template`: one to use instead of the model's (`--chat-template`: a file, or the template itself)."""
        model_dir = self.model_dir = Path(model_dir)
        self._tok = _HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.chat_template, self._template_source = template_of(model_dir, self.config, chat_template)
        self.add_bos = bool(self.config.get("add_bos_token", False))
        bos = self.config.get("bos_token")
        self.bos_id = self._tok.token_to_id(bos) if bos else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """`text`'s ids, after the BOS token where the tokenizer's config asks for one (`add_bos_token`) and
        `add_bos`: a chat template writes its own (`bos_token`), so a chat is encoded without."""
        if len(text) > _GIL_FREE_CHARS:
            ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @cached_property
    def max_token_chars(self) -> int:
        """No token stands for more characters of the input than this. A vocabulary entry is at least as long as
        the text it covers; a normalizer may shrink the input first (Unicode composition), hence the slack then."""
        longest = max(len(t) for t in self._tok.get_vocab(with_added_tokens=True))
        return longest if self._tok.normalizer is None else 4 * longest

    @cached_property
    def _template(self) -> jinja2.Template:
        return compile_template(self.chat_template, self._template_source)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra: object) -> str:
        """The chat template's text for `messages`. Raises `ChatTemplateRaised` when the template refuses the
        messages, `ChatTemplateError` when the template itself is at fault (unsafe, broken), ValueError when
        the model has none."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use the completions API")
        try:
            return self._template.render(
                **extra,  # `chat_template_kwargs` (enable_thinking, ...): the names below are refused before
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.config.get("bos_token") or "",
                eos_token=self.config.get("eos_token") or "",
            )
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(
                f"the model's chat template ({self._template_source}) tried an operation the sandbox forbids: {e}"
            ) from None
        except ChatTemplateRaised:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateRaised(f"{type(e).__name__}: {e}") from None

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **extra: object
    ) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, **extra), add_bos=False)


def compile_template(text: str, source: str) -> jinja2.Template:
    """`text` compiled in the sandbox with transformers' helpers; `ChatTemplateError` naming `source` if it does not
    parse."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(text)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template ({source}) does not parse: {e}") from e


def template_of(model_dir: Path, config: dict, given: str | None) -> tuple[str | None, str]:
    """The chat template and where it comes from: `given` (a file's path, or the template's text), else
    tokenizer_config.json's `chat_template` (a string, or named templates of which "default"), else the
    chat_template.jinja file recent transformers write beside it."""
    if given is not None:
        if "{{" in given or "{%" in given:  # a template's text (a long one is no path the OS would take)
            return given, "--chat-template (inline)"
        path = Path(given).expanduser()
        if path.is_file():
            return path.read_text(), f"--chat-template {path}"
        raise ValueError(f"--chat-template {given!r} is neither a file nor a template (no {{{{ or {{% in it)")
    named = config.get("chat_template")
    if isinstance(named, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        by_name = {t.get("name"): t.get("template") for t in named if isinstance(t, dict)}
        named = by_name.get("default") or next(iter(by_name.values()), None)
    if named:
        return named, f"chat_template in {model_dir / 'tokenizer_config.json'}"
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(), str(jinja)
    return None, "no chat template"


def _raise_exception(message: str) -> None:
    raise ChatTemplateRaised(message)


def _tojson(
    value: object, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    # As transformers: non-ASCII stays as it is (jinja2's own tojson escapes it, and HTML-escapes too).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's `namespace()`, refusing underscore names: a template could otherwise store into dunders."""

    def __init__(*args: object, **kwargs: object) -> None:  # jinja2's signature trick: `namespace(self=...)` works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: object) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")
