"""/tokenize, /detokenize and /tokenizer_info (vLLM's routes): the served model's tokenizer, as
generation uses it; with the three, a client needs no local copy of the tokenizer (lm-evaluation-harness's
`tokenizer_backend=remote`).

A chat request is rendered by the same code as /v1/chat/completions (`plan_chat`), so the ids are
the ones a chat completion with these messages would be given."""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from radixserve.server import protocol as p
from radixserve.server.chat_plan import plan_chat
from radixserve.server.errors import refused
from radixserve.serving_tokenizer import off_the_loop
from radixserve.validation import InvalidRequest, check_token_ids


async def tokenize(serving: Any, req: p.TokenizeRequest) -> dict[str, Any]:
    serving.check_ready(req.model)
    tm = serving.tm
    if req.prompt is not None:
        ids = list(await off_the_loop(len(req.prompt), tm.tokenizer.encode, req.prompt,
                                      add_special_tokens=req.add_special_tokens is not False))
    else:
        try:  # the chat route's own checks of the messages (a tool message without its call, ...): its 400s
            chat = p.ChatCompletionRequest(model=tm.model_name, messages=req.messages, tools=req.tools,
                                           tool_choice=req.tool_choice, add_generation_prompt=req.add_generation_prompt,
                                           chat_template_kwargs=req.chat_template_kwargs)
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False),
                                         body=req.model_dump(mode="json", exclude_none=True)) from None
        ids = (await off_the_loop(chat.text_chars(), plan_chat, tm, chat, serving.parsers)).ids
    return {"count": len(ids), "max_model_len": int(tm.context_len), "tokens": ids,
            "token_strs": [serving.token_info(t)[0] for t in ids] if req.return_token_strs else None}


def detokenize(serving: Any, req: p.DetokenizeRequest) -> dict[str, Any]:
    serving.check_ready(req.model)
    try:
        check_token_ids(req.tokens, serving.tm.limits, "tokens")
    except InvalidRequest as e:
        raise refused(e) from None
    return {"prompt": serving.tm.tokenizer.decode(req.tokens)}


def tokenizer_info(serving: Any) -> dict[str, Any]:
    """The tokenizer's special tokens (as text), chat template and class, as vLLM's /tokenizer_info
    gives them (the fields a remote-tokenizer client reads)."""
    serving.check_ready(None)
    tok = serving.tm.tokenizer
    specials = dict(getattr(tok, "special_tokens_map", None) or {})
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one (tools get their own through chat)
        template = template.get("default")
    return {"tokenizer_class": getattr(tok, "tokenizer_class", None), "model_max_length": int(serving.tm.context_len),
            "chat_template": template,
            **{name: specials.get(name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}}
