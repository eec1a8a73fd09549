"""`LLM.chat`'s inputs: the conversations and the template's arguments checked, each
conversation rendered through the chat template and tokenized. A bad argument is one line
naming it; what the user's template raises is the user's error, one line too."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from offload.config.validate import flag
from offload.errors import ConfigError, shown
from offload.llm.checks import check_text

# apply_chat_template's own arguments and the variables it gives the template: set
# through chat_template_kwargs they would clash with chat()'s (Python's TypeError).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def chat_token_ids(
    tokenizer: Any,
    messages: object,
    *,
    chat_template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[dict[str, Any]] | None,
    chat_template_kwargs: dict[str, Any] | None,
) -> tuple[list[str], list[list[int]]]:
    """The conversation(s) in `messages` as texts through the chat template, and their
    token ids (the template adds the special tokens)."""
    conversations = conversations_of(messages)
    check_chat_args(
        chat_template, add_generation_prompt, continue_final_message, tools, chat_template_kwargs
    )
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "this model's tokenizer has no chat template; pass chat_template= or use "
            "generate() with a plain prompt"
        )
    if add_generation_prompt and continue_final_message:
        raise ConfigError(
            "continue_final_message=True needs add_generation_prompt=False: the reply "
            "either continues the last message or starts a new one"
        )
    texts = render_chat(
        tokenizer,
        conversations,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
        **(chat_template_kwargs or {}),
    )
    for index, text in enumerate(texts):
        check_text(text, f"conversation {index}")
    return texts, [tokenizer(text, add_special_tokens=False).input_ids for text in texts]


def conversations_of(messages: object) -> list[list[Mapping[str, Any]]]:
    """One conversation (a list of messages) or a list of them, each checked: a message
    is a dict with a string 'role' and a 'content' (a string or a list of parts)."""
    if isinstance(messages, str | bytes | bytearray | Mapping) or not isinstance(
        messages, Sequence
    ):
        raise ConfigError(
            "messages must be a conversation (a list of {'role': str, 'content': str} "
            f"dicts) or a list of conversations, got {shown(messages)}"
        )
    if not messages:  # no conversations, as vLLM (and generate([])) answer []
        return []
    if isinstance(messages[0], Mapping):
        _check_conversation("messages", messages)
        return [list(messages)]
    for index, conversation in enumerate(messages):
        _check_conversation(f"messages[{index}]", conversation)
    return [list(conversation) for conversation in messages]


def _check_conversation(where: str, conversation: object) -> None:
    if isinstance(conversation, str | bytes | bytearray | Mapping) or not isinstance(
        conversation, Sequence
    ):
        raise ConfigError(
            f"{where} must be a list of {{'role', 'content'}} dicts, got {shown(conversation)}"
        )
    if not conversation:
        raise ConfigError(f"{where} is an empty conversation; it needs at least one message")
    for number, message in enumerate(conversation):
        _check_message(f"{where}[{number}]", message)


def _check_message(where: str, message: object) -> None:
    if not isinstance(message, Mapping):
        raise ConfigError(f"{where} must be a dict with 'role' and 'content', got {shown(message)}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ConfigError(f"{where}['role'] must be a string such as 'user', got {shown(role)}")
    content = message.get("content")
    # A message that calls tools may have no text (OpenAI's format).
    if content is None and message.get("tool_calls"):
        return
    parts_ok = isinstance(content, list) and all(isinstance(p, Mapping) for p in content)
    if not isinstance(content, str) and not parts_ok:
        raise ConfigError(
            f"{where}['content'] must be a string or a list of content parts (dicts), "
            f"got {shown(content)}"
        )


def check_chat_args(
    chat_template: object,
    add_generation_prompt: object,
    continue_final_message: object,
    tools: object,
    chat_template_kwargs: object,
) -> None:
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template):
        raise ConfigError(
            f"chat_template must be a Jinja template string, got {shown(chat_template)}"
        )
    flag("add_generation_prompt", add_generation_prompt)
    flag("continue_final_message", continue_final_message)
    if tools is not None and (
        isinstance(tools, str | bytes | Mapping)
        or not isinstance(tools, Sequence)
        or not all(isinstance(tool, Mapping) or callable(tool) for tool in tools)
    ):
        raise ConfigError(
            f"tools must be a list of tool definitions (dicts or functions), got {shown(tools)}"
        )
    if chat_template_kwargs is None:
        return
    if not isinstance(chat_template_kwargs, Mapping) or not all(
        isinstance(key, str) for key in chat_template_kwargs
    ):
        raise ConfigError(
            "chat_template_kwargs must be a dict of template variables by name, "
            f"got {shown(chat_template_kwargs)}"
        )
    clash = sorted(RESERVED_TEMPLATE_KWARGS.intersection(chat_template_kwargs))
    if clash:
        raise ConfigError(
            f"chat_template_kwargs may not set {clash[0]!r}: chat() sets it itself "
            "(pass it as chat()'s own argument where there is one)"
        )


def render_chat(tokenizer, conversations: list[list[Mapping[str, Any]]], **options) -> list[str]:
    """Each conversation through the chat template (`options`: apply_chat_template's).
    The template is the user's code: what it raises is the user's error, one line with
    the template's own first line of reason."""
    from jinja2 import TemplateError

    texts = []
    for index, conversation in enumerate(conversations):
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False, **options)
        # A template does arithmetic, indexing and string work on what it is given:
        # these are what that raises (jinja2's own errors, and Python's from inside it).
        except (
            TemplateError,
            TypeError,
            ValueError,
            ArithmeticError,
            LookupError,
            AttributeError,
        ) as error:
            raise ConfigError(
                f"the chat template failed on conversation {index}: {_reason(error)}"
            ) from None
        texts.append(text)
    return texts


def _reason(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0] if lines else 'no message'}"
    line = getattr(error, "lineno", None)
    return f"{reason} (template line {line})" if line else reason
