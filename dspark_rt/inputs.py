"""Prompts and conversations as the Decoder takes them: a str, token ids, or vLLM's dict prompts
({"prompt": str} or {"prompt_token_ids": [...]}), one or a list; chat messages. The prompts
themselves (vocabulary, length) are checked per request by the engine's Processor."""
import numbers

PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _is_ids(p) -> bool:
    return isinstance(p, (list, tuple)) and bool(p) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in p)


def prompt_list(prompts) -> list:
    """One prompt or a list of them, as a list of str / token-id lists; anything else is a
    TypeError naming the argument, a bad dict prompt a ValueError naming request i and the key."""
    if isinstance(prompts, (str, dict)) or _is_ids(prompts):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str, a list of token ids, a dict prompt "
                        f"({{'prompt': ...}} or {{'prompt_token_ids': ...}}), or a list of those, "
                        f"got {type(prompts).__name__}")
    return [unwrap(i, p) for i, p in enumerate(prompts)]


def unwrap(i: int, prompt):
    """vLLM's TextPrompt / TokensPrompt as the str or token ids inside; other prompts as they are."""
    if not isinstance(prompt, dict):
        return prompt
    given = [k for k in PROMPT_KEYS if k in prompt]
    other = sorted(set(prompt) - set(PROMPT_KEYS), key=str)
    if other:
        raise ValueError(f"request {i}: dict prompt key {other[0]!r} is not served (only "
                         f"'prompt' or 'prompt_token_ids')")
    if len(given) != 1:
        raise ValueError(f"request {i}: a dict prompt needs exactly one of 'prompt' (a str) or "
                         f"'prompt_token_ids' (a list of ints), got keys {sorted(prompt, key=str)}")
    value = prompt[given[0]]
    if given[0] == "prompt" and not isinstance(value, str):
        raise ValueError(f"request {i}: 'prompt' must be a str, got {type(value).__name__}")
    if given[0] == "prompt_token_ids" and not isinstance(value, (list, tuple)):
        raise ValueError(f"request {i}: 'prompt_token_ids' must be a list of ints, got "
                         f"{type(value).__name__}")
    return value


def conversations(messages) -> list:
    """One conversation (a list of message dicts) or a list of conversations, each checked."""
    if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
        convs = [messages]
    elif isinstance(messages, (list, tuple)) and messages:
        convs = list(messages)
    else:
        raise ValueError("chat: messages must be a non-empty list of {'role', 'content'} dicts, "
                         f"or a list of such lists; got {messages!r:.80}")
    for i, conv in enumerate(convs):
        if not isinstance(conv, (list, tuple)) or not conv:
            raise ValueError(f"chat: messages[{i}] must be a non-empty list of message dicts, "
                             f"got {conv!r:.80}")
        for j, m in enumerate(conv):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), (str, type(None), list)):
                raise ValueError(f"chat: messages: conversation {i}, message {j} must be a dict "
                                 f"with a str 'role' and a str 'content', got {m!r:.80}")
    return convs


# set by the chat template's caller, never by chat_template_kwargs
TEMPLATE_ARGUMENTS = ("messages", "add_generation_prompt", "tokenize", "bos_token", "eos_token",
                      "pad_token")


def template_kwargs(kwargs) -> dict:
    """chat_template_kwargs checked: template variables by str name (enable_thinking, ...)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"chat_template_kwargs must be a dict of template variables by name, "
                         f"got {kwargs!r:.80}")
    taken = [k for k in TEMPLATE_ARGUMENTS if k in kwargs]
    if taken:
        raise ValueError(f"chat_template_kwargs: {taken[0]!r} is set by chat() itself, not a "
                         "template variable")
    return dict(kwargs)
