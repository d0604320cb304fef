"""ringsched's tokenizer (built from the GGUF by our converter) against transformers' tokenizer from the same GGUF."""

import random
from collections.abc import Mapping

import pytest

from ringsched.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # real model or several processes: the full suite's

transformers = pytest.importorskip("transformers")

CORPUS = {
    # unicode
    "accents": "Héllo wörld! Ça va? Señor Müller aß crème brûlée à l'hôtel, naïve façade, Øresund, Łódź.",
    "cjk": "日本語のテキストです。中文测试：你好，世界！한국어 문장도 있습니다.",
    "arabic": "مرحبا بالعالم، هذا نص عربي. שלום עולם",
    "combining": "e\u0301 a\u0308 n\u0303 Z\u0351\u0364\u0307a\u036b\u0344l\u0352go \u1e9b\u0323 \u0915\u094d\u0937",
    "greek_cyrillic": "Γειά σου κόσμε — Привет, мир! Ελληνικά ΑΒΓ",
    "zero_width_controls": "a\u200bb\u200cc\u200dd\ufeffe\u00a0f\u2028g\x00h\x07i\x7f",
    # code
    "python": 'def fib(n: int) -> int:\n\t"""Tabs, not spaces."""\n\tif n < 2:\n\t\treturn n\n'
    "\treturn fib(n - 1) + fib(n - 2)\n\n\nprint([fib(i) for i in range(10)])  # done\n",
    "json": '{\n  "name": "ringsched",\n  "layers": [0, 1, 2],\n  "nested": {"a": null, "b": true, "c": 1.5e-3},\n'
    '  "escaped": "line\\nbreak \\u00e9 \\"quoted\\""\n}',
    "c": '#include <stdio.h>\n\nint main(void) {\n\tfor (int i = 0; i < 10; ++i) {\n\t\tprintf("%d\\n", i);\n'
    "\t}\n\treturn 0;\n}\n",
    # whitespace runs
    "spaces": "a  b   c    d     e      f",
    "newlines": "one\n\ntwo\n\n\n\nthree\n",
    "crlf": "windows\r\nline\r\nendings\r\n\r\n",
    "trailing": "trailing spaces   ",
    "leading": "   leading spaces",
    "only_whitespace": " \t \n \r\n  \t\t   ",
    "mixed_ws": "tab\tthen  spaces\t\t and \n \n mixed \u3000ideographic\u2003em",
    # emoji
    "emoji": "I ❤️ Python 🐍🚀 😀😃😄 👍🏽",
    "zwj": "👨\u200d👩\u200d👧\u200d👦 family, 🏳️\u200d🌈 flag, 👩🏽\u200d💻 coder",
    "flags": "🇫🇷🇯🇵🇺🇸🇧🇷 🏴\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f",
    # numbers
    "numbers": "3.14159 2.71828 1,000,000 1e-9 -42 0x1F 2024-01-31 12:30:45 $19.99 100% 007 1234567890",
    # special-token strings in plain text
    "special_tokens": "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "special_inline": "text <|im_start|> and <|endoftext|>and<|im_end|>more",
    "special_partial": "<|im_start <|im_end| |im_start|> <|IM_START|> < |im_start|>",
    # punctuation that tokenization "clean-up" would alter
    "cleanup_bait": "Hello , world . Don 't do n't , it 's fine ! ? ( x )",
    "contractions": "I'm you're he'll we've they'd isn't CAN'T",
    "single_char": "x",
    "single_space": " ",
    "empty": "",
}


def _random_texts(n, seed=1234):
    """Seeded random strings mixing scripts, emoji, digits, punctuation and whitespace."""
    rng = random.Random(seed)
    ranges = [
        (0x20, 0x7E),
        (0xA0, 0x17F),
        (0x300, 0x36F),
        (0x391, 0x3C9),
        (0x410, 0x44F),
        (0x5D0, 0x5EA),
        (0x621, 0x64A),
        (0x900, 0x97F),
        (0x3040, 0x30FF),
        (0x4E00, 0x4FFF),
        (0xAC00, 0xAD00),
        (0x1F300, 0x1F64F),
        (0x1F1E6, 0x1F1FF),
    ]
    ws = [" ", "  ", "\n", "\t", "\r\n", "   ", "\u200d"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 40)):
            if rng.random() < 0.2:
                parts.append(rng.choice(ws))
            else:
                lo, hi = rng.choice(ranges)
                parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 6))))
        out.append("".join(parts))
    return out


