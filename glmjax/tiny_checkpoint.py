"""A small GLM-5-architecture Hugging Face checkpoint made from nothing: what a team's own
model looks like to glmjax, at a size a CPU trains in minutes.

    python -m glmjax.tiny_checkpoint /tmp/my-model [--corpus extra.txt ...] [--vocab-size 1024]

writes, with transformers' own classes and a tokenizer trained here with `tokenizers`:

    config.json, model.safetensors       GlmMoeDsaForCausalLM (MLA, DSA indexer with IndexShare,
                                         a dense layer then MoE layers), random weights
    generation_config.json               the stop tokens (<|endoftext|>, <|user|>, <|observation|>)
    tokenizer.json, tokenizer_config.json, chat_template.jinja
                                         byte-level BPE trained on `corpus()` (and --corpus files), GLM's role
                                         and tool-call tokens, and `GLM_STYLE_TEMPLATE`

`GLM_STYLE_TEMPLATE` renders conversations the way GLM-4.5 / GLM-5 do: ``[gMASK]<sop>``, one
role token per message followed by a newline, the tools listed in a system turn, tool calls
as ``<tool_call>NAME`` with ``<arg_key>``/``<arg_value>`` pairs, tool results as
``<|observation|>`` with ``<tool_response>`` blocks. It leaves out GLM's ``<think>`` blocks,
so that a model with random weights need not learn them before it can act.
Transformers needs torch for the model; nothing else in glmjax does.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable, Iterator

ROLE_TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>")
# Kept in decoded text (not special): the tool-call parsers read them.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
               "<tool_response>", "</tool_response>", "<think>", "</think>")

GLM_STYLE_TEMPLATE = (
    "[gMASK]<sop>"
    "{% if tools %}"
    "<|system|>\n# Tools"
    "{% for tool in tools %}"
    "{% set f = tool.function if tool.function is defined else tool %}"
    "{{ '\\n' }}{{ f.name }}({{ (f.parameters.properties if f.parameters is defined and f.parameters.properties is defined "
    "else {}) | list | join(', ') }}): {{ f.description }}"
    "{% endfor %}"
    "{{ '\\n' }}Call a tool as <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<|system|>\n{{ m.content }}"
    "{% elif m.role == 'user' %}<|user|>\n{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|>\n{{ m.content if m.content is string else '' }}"
    "{% for tc in (m.tool_calls or []) %}"
    "{% set f = tc.function if tc.function is defined else tc %}"
    "<tool_call>{{ f.name }}"
    "{% for k, v in f.arguments.items() %}{{ '\\n' }}<arg_key>{{ k }}</arg_key>\n<arg_value>"
    "{{ v if v is string else v | tojson }}</arg_value>{% endfor %}"
    "{{ '\\n' }}</tool_call>"
    "{% endfor %}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|observation|>{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# A GLM-5 layout at a CPU's size: IndexShare (full, shared, ...), one dense layer, then MoE.
MODEL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
             n_shared_experts=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=32,
             qk_nope_head_dim=24, index_topk=256, index_head_dim=32, index_n_heads=4, first_k_dense_replace=1,
             index_topk_freq=2, index_skip_topk_offset=1, max_position_embeddings=1024, tie_word_embeddings=False)


_WORDS = ("the value of in to write read file files list sort count from by and or not answer question what is "
          "how many find print run command output error exit test tests task done ok yes no key name path dir "
          "directory line lines first last number numbers sum total result results check fix bug code function "
          "return def import for if else while true false none self class value values kv ans app tmp etc home "
          "ivy oak elm ash fir gray blue red green gold pink teal").split()
_COMMANDS = ("ls", "ls -la", "cat {w}", "grep {w}= {v}", "echo {v} >{w}", "wc -l {w}", "head -n {n} {w}",
             "sort -n {w}", "python3 -c 'print({n}+{n})'", "cd /{w} && ls", "find . -name {w}", "cat /app/{w}")


def corpus(lines: int = 6000, seed: int = 0) -> Iterator[str]:
    """Text like what a small agent reads and writes: English words, arithmetic, lists,
    shell commands as GLM tool calls, their results."""
    import random

    rng = random.Random(seed)
    for _ in range(lines // 3):
        words = rng.sample(_WORDS, rng.randint(4, 12))
        yield " ".join(words).capitalize() + rng.choice((".", "?", ":", "="))
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        yield rng.choice((f"{a}+{b}={a + b}", f"{a}-{b}={a - b}", f"{a}*{b}={a * b}",
                          "sort " + " ".join(str(rng.randint(0, 99)) for _ in range(5)) + "=",
                          f"What is {a} plus {b}? {a + b}"))
        command = rng.choice(_COMMANDS).format(w=rng.choice(_WORDS), v=rng.choice(_WORDS), n=rng.randint(1, 20))
        yield (f"<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>{command}</arg_value>\n</tool_call>"
               f"\n<tool_response>\n{rng.choice(_WORDS)}={rng.choice(_WORDS)}\n[exit 0, 0.01s]\n</tool_response>")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024):
    """A byte-level BPE tokenizer (every string encodes; no unknown token) with GLM's role
    tokens special and its tool-call tokens whole, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(ROLE_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.add_tokens(list(TOOL_TOKENS))
    fast.chat_template = GLM_STYLE_TEMPLATE
    return fast


def make_checkpoint(path: str, *, seed: int = 0, vocab_size: int = 1024, extra_texts: Iterable[str] = (),
                    **model_overrides) -> str:
    """Writes the checkpoint (module docstring) to `path` and returns it."""
    import torch
    from transformers import GenerationConfig, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    tokenizer = train_tokenizer(list(corpus()) + list(extra_texts), vocab_size)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    torch.manual_seed(seed)
    config = GlmMoeDsaConfig(**{**MODEL, "vocab_size": len(tokenizer), "eos_token_id": stops,
                                "pad_token_id": stops[0], "bos_token_id": None, **model_overrides})
    model = GlmMoeDsaForCausalLM(config).eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=stops, pad_token_id=stops[0]).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m glmjax.tiny_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="the directory to write")
    p.add_argument("--corpus", nargs="*", default=(), help="text or JSONL files whose text the tokenizer also learns")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    extra = []
    for name in args.corpus:
        with open(name) as f:
            for line in f:
                try:  # a JSONL row contributes its string fields
                    row = json.loads(line)
                    extra += [v for v in row.values() if isinstance(v, str)] if isinstance(row, dict) else [line]
                except ValueError:
                    extra.append(line)
    make_checkpoint(args.path, seed=args.seed, vocab_size=args.vocab_size, extra_texts=extra)
    print(f"wrote {args.path}: " + ", ".join(sorted(os.listdir(args.path))))


if __name__ == "__main__":
    main()
