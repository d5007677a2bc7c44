"""Each served model's chat format, so that a chat answer's tool calls and reasoning are read in the format of the
model that wrote it (several models behind one router).

The local model's format (services.http.openai.answer.ChatFormat) comes from its own folder and flags. Another
model's comes from its tokenizers' heartbeats (Heartbeat.chat_format: its templates and parser flags, exactly what
that tokenizer renders prompts with), built once per announcement. A model whose tokenizers announce none (an older
tokenizer) is read in the local model's format, as before the announcement existed.
"""

from __future__ import annotations

from libs.protocol.messages import ChatFormatNote
from libs.runtime.settings import Settings
from services.http import models
from services.http.openai.answer import ChatFormat


class ChatFormats:
    def __init__(self, settings: Settings) -> None:
        self.local = ChatFormat.served(settings)
        self._announced: dict[str, tuple[ChatFormatNote, ChatFormat]] = {}  # model → its note and format

    def of(self, model: str) -> ChatFormat:
        """The format of the served model a request is for ("": the default, the local model)."""
        fleet = models.FLEET
        if not model or model == fleet.default:
            return self.local
        note = fleet.chat_format(model)
        if note is None:
            return self.local
        known = self._announced.get(model)
        if known is None or known[0] != note:  # first heard, or its tokenizers now render another template
            known = (note, ChatFormat.announced(note))
            self._announced[model] = known
        return known[1]
