"""A generate bundle's tokenizer and chat template: prompts to token ids (a plain completion prompt,
or messages rendered by the chat template in its sandbox) and token ids back to text."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer

from batchinf.runtime.template_sandbox import ThreadSandboxes, chat_results


class Prompts:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.tokenizer = Tokenizer.from_file(str(self.root / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        cfg = json.loads((self.root / "tokenizer_config.json").read_text()) \
            if (self.root / "tokenizer_config.json").is_file() else {}
        self._sandboxes = ThreadSandboxes(cfg)     # the chat template's, one per rendering thread

    template_sandbox = property(lambda self: self._sandboxes.get(), doc="this thread's chat-template sandbox")

    def encode_prompt(self, prompt: str) -> list[int]:
        """A plain completion prompt, with the special tokens the tokenizer adds (e.g. Llama's BOS)."""
        return self.tokenizer.encode(prompt, add_special_tokens=True).ids

    def render_batches(self, batches: Iterable[list[list[dict]]]) -> Iterator[list[str | Exception]]:
        """Each batch of conversations rendered with the chat template (add_generation_prompt) by its
        sandbox process, or each one's error (template_sandbox.chat_results: the next batch is
        rendered while the caller works on this one's)."""
        return chat_results(self.template_sandbox, batches, self.root / "tokenizer_config.json")

    def render_chats(self, conversations: list[list[dict]]) -> list[str | Exception]:
        return next(self.render_batches([conversations]))

    def render_chat(self, messages: list[dict]) -> str:
        (result,) = self.render_chats([messages])
        if isinstance(result, Exception):
            raise result
        return result

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Messages rendered with the chat template (add_generation_prompt) and tokenized the way
        transformers' apply_chat_template does: the template writes the special tokens itself."""
        return self.encode_rendered(self.render_chat(messages))

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered chat (render_chats) tokenized as encode_chat does."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    encode_fixture = encode_prompt

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def close(self) -> None:
        """Stop the chat template's sandbox processes (a later render starts one again)."""
        self._sandboxes.close()
