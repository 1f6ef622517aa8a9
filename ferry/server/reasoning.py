"""A chat answer's reasoning apart from its answer, as llama-server's `--reasoning-format auto` returns them: the
thinking in `reasoning_content`, the rest in `content`, streamed or whole. Two formats, told apart by the chat
template: <think> ... </think> (Qwen3, DeepSeek-R1, GLM-4.5; a template may open the tag in the prompt itself), and
gpt-oss's harmony channels (`<|channel|>analysis<|message|>` reasoning `<|end|>`, then `<|start|>assistant
<|channel|>final<|message|>` the answer). Text that may be the start of a marker is held back until the next piece
tells; `finish` gives out what is left, so that nothing generated is lost."""

from __future__ import annotations

FORMATS = ("auto", "deepseek", "none")  # --reasoning-format, a request's reasoning_format (deepseek: as auto)
_OPEN, _CLOSE = "<think>", "</think>"
_MESSAGE, _CHANNEL = "<|message|>", "<|channel|>"
_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")  # a harmony message ends at these (<|start|>: a new one)


def kind_of(template: str) -> str | None:
    """The reasoning format a chat template's answers come in: "harmony", "think", or None (none to split)."""
    if _CHANNEL in template and _MESSAGE in template:
        return "harmony"
    return "think" if _CLOSE in template else None


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may begin one of the markers (to hold back)."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class Splitter:
    """Fed an answer's text piece by piece (push), returns (reasoning, content) to send now. kind: kind_of's;
    prompt: the rendered prompt (a <think> it ends with opens the reasoning before the first token)."""

    def __init__(self, kind: str, prompt: str = ""):
        self.kind = kind
        self.buf = ""
        self.thinking = kind == "think" and prompt.rstrip().endswith(_OPEN)
        self.started = self.thinking  # past the answer's start (a <think> opens reasoning only there)
        self.trim = self.thinking  # whitespace to drop before the next text given out
        self.channel: str | None = None  # harmony: the message's channel; None while reading a header

    def push(self, piece: str) -> tuple[str, str]:
        self.buf += piece
        return self._think() if self.kind == "think" else self._harmony()

    def finish(self) -> tuple[str, str]:
        """What is held back, given out as what it would be were no marker to follow."""
        text, self.buf = self.buf, ""
        if self.kind == "harmony" and self.channel is None:
            return "", text  # an unfinished header: the model's text all the same
        if self.kind == "think":
            text = self._trimmed(text)
        return (text, "") if (self.thinking or self.channel == "analysis") else ("", text)

    def _think(self) -> tuple[str, str]:
        reasoning, content = [], []
        while self.buf:
            if self.thinking:
                i = self.buf.find(_CLOSE)
                n = i if i >= 0 else len(self.buf) - _held(self.buf, (_CLOSE,))
                reasoning.append(self._trimmed(self.buf[:n]))
                if i < 0:
                    self.buf = self.buf[n:]
                    break
                self.buf, self.thinking, self.trim = self.buf[i + len(_CLOSE):], False, True
                continue
            if not self.started:
                head = self.buf.lstrip()
                if head.startswith(_OPEN):
                    self.buf, self.thinking, self.started, self.trim = head[len(_OPEN):], True, True, True
                    continue
                if _OPEN.startswith(head):
                    break  # may still open
            self.started = True
            content.append(self._trimmed(self.buf))
            self.buf = ""
        return "".join(reasoning), "".join(content)

    def _trimmed(self, text: str) -> str:
        """text without the whitespace that opens the reasoning or follows </think> (as llama.cpp trims them)."""
        if self.trim:
            text = text.lstrip()
            self.trim = not text
        return text

    def _harmony(self) -> tuple[str, str]:
        reasoning, content = [], []
        while self.buf:
            if self.channel is None:  # a header, held whole: <|start|>assistant<|channel|>NAME ... <|message|>
                i = self.buf.find(_MESSAGE)
                if i < 0:
                    head = self.buf.lstrip()
                    if head and not head.startswith("<|") and not "<|".startswith(head):
                        self.channel = "final"  # text without a header: the answer
                        continue
                    break
                header, self.buf = self.buf[:i], self.buf[i + len(_MESSAGE):]
                name = (header.rpartition(_CHANNEL)[2].split() or ["final"])[0]
                self.channel = name.split("<|")[0] or "final"
                continue
            ends = [(j, m) for m in _ENDS if (j := self.buf.find(m)) >= 0]
            if ends:
                j, m = min(ends)
                body, self.buf = self.buf[:j], self.buf[j + (0 if m == "<|start|>" else len(m)):]
            else:
                n = len(self.buf) - _held(self.buf, _ENDS)
                body, self.buf = self.buf[:n], self.buf[n:]
            (reasoning if self.channel == "analysis" else content).append(body)
            if not ends:
                break
            self.channel = None
        return "".join(reasoning), "".join(content)
