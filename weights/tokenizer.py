"""A checkpoint directory's tokenizer without transformers: the `tokenizers` library for text
and token ids, jinja2 for the chat template, rendered as transformers renders it.

transformers takes longer to import than the embedded model takes to load, and the engine needs
only this much of it. tests/test_model.py checks that both give the same ids for the same
conversations. Checkpoints the engine did not convert itself keep transformers' AutoTokenizer.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import NamedTuple


class Encoded(NamedTuple):
    input_ids: list[int]


class Tokenizer:
    """What the engine and the server use of a transformers tokenizer, with the same names."""

    def __init__(self, backend, config: dict, chat_template: str | None):
        self.backend_tokenizer = backend  # a tokenizers.Tokenizer
        self.chat_template = chat_template
        # the special tokens a template may name ({{ bos_token }}), as transformers passes them
        self.special = {k: v for k, v in config.items()
                        if k.endswith("_token") and isinstance(v, str)}
        eos = self.special.get("eos_token")
        self.eos_token_id = backend.token_to_id(eos) if eos is not None else None

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        """tokenizer.json, tokenizer_config.json and chat_template.jinja (if any) of path."""
        from tokenizers import Tokenizer as Backend
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            config = json.load(f)
        template = config.get("chat_template")
        jinja = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja) as f:
                template = f.read()
        return cls(Backend.from_file(os.path.join(path, "tokenizer.json")), config, template)

    def __call__(self, text: str) -> Encoded:
        return Encoded(self.backend_tokenizer.encode(text).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = False):
        """The conversation rendered by the chat template: token ids (the template's own special
        tokens, none added), or the text with tokenize=False. return_dict=True is not offered."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if return_dict:
            raise ValueError("return_dict=True is not supported; the ids are returned")
        text = compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special)
        if not tokenize:
            return text
        return self.backend_tokenizer.encode(text, add_special_tokens=False).ids


@lru_cache
def compile_template(source: str):
    """The template in the sandbox transformers uses, with the names it gives templates:
    raise_exception, strftime_now, and a tojson that does not escape HTML."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
