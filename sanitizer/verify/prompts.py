"""The load's prompts: the classes shipped with hazsan (package data, nothing downloaded) or the
user's own file.

`code` (the default): code completion and tool-call-like prompts, each setting up a pattern the
answer repeats (fields, test functions, one JSON tool call per item). Speculative decoding's
drafts are accepted most on such text (n-gram and draft models alike), so a healthy server's
accept length stays well above the signature's 2.0 and a collapse is the server, not the content.
`prose`: reasoning-heavy prose, which accepts about 2 to 3 tokens a step whatever the window:
shown beside the code class to say how much acceptance depends on content, never judged.

A prompt file (`--prompts FILE`) is JSON Lines, one object a line: {"text": "..."} or
{"input_ids": [1, 2, ...]} (token ids, for a model served without a tokenizer).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

CLASSES = ("code", "prose")
MAX_PROMPTS = 10_000
MAX_FILE_BYTES = 64 << 20


class PromptError(Exception):
    """A prompt file that cannot be used; names the file and line."""


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str | None = None
    input_ids: tuple[int, ...] | None = None

    def describe(self) -> str:
        return f"{len(self.input_ids)} token ids" if self.input_ids is not None else f"{len(self.text)} chars"


def builtin(name: str) -> list[Prompt]:
    """The shipped class `name` ("code" or "prose")."""
    if name not in CLASSES:
        raise PromptError(f"no prompt class {name!r} (known: {', '.join(CLASSES)})")
    text = resources.files("sanitizer.verify").joinpath("prompts", f"{name}.jsonl").read_text(encoding="utf-8")
    return parse(text, f"<{name} prompts>")


def load(path: str) -> list[Prompt]:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise PromptError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise PromptError(f"{path}: over {MAX_FILE_BYTES >> 20} MiB: not a prompt file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return parse(text, path)


def parse(text: str, name: str) -> list[Prompt]:
    out: list[Prompt] = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name}:{line_no}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise PromptError(f"{where}: not JSON ({exc})") from None
        if not isinstance(obj, dict) or ("text" in obj) == ("input_ids" in obj):
            raise PromptError(f'{where}: expected an object with "text" or "input_ids" (one of them)')
        if "text" in obj:
            if not isinstance(obj["text"], str) or not obj["text"].strip():
                raise PromptError(f'{where}: "text" must be a non-empty string')
            out.append(Prompt(text=obj["text"]))
        else:
            ids = obj["input_ids"]
            if (not isinstance(ids, list) or not ids
                    or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
                raise PromptError(f'{where}: "input_ids" must be a non-empty list of token ids (integers >= 0)')
            out.append(Prompt(input_ids=tuple(ids)))
        if len(out) > MAX_PROMPTS:
            raise PromptError(f"{name}: more than {MAX_PROMPTS} prompts")
    if not out:
        raise PromptError(f"{name}: no prompt in it")
    return out
