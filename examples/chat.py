"""Query a glmjax-serve OpenAI-compatible endpoint with the official client.

    glmjax-serve --checkpoint /tmp/my-run/export/final --port off --http-port 8000 &
    python examples/chat.py http://127.0.0.1:8000/v1

Lists the served model, then asks it one chat question with the shell tools offered
(streamed), and one completion with the top-3 log-probs of each token.
"""

import sys

import openai

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def main(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="none")
    model = client.models.list().data[0].id
    print(f"model: {model}")
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 12+30?"}],
                                            tools=TOOLS, max_tokens=16, temperature=0, stream=True)
    print("chat:", "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip() or "(empty)")
    completion = client.completions.create(model=model, prompt="What is 12+30?", max_tokens=4, temperature=0,
                                           logprobs=3)
    logprobs = completion.choices[0].logprobs
    for token, alternatives in zip(logprobs.tokens, logprobs.top_logprobs):
        print(f"  {token!r:>12}  " + "  ".join(f"{t!r}: {p:.2f}" for t, p in alternatives.items()))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1")
