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
    template renders them as <|observation|>). Everything format-specific is read from the
    tokenizer, not assumed:

    - ``stop_ids``: ``stop_ids`` given (a checkpoint's generation_config.json eos ids), the
      tokenizer's eos token, and GLM's <|user|> / <|observation|> when the vocabulary has them;
    - ``assistant_prefix``: what the template writes between the generation prompt and an
      assistant message's content (GLM-5: "\\n<think></think>\\n"), which a model writes
      itself before its answer;
    - ``observation``: what the template writes after an assistant message's content up to
      the next generation prompt, around a tool result;
    - ``tools``: JSON schemas passed to the template in every rendering (the template lists
      them in its system turn)."""

    _MARK = "\x00assistant-content\x00"

    def __init__(self, tokenizer, *, tools: Sequence[dict] | None = None, stop_ids: Sequence[int] = ()):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"{type(tokenizer).__name__} has no chat_template: HFChat needs one "
                             "(tokenizer.chat_template = '...jinja...', or a chat_template.jinja beside the tokenizer)")
        self.tokenizer, self.tools = tokenizer, list(tools) if tools else None
        self.vocab_size = len(tokenizer)
        ids = {name: tokenizer.convert_tokens_to_ids(name) for name in ROLES}
        self.ids = {k: v for k, v in ids.items() if v is not None and v != tokenizer.unk_token_id}
        stops = list(stop_ids)
        if tokenizer.eos_token_id is not None:
            stops.append(tokenizer.eos_token_id)
        stops += [self.ids[n] for n in (OBSERVATION, USER, EOS) if n in self.ids]
        self.stop_ids = tuple(dict.fromkeys(int(t) for t in stops))
        if not self.stop_ids:
            raise ValueError(f"{type(tokenizer).__name__} names no token that ends a model turn: give it an eos_token "
                             "or the checkpoint a generation_config.json with eos_token_id")
        probe = [Turn("user", "u")]
        head = self._text(probe, generation_prompt=True)
        full = self._text(probe + [Turn("assistant", self._MARK)], generation_prompt=False)
        at = full.find(self._MARK, len(head))
        if not full.startswith(head) or at < 0:
            raise ValueError("the chat template is not append-only at an assistant turn: the rendering of "
                             f"{probe + [Turn('assistant', '...')]} does not extend the generation prompt {head!r}")
        self.assistant_prefix = full[len(head):at]
        tool = self.observation("o", after=())[:1]
        # the token that opens an observation, when a model ends its tool call with it (GLM: <|observation|>)
        self.tool_call_id = tool[0] if tool and tool[0] in self.stop_ids else self.ids.get(OBSERVATION)

    @classmethod
    def from_pretrained(cls, path: str, *, tools: Sequence[dict] | None = None) -> "HFChat":
        """The chat format of a checkpoint directory: its tokenizer files, chat template and
        generation_config.json's stop tokens. A ValueError names what is missing."""
        import json
        import os

        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise ValueError(f"{path} is not a directory: expected a Hugging Face checkpoint with tokenizer files")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError) as err:
            raise ValueError(f"{path}: the tokenizer does not load ({type(err).__name__}: "
                             f"{' '.join(str(err).split())[:300]}); expected tokenizer.json or the tokenizer's "
                             "own files beside config.json") from None
        stops = []
        config = os.path.join(path, "generation_config.json")
        if os.path.exists(config):
            with open(config) as f:
                eos = json.load(f).get("eos_token_id")
            stops = [eos] if isinstance(eos, int) else list(eos or ())
        try:
            return cls(tokenizer, tools=tools, stop_ids=stops)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None

    def _messages(self, turns: Sequence[Turn]) -> list[dict]:
        return [{"role": "tool" if t.role == "observation" else t.role, "content": t.text} for t in turns]

    def _text(self, turns: Sequence[Turn], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(self._messages(turns), tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    @property
    def end_id(self) -> int:
        """The token that ends a final answer: the tokenizer's eos (GLM: <|endoftext|>)."""
        eos = self.tokenizer.eos_token_id
        return eos if eos in self.stop_ids else self.stop_ids[0]

    def start(self, task: str, system: str | None = None) -> list[int]:
        turns = ([Turn("system", system)] if system else []) + [Turn("user", task)]
        return self.encode_text(self._text(turns, generation_prompt=True))

    def assistant(self, text: str) -> list[int]:
        """The tokens of an assistant turn whose content is ``text``, as a model writes them
        after the generation prompt (the template's ``assistant_prefix`` first)."""
        return self.encode_text(self.assistant_prefix + text)

    def observation(self, output: str, after: Sequence[int]) -> list[int]:
        """The template's text after an assistant turn's content up to the next generation
        prompt, around ``output``, encoded on its own; a first token that the model already
        wrote as its stop token (GLM's <|observation|>) is left out."""
        probe = [Turn("user", "u")]
        head = self._text(probe, generation_prompt=True) + self.assistant_prefix + "a"
        full = self._text(probe + [Turn("assistant", "a"), Turn("observation", output)], generation_prompt=True)
        if not full.startswith(head):
            raise ValueError("the chat template is not append-only at an observation turn: rendering "
                             f"{probe + [Turn('assistant', 'a'), Turn('observation', output)]} does not extend "
                             f"{head!r}")
        tokens = self.encode_text(full[len(head):])
        if tokens[:1] and list(after[-1:]) == tokens[:1] and tokens[0] in self.stop_ids:
            tokens = tokens[1:]
        return tokens

    def render(self, turns: Sequence[Turn]) -> list[int]:
        return self.encode_text(self._text(turns, generation_prompt=True))


SAMPLE = (Turn("system", "You are an agent in a shell."), Turn("user", "Write the value of ivy in kv to ans."),
          Turn("assistant", "<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>grep ivy= kv</arg_value>\n"
                            "</tool_call>"),
          Turn("observation", "ivy=gray\n[exit 0, 0.01s]"),
          Turn("assistant", "<bash>echo gray >ans</bash> {\"name\": \"submit\", \"arguments\": {}}"),
          Turn("observation", "[exit 0, 0.00s]\n\n  indented output\t"))


def check_append_only(chat, turns: Sequence[Turn] = SAMPLE) -> None:
    """Builds ``turns`` the way an episode does (``start``, each model turn, ``observation``)
    and compares with the template's rendering of the whole conversation (``check``): a
    ValueError names the first turn where they differ. Run before training on a template."""
    system = turns[0].text if turns[0].role == "system" else None
    first = 1 if system is not None else 0
    tokens = chat.start(turns[first].text, system)
    bounds = [len(tokens)] * (first + 1)
    for turn in turns[first + 1:]:
        if turn.role == "assistant":
            tokens += chat.assistant(turn.text) if hasattr(chat, "assistant") else chat.encode_text(turn.text)
            bounds.append(len(tokens))
        else:
            tokens += chat.observation(turn.text, after=tokens[-1:])
            bounds.append(len(tokens))
    check(chat, list(turns), tokens, bounds)


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
