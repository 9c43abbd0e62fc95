"""`POST /v1/chat/completions` on the reference engine: a DeepSeek-V4 chat rendered and answered by the tiny
model, in SGLang's response shape, and the fields it refuses named."""

from __future__ import annotations

from fastapi.testclient import TestClient

from dsv4rl.config.choices import ChatFormat
from dsv4rl.data.chat_format import ChatSettings, PromptRenderer


def test_a_chat_is_rendered_and_answered(client: TestClient) -> None:
    messages = [{"role": "system", "content": "Rate 0-9."}, {"role": "user", "content": "3+4=7"}]
    body = {"model": "judge", "messages": messages, "max_completion_tokens": 4, "temperature": 0.0, "seed": 3}
    first = client.post("/v1/chat/completions", json=body)
    assert first.status_code == 200, first.text
    answer = first.json()
    (choice,) = answer["choices"]
    assert answer["object"] == "chat.completion" and answer["model"] == "judge"
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    engine = client.app.state.engine
    prompt = PromptRenderer(engine.tokenizer, ChatSettings(ChatFormat.deepseek_v4)).encode_messages(messages)
    usage = answer["usage"]
    assert usage["prompt_tokens"] == len(prompt) and 1 <= usage["completion_tokens"] <= 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    again = client.post("/v1/chat/completions", json=body).json()  # greedy: the same reply
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]


def test_unserved_fields_and_bad_messages_are_named(client: TestClient) -> None:
    for body, words in (
        ({"messages": [{"role": "user", "content": "1"}], "stream": True}, "stream=True is not supported"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"role": "user", "content": "1"}], "n": 2}, "n=2 is not supported"),
    ):
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400 and words in response.text, response.text
