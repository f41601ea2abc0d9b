"""The glmjax engine as an `envs` model client (`envs.models.ModelClient`).

    from rl.env_client import EngineClient
    client = EngineClient.from_checkpoint("path/to/model", max_concurrent_decodes=8)
    envs.evaluate.evaluate(client, ...)            # or envs.generate's agents

Text goes in and out as bytes (the tiny models' vocabulary) unless a tokenizer with
`encode` / `decode` is given. With `chat` (glmjax/chat.py) the client also has `act`: the
evaluation matrix (`envs/evaluate.py`) hands it an episode's turns, which it encodes in
the chat format the model was trained on, and the model's turn ends at a role token.
Requests from several threads are served together when the driver runs in the background
(`driver.start()`). Every request samples with its own seed (`seed`, `seed + 1`, ... in
the order they arrive), so that the k samples of pass@k are k draws, not one draw k times.
`envs/` never imports this module; `rl/` depends on `envs/`,
not the other way round.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import glmjax
from glmjax.chat import Turn
from rl import rollout
from rl.engine.driver import Driver, Request
from rl.engine.engine import GlmEngine


class EngineClient:
    def __init__(self, driver: Driver, tokenizer=None, chat=None, seed: int = 0):
        self.driver, self.chat = driver, chat
        self._seeds = itertools.count(seed)  # next() on a count is atomic: threads draw distinct seeds
        self.encode = tokenizer.encode if tokenizer is not None else rollout.encode
        self.decode = tokenizer.decode if tokenizer is not None else rollout.decode

    @classmethod
    def from_checkpoint(cls, path: str, *, max_concurrent_decodes: int = 8, max_len: int = 1024, tokenizer=None):
        model = glmjax.from_pretrained(path)
        engine = GlmEngine(model, max_concurrent_decodes=max_concurrent_decodes,
                           max_len=min(max_len, model.config.max_position_embeddings))
        return cls(Driver(engine), tokenizer)

    def complete(self, prompt: str, *, max_tokens: int = 256, temperature: float = 0.0,
                 stop: Sequence[str] | None = None) -> str:
        """The completion of prompt; generation ends at the first token of any stop string."""
        stop_ids = tuple(t for s in (stop or ()) for t in self.encode(s)[:1])
        return self.decode(self._generate(self.encode(prompt), max_tokens, temperature, stop_ids))

    def act(self, transcript, *, max_tokens: int = 256, temperature: float = 0.0) -> str:
        """The model's next turn in an episode (`envs.base.Transcript`), in the chat format."""
        if self.chat is None:
            raise AttributeError("EngineClient.act needs a chat format: EngineClient(driver, chat=ByteChat())")
        roles = {"prompt": "user", "model": "assistant", "tool": "observation"}
        tokens = self.chat.render([Turn(roles[t.role], t.text) for t in transcript.turns])
        room = self.driver.engine.max_len - self.driver.engine.num_draft - 1 - len(tokens)
        if room < 1:
            return ""  # the episode has outgrown the model's window: an empty turn runs nothing
        return self.chat.decode(self._generate(tokens, min(max_tokens, room), temperature, self.chat.stop_ids))

    def _generate(self, tokens, max_tokens: int, temperature: float, stop_ids) -> list[int]:
        handle = self.driver.submit(Request(list(tokens), max_tokens, temperature=temperature, seed=next(self._seeds),
                                            stop_ids=tuple(stop_ids)))
        if not self.driver.running:
            self.driver.run_until_idle()
        return handle.result().tokens