TEXTS = list(CORPUS.items()) + [(f"random{i}", t) for i, t in enumerate(_random_texts(40))]
TEXTS.append(("whole_corpus", "\n".join(CORPUS.values())))

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "What is the capital of France?"}],
    "with_system": [
        {"role": "system", "content": "You are a terse assistant. Answer in one word."},
        {"role": "user", "content": "Largest planet?"},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write  code:\n\tdef f(x):\n\t\treturn x  "},
    ],
    "system_multi_turn_unicode": [
        {"role": "system", "content": "Réponds en français 🇫🇷."},
        {"role": "user", "content": "日本語は話せますか？"},
        {"role": "assistant", "content": "Oui, un peu. 👍"},
        {"role": "user", "content": "<|im_start|> is just text here"},
    ],
}


@pytest.fixture(scope="module")
def ours(smollm2_dir):
    return Tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def hf(smollm2_gguf):
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


def _ids(out):
    """`apply_chat_template(tokenize=True)` gives a list, or a BatchEncoding in some transformers versions."""
    if isinstance(out, Mapping):
        out = out["input_ids"]
    return list(out)


@pytest.mark.parametrize("text", [t for _, t in TEXTS], ids=[k for k, _ in TEXTS])
def test_ids_match_transformers(ours, hf, text):
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ids == hf.encode(text)  # transformers' default adds no BOS for this GGUF either
    assert (ids == []) == (text == "")


@pytest.mark.parametrize("text", [t for _, t in TEXTS], ids=[k for k, _ in TEXTS])
def test_decode_round_trips(ours, hf, text):
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert hf.decode(ids, skip_special_tokens=False) == text


def test_special_token_strings_become_single_tokens(ours, hf):
    start, end = ours.token_to_id("<|im_start|>"), ours.token_to_id("<|im_end|>")
    assert start is not None and end is not None
    assert (start, end) == (hf.convert_tokens_to_ids("<|im_start|>"), hf.convert_tokens_to_ids("<|im_end|>"))
    ids = ours.encode("a<|im_start|>b<|im_end|>")
    assert ids.count(start) == 1 and ids.count(end) == 1
    # The default decode drops them, as the server does for generated text.
    assert ours.decode(ids) == "ab"


@pytest.mark.parametrize("messages", list(CONVERSATIONS.values()), ids=list(CONVERSATIONS))
def test_chat_template_matches_transformers(ours, hf, messages):
    expected = _ids(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))
    assert ours.apply_chat_template(messages) == expected
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages) == text
    assert text.endswith("<|im_start|>assistant\n")
    if messages[0]["role"] != "system":
        assert "You are a helpful AI assistant named SmolLM" in text  # the template's default system prompt


def test_chat_template_without_generation_prompt(ours, hf):
    messages = CONVERSATIONS["multi_turn"]
    expected = _ids(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=False, return_dict=False))
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == expected


def test_a_chat_whose_template_writes_bos_gets_one_bos(tmp_path):
    """With `add_bos_token` (SentencePiece GGUF files, Llama, Gemma) a completion prompt starts with BOS once, and a
    chat whose template writes `{{ bos_token }}` too (not twice, as transformers' `apply_chat_template` gives)."""
    from ringsched.models.random_model import byte_tokenizer
    from ringsched.weights.tokenizer_build import write_tokenizer_files

    tok, tokens = byte_tokenizer(300)
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    write_tokenizer_files(tmp_path, tok, tokens, 1, 2, 0, None, template, 64, add_bos=True)
    t = Tokenizer(tmp_path)
    assert t.encode("hi")[0] == 1 and t.encode("hi")[1] != 1
    chat = t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat[0] == 1 and chat[1] != 1 and t.decode(chat) == "hi"
