"""Chat formats: a conversation as token ids, built turn by turn (token in, token out).

GLM's layout (the GLM-4.5 / GLM-5 chat template), one role token per message:

    <|system|>{system}<|user|>{task}<|assistant|>{action}<|observation|>{output}<|assistant|>{action}<|user|>

A model turn ends at a role token the model writes itself: <|observation|> (it called a
tool; the environment's output follows) or <|user|> / <|endoftext|> (its turn is over).
An episode's row is built by appending, never by rendering text and encoding it again:

    row = start(system, task)                      # up to and including <|assistant|>
    row += sampled tokens of the model turn        # as the engine produced them, stop token included
    row += observation(output)                     # the tool output and the next <|assistant|>

so the learner trains on exactly the tokens the engine saw. Two formats:

- ``ByteChat``: the tiny models' vocabulary, 256 byte values, with the role tokens as the
  special ids 256..260 above it (a model needs ``vocab_size >= ByteChat.vocab_size``).
- ``HFChat``: a Hugging Face tokenizer with its chat template. ``check`` compares the
  incremental tokens with the template's rendering of the whole conversation and names
  the turn where they diverge: a template that is not append-only (whitespace merged at
  turn boundaries, past reasoning dropped) is found before training on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

SYSTEM, USER, ASSISTANT, OBSERVATION, EOS = "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>"
ROLES = (SYSTEM, USER, ASSISTANT, OBSERVATION, EOS)


@dataclasses.dataclass(frozen=True)
class Turn:
    """One message: ``role`` in system / user / assistant / observation."""

    role: str
    text: str


class ByteChat:
    """Bytes 0..255 plus the five role tokens at 256..260."""

    vocab_size = 256 + len(ROLES)
    ids = {name: 256 + i for i, name in enumerate(ROLES)}

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The tokens that end a model turn."""
        return self.ids[OBSERVATION], self.ids[USER], self.ids[EOS]

    @property
    def tool_call_id(self) -> int:
        return self.ids[OBSERVATION]

    def encode_text(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of tokens, role tokens dropped."""
        return bytes(int(t) for t in tokens if 0 <= int(t) < 256).decode("utf-8", errors="replace")

    def start(self, task: str, system: str | None = None) -> list[int]:
        head = [self.ids[SYSTEM]] + self.encode_text(system) if system else []
        return head + [self.ids[USER]] + self.encode_text(task) + [self.ids[ASSISTANT]]

    def observation(self, output: str, after: Sequence[int]) -> list[int]:
        """Tokens appended after a model turn ``after`` (its sampled tokens): the role token
        if the model did not write it, the output, and the next assistant header."""
        head = [] if list(after[-1:]) == [self.ids[OBSERVATION]] else [self.ids[OBSERVATION]]
        return head + self.encode_text(output) + [self.ids[ASSISTANT]]

    def render(self, turns: Sequence[Turn]) -> list[int]:
        """The whole conversation encoded at once (what ``check`` compares against)."""
        out = []
        for turn in turns:
            out += [self.ids[f"<|{turn.role}|>"]] + self.encode_text(turn.text)
        return out + [self.ids[ASSISTANT]]


class HFChat:
    """A Hugging Face tokenizer and its chat template (``tokenizer.apply_chat_template``).

    Roles map to the template's: observation turns are ``{"role": "tool"}`` messages (GLM's
    template renders them as <|observation|>)."""

    def __init__(self, tokenizer):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"{type(tokenizer).__name__} has no chat_template: HFChat needs one "
                             "(tokenizer.chat_template = '...jinja...')")
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        ids = {name: tokenizer.convert_tokens_to_ids(name) for name in ROLES}
        self.ids = {k: v for k, v in ids.items() if v is not None and v != tokenizer.unk_token_id}
        stops = [self.ids[n] for n in (OBSERVATION, USER, EOS) if n in self.ids]
        if tokenizer.eos_token_id is not None:
            stops.append(tokenizer.eos_token_id)
        self.stop_ids = tuple(dict.fromkeys(stops))
        self.tool_call_id = self.ids.get(OBSERVATION)

    @staticmethod
    def _messages(turns: Sequence[Turn]) -> list[dict]:
        return [{"role": "tool" if t.role == "observation" else t.role, "content": t.text} for t in turns]

    def _text(self, turns: Sequence[Turn], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(self._messages(turns), tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def start(self, task: str, system: str | None = None) -> list[int]:
        turns = ([Turn("system", system)] if system else []) + [Turn("user", task)]
        return self.encode_text(self._text(turns, generation_prompt=True))

    def observation(self, output: str, after: Sequence[int]) -> list[int]:
        """The template's text between an assistant turn and the next generation prompt,
        around ``output``, encoded on its own; the role token is left out when the model
        already wrote it."""
        probe = [Turn("user", "u"), Turn("assistant", "a")]
        before = self._text(probe, generation_prompt=False)
        full = self._text(probe + [Turn("observation", output)], generation_prompt=True)
        if not full.startswith(before):
            raise ValueError("the chat template is not append-only at an observation turn: rendering "
                             f"{probe + [Turn('observation', output)]} does not extend {before!r}")
        tokens = self.encode_text(full[len(before):])
        if self.tool_call_id is not None and list(after[-1:]) == [self.tool_call_id] and tokens[:1] == [self.tool_call_id]:
            tokens = tokens[1:]
        return tokens

    def render(self, turns: Sequence[Turn]) -> list[int]:
        return self.encode_text(self._text(turns, generation_prompt=True))


def check(chat, turns: Sequence[Turn], tokens: Sequence[int], boundaries: Sequence[int]) -> None:
    """Raises ValueError when the incremental ``tokens`` of ``turns`` (``boundaries[i]``: where
    turn i's tokens end) differ from ``chat.render(turns)``, naming the first turn that differs."""
    whole, tokens = chat.render(turns), list(tokens)
    if whole == tokens:
        return
    at = next((i for i, (a, b) in enumerate(zip(whole, tokens)) if a != b), min(len(whole), len(tokens)))
    turn = next((i for i, end in enumerate(boundaries) if at < end), len(turns) - 1)
    window = slice(max(0, at - 3), at + 4)
    raise ValueError(f"incremental encoding differs from the chat template's rendering at token {at}, in turn "
                     f"{turn} ({turns[turn].role}: {turns[turn].text[:40]!r}): incremental {tokens[window]} "
                     f"vs template {whole[window]}; train on the incremental tokens (what the engine saw) "
                     "or fix the template so that it only appends")
