"""The glmjax engine as an `envs` model client (`envs.models.ModelClient`).

    from rl.env_client import EngineClient
    client = EngineClient.from_checkpoint("path/to/model", max_concurrent_decodes=8)
    envs.evaluate.run_matrix(client, ...)          # or envs.generate's agents

Text goes in and out as bytes (the tiny models' vocabulary) unless a tokenizer with
`encode` / `decode` is given. `envs/` never imports this module; `rl/` depends on `envs/`,
not the other way round.
"""

from __future__ import annotations

from collections.abc import Sequence

import glmjax
from rl import rollout
from rl.driver import Driver, Request
from rl.engine import GlmEngine


class EngineClient:
    def __init__(self, driver: Driver, tokenizer=None):
        self.driver = driver
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
        handle = self.driver.submit(Request(self.encode(prompt), max_tokens, temperature=temperature,
                                            stop_ids=stop_ids))
        self.driver.run_until_idle()
        return self.decode(handle.result().tokens)
