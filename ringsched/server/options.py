"""The HTTP server's flags as one frozen dataclass: `launch` builds its parser from these fields, as it does
the engine's from `EngineConfig`; `__post_init__` refuses a bad value with a message naming the flag."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ringsched.config import ConfigError, _flag
from ringsched.server.http_limits import HttpLimits
from ringsched.server.serving import DEFAULT_MAX_REQUEST_BYTES

_S, _C, _G = "server", "connections", "structured outputs"


@dataclass(frozen=True)
class ServerOptions:
    host: str = _flag("127.0.0.1", "address to listen on; 0.0.0.0 serves other machines too", group=_S)
    port: int | None = _flag(None, "HTTP port (default: 30000; a node other than 0 serves /health on 30000 + node "
                             "rank)", type=int, group=_S)  # fmt: skip
    api_key: str | None = _flag(None, "when set, every path but /health needs this bearer key (default: none, no "
                                "key)", type=str, group=_S)  # fmt: skip
    served_model_name: str | None = _flag(
        None, "the model name requests must use (default: smollm2-135m-instruct for the default model, else the "
        "model directory's name)", type=str, group=_S)  # fmt: skip
    max_queued_requests: int | None = _flag(
        None, "requests that may wait beyond --max-running-requests; more get 503 with Retry-After (default: no "
        "limit)", type=int, group=_S)  # fmt: skip
    max_request_bytes: int = _flag(DEFAULT_MAX_REQUEST_BYTES, "largest request body accepted; larger ones get 413; "
                                   "raise it for very long prompts", group=_S)  # fmt: skip
    max_request_tokens: int | None = _flag(
        None, "the work one request may start: its sequences (n, best_of) times prompt plus max_tokens; more get "
        "400 (default: 4 x the context length)", type=int, group=_S)  # fmt: skip
    shutdown_timeout: float = _flag(30.0, "seconds running requests get to finish after SIGTERM or Ctrl-C",
                                    group=_S)  # fmt: skip
    chat_template: str | None = _flag(
        None,
        "the chat template for chat requests and /tokenize: a file, or the template itself (default: the "
        "model's, from tokenizer_config.json or chat_template.jinja)",
        type=str,
        group=_S,
    )
    reasoning_parser: str | None = _flag(
        None,
        "split a thinking model's reasoning from its answer in chat responses (reasoning_content): "
        "deepseek_r1 (reasoning until </think>) or qwen3 (a leading <think> block) (default: none, all content)",
        type=str,
        choices=["deepseek_r1", "qwen3"],
        group=_S,
    )
    generation_config: str = _flag(
        "auto",
        "auto: the model's generation_config.json gives temperature, top_p, top_k, min_p and "
        "repetition_penalty where a request gives none (as vLLM); vllm: the API's own defaults",
        choices=["auto", "vllm"],
        group=_S,
    )
    enable_auto_tool_choice: bool = _flag(
        False,
        "tool_choice auto (the default when a request has tools): the answer's tool calls found by --tool-call-parser",
        group=_S,
    )
    tool_call_parser: str | None = _flag(
        None,
        "how tool calls are written by the model: hermes (Qwen2.5/3, Hermes), llama3_json (Llama 3.x), "
        "mistral, pythonic (default: none; tool_choice auto refused)",
        type=str,
        choices=["hermes", "llama3_json", "mistral", "pythonic"],
        group=_S,
    )
    log_level: str = _flag("info", "warning silences the startup and throughput lines; debug adds the access log",
                           choices=["debug", "info", "warning", "error"], group=_S)  # fmt: skip
    http_header_timeout: float = _flag(10.0, "seconds a client has to send a request's headers; then 408 and "
                                       "the connection is closed", group=_C)  # fmt: skip
    http_body_timeout: float = _flag(60.0, "seconds a client has to send a request's body; then 408; raise it "
                                     "for huge prompts over slow links", group=_C)  # fmt: skip
    http_keep_alive_timeout: float = _flag(5.0, "seconds an idle keep-alive connection stays open", group=_C)
    max_connections: int = _flag(1024, "open connections at once; more get 503 and are closed (keep it below "
                                 "the open-file limit, ulimit -n)", group=_C)  # fmt: skip
    grammar_workers: int = _flag(2, "helper processes that prove structured-output grammars before a request is "
                                 "accepted (a grammar that crashes one costs only its request)", group=_G)  # fmt: skip
    grammar_timeout: float = _flag(5.0, "seconds a grammar may take to compile in a helper; slower ones get 400",
                                   group=_G)  # fmt: skip
    grammar_memory_mb: int = _flag(1024, "address space of each grammar helper, in MiB; grammars needing more get "
                                   "400", group=_G)  # fmt: skip

    def __post_init__(self) -> None:
        _need(self.port is None or 0 <= self.port <= 65535, f"--port {self.port} is not a port number (0-65535)")
        _need(
            self.max_queued_requests is None or self.max_queued_requests >= 0,
            f"--max-queued-requests must be >= 0 (or left out for no limit), got {self.max_queued_requests}",
        )
        _need(
            self.max_request_bytes >= 1024,
            f"--max-request-bytes must be at least 1024 (bytes), got {self.max_request_bytes}",
        )
        _need(
            self.max_request_tokens is None or self.max_request_tokens >= 1,
            f"--max-request-tokens must be >= 1 (or left out for 4 x the context), got {self.max_request_tokens}",
        )
        _need(self.shutdown_timeout >= 0, f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        for name in ("http_header_timeout", "http_body_timeout", "http_keep_alive_timeout", "grammar_timeout"):
            value = getattr(self, name)
            _need(value > 0, f"--{name.replace('_', '-')} must be > 0 seconds, got {value}")
        _need(self.max_connections >= 1, f"--max-connections must be >= 1, got {self.max_connections}")
        _need(self.grammar_workers >= 0, f"--grammar-workers must be >= 0 (0: no structured outputs), got "
              f"{self.grammar_workers}")  # fmt: skip
        _check_template(self.chat_template)
        _need(
            not self.enable_auto_tool_choice or self.tool_call_parser is not None,
            "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, mistral or pythonic)",
        )
        _need(self.grammar_memory_mb >= 256, f"--grammar-memory-mb must be at least 256, got {self.grammar_memory_mb}")

    @property
    def http(self) -> HttpLimits:
        return HttpLimits(self.http_header_timeout, self.http_body_timeout, self.http_keep_alive_timeout,
                          self.max_connections)  # fmt: skip


SERVER_FLAGS = tuple(f.name for f in fields(ServerOptions))


def _check_template(given: str | None) -> None:
    """--chat-template: a readable file or a template's text, and one that parses."""
    if given is None:
        return
    from pathlib import Path

    from ringsched.tokenizer import ChatTemplateError, compile_template, template_of

    try:
        compile_template(*template_of(Path("."), {}, given))
    except (ValueError, OSError, ChatTemplateError) as e:
        raise ConfigError(str(e)) from None


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
