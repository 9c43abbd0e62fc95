"""/generate: response shapes, schema errors, determinism, logprob exactness, batching, finish reasons."""

from __future__ import annotations

import json

import pytest
import torch

META_KEYS = {
    "id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens",
    "num_retractions", "weight_version", "weight_versions", "e2e_latency", "response_sent_to_client_ts",
}  # fmt: skip
LOGPROB_KEYS = {"output_token_logprobs", "output_token_logprobs_length", "input_token_logprobs"}


def generate(client, **body):
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_single_response_shape(client):
    out = generate(client, text="12+3=", sampling_params={"max_new_tokens": 5, "temperature": 0}, rid="r1")
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert set(meta) == META_KEYS
    assert meta["id"] == "r1" and meta["prompt_tokens"] == 5
    assert meta["completion_tokens"] == len(out["output_ids"]) <= 5
    assert meta["weight_version"] == "default"
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": len(out["output_ids"])}]
    assert isinstance(out["text"], str)


def test_logprob_fields(client):
    out = generate(
        client, input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 3, "ignore_eos": True},
        return_logprob=True, logprob_start_len=1,
    )  # fmt: skip
    meta = out["meta_info"]
    assert set(meta) == META_KEYS | LOGPROB_KEYS
    assert [entry[1] for entry in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(entry[2] is None and entry[0] <= 0 for entry in meta["output_token_logprobs"])
    assert meta["output_token_logprobs_length"] == 3
    assert [entry[1] for entry in meta["input_token_logprobs"]] == [6, 7, 8]
    assert meta["input_token_logprobs"][0][0] is None
    out = generate(client, input_ids=[5, 6], sampling_params={"max_new_tokens": 1}, return_logprob=True)
    assert out["meta_info"]["input_token_logprobs"] == []


def test_batch_and_rid_suffixes(client):
    out = generate(client, input_ids=[[5, 6], [7, 8, 9]], sampling_params={"max_new_tokens": 2}, rid="b")
    assert isinstance(out, list) and len(out) == 2
    assert [o["meta_info"]["id"] for o in out] == ["b_0", "b_1"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 3]


def test_n_samples_prompt_major_with_fresh_rids(client):
    out = generate(
        client, input_ids=[[5, 6], [7, 8, 9]], rid="mine",
        sampling_params={"max_new_tokens": 4, "n": 3, "ignore_eos": True},
    )  # fmt: skip
    assert len(out) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 2, 2, 3, 3, 3]
    rids = [o["meta_info"]["id"] for o in out]
    assert len(set(rids)) == 6 and not any(r.startswith("mine") for r in rids)
    single = generate(client, input_ids=[5, 6], sampling_params={"max_new_tokens": 2, "n": 2})
    assert isinstance(single, list) and len(single) == 2


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"seed": 1}, "unknown field `seed`, expected one of `max_new_tokens`"),
        ({"max_new_tokens": 1.5}, "invalid type: floating point `1.5`, expected i64"),
        ({"temperature": "hot"}, 'invalid type: string "hot", expected f64'),
        ({"ignore_eos": 1}, "invalid type: integer `1`, expected a boolean"),
        ({"stop_token_ids": [1, "2"]}, "expected i64"),
    ],
)
def test_schema_errors_are_plain_strings(client, params, message):
    response = client.post("/generate", json={"input_ids": [5], "sampling_params": params})
    assert response.status_code == 400
    assert isinstance(response.json()["error"], str) and message in response.json()["error"]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": -1}, "temperature must be non-negative"),
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ({"top_k": 0}, "top_k must be -1"),
        ({"max_new_tokens": -1}, "max_new_tokens must be at least 0"),
        ({"n": 0}, "n must be at least 1"),
        # a key SGLang's schema knows (constrained decoding), refused as unsupported, not as unknown
        ({"choice": ["yes", "no"]}, "choice (constrained decoding) is not supported"),
    ],
)
def test_range_errors_are_message_objects(client, params, message):
    response = client.post("/generate", json={"input_ids": [5], "sampling_params": params})
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_bad_inputs(client):
    assert client.post("/generate", json={"input_ids": []}).status_code == 400
    assert client.post("/generate", json={"sampling_params": {}}).status_code == 400
    too_long = client.post("/generate", json={"input_ids": [5] * 1024})
    assert too_long.status_code == 400 and "context length" in too_long.json()["error"]["message"]
    assert client.post("/generate", json={"input_ids": [5, 999]}).status_code == 400
    start = client.post(
        "/generate", json={"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 3}
    )
    assert start.status_code == 400


def sampled(client, seed_params=None):
    params = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, **(seed_params or {})}
    return generate(client, input_ids=[[5, 6, 7], [8, 9]], sampling_params=params)


def test_fixed_seed_gives_fixed_outputs(make_client):
    first, second = make_client(random_seed=7), make_client(random_seed=7)
    runs_a = [sampled(first) for _ in range(2)]
    runs_b = [sampled(second) for _ in range(2)]
    ids = lambda runs: [[o["output_ids"] for o in run] for run in runs]  # noqa: E731
    assert ids(runs_a) == ids(runs_b)
    assert ids(runs_a)[0] != ids(runs_a)[1], "the per-request counter must move the stream on"
    other = make_client(random_seed=8)
    assert ids([sampled(other)])[0] != ids(runs_a)[0]


def test_sampling_seed_is_ignored_without_deterministic_inference(make_client):
    """SGLang 0.5.23 builds no seed tensor unless --enable-deterministic-inference is on."""
    client = make_client(random_seed=7)
    seeded = [sampled(client, {"sampling_seed": 99})[0]["output_ids"] for _ in range(2)]
    assert seeded[0] != seeded[1]


def test_deterministic_inference_honours_the_seed_and_shares_it_across_n(make_client):
    first, other = (
        make_client(random_seed=7, enable_deterministic_inference=True),
        make_client(random_seed=8, enable_deterministic_inference=True),
    )
    seeded = [sampled(first, {"sampling_seed": 99})[0]["output_ids"] for _ in range(2)]
    assert seeded[0] == seeded[1] == sampled(other, {"sampling_seed": 99})[0]["output_ids"]
    assert sampled(first, {"sampling_seed": 100})[0]["output_ids"] != seeded[0]
    # One seed for n samples: identical samples (what per-sample requests avoid).
    params = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "n": 4, "sampling_seed": 5}
    outputs = generate(first, input_ids=[5, 6, 7], sampling_params=params)
    assert len({tuple(o["output_ids"]) for o in outputs}) == 1
    # No seed at all: SGLang uses 42 for every request.
    unseeded = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    a = generate(first, input_ids=[5, 6, 7], sampling_params=unseeded)["output_ids"]
    b = generate(first, input_ids=[5, 6, 7], sampling_params={**unseeded, "sampling_seed": 42})["output_ids"]
    assert a == b


def full_forward_logprobs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log p(ids[t+1] | ids[:t+1]) for every t, from one forward without a cache."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_a_full_forward(client, temperature):
    prompt = [5, 9, 12, 7, 20, 11, 6]
    out = generate(
        client, input_ids=prompt, return_logprob=True, logprob_start_len=0,
        sampling_params={"max_new_tokens": 24, "temperature": temperature, "ignore_eos": True},
    )  # fmt: skip
    ids = prompt + out["output_ids"]
    model = client.app.state.engine.model
    expected = full_forward_logprobs(model, ids, temperature)
    got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
    assert (got - expected[len(prompt) - 1 :]).abs().max().item() < 1e-5
    # Input logprobs are SGLang's: from unscaled logits.
    unscaled = full_forward_logprobs(model, prompt)
    got_input = torch.tensor([e[0] for e in out["meta_info"]["input_token_logprobs"][1:]])
    assert (got_input - unscaled).abs().max().item() < 1e-5


def test_batched_mixed_lengths_equal_one_at_a_time(client):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15], [16, 17, 18, 19, 20, 21, 22], [23]]
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    batched = generate(client, input_ids=prompts, sampling_params=params, return_logprob=True)
    for prompt, out in zip(prompts, batched, strict=True):
        alone = generate(client, input_ids=prompt, sampling_params=params, return_logprob=True)
        assert out["output_ids"] == alone["output_ids"]
        a = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
        b = torch.tensor([e[0] for e in alone["meta_info"]["output_token_logprobs"]])
        assert (a - b).abs().max().item() < 1e-5


def test_finish_reasons(client):
    greedy = {"temperature": 0, "ignore_eos": True}
    base = generate(client, input_ids=[5, 6, 7], sampling_params={**greedy, "max_new_tokens": 8})
    assert base["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert len(base["output_ids"]) == 8
    stop = base["output_ids"][3]
    first = base["output_ids"].index(stop)
    out = generate(
        client, input_ids=[5, 6, 7], sampling_params={**greedy, "max_new_tokens": 8, "stop_token_ids": [stop]}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == base["output_ids"][: first + 1], "output_ids keep the stop token"
    none = generate(client, input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 0})
    assert none["output_ids"] == [] and none["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_eos_stops_and_is_trimmed_from_text(client):
    eos = client.app.state.engine.generator.eos_ids[0]
    out = generate(
        client, input_ids=[5, 6], sampling_params={"max_new_tokens": 6, "logit_bias": {str(eos): 100.0}}
    )
    assert out["output_ids"] == [eos] and out["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": eos,
    }
    assert out["text"] == ""


def test_stream_sends_cumulative_chunks_then_done(client):
    body = {"input_ids": [5, 6], "stream": True, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    with client.stream("POST", "/generate", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(set(lengths)) and lengths[-1] == 4
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_input_logprobs_with_different_starts_in_one_batch(client):
    prompts = [[5, 9, 12, 7, 20], [6, 8, 13, 4, 21]]
    out = generate(
        client, input_ids=prompts, return_logprob=True, logprob_start_len=[0, 2],
        sampling_params={"max_new_tokens": 1},
    )  # fmt: skip
    model = client.app.state.engine.model
    for prompt, start, item in zip(prompts, [0, 2], out, strict=True):
        entries = item["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == prompt[start:] and entries[0][0] is None
        expected = full_forward_logprobs(model, prompt)[start:]
        assert (torch.tensor([e[0] for e in entries[1:]]) - expected).abs().max().item() < 1e-5


def test_a_plain_call_wakes_once_when_its_last_sequence_ends():
    from dsv4rl.engine.generator import GenRequest
    from dsv4rl.engine.sampling import SamplingParams
    from dsv4rl.engine.server import LastToFinish

    wakes = []
    requests = [GenRequest([5], SamplingParams()) for _ in range(3)]
    last = LastToFinish(len(requests), lambda: wakes.append(1))
    last.changed(requests[0])  # a new token, not the end: nothing
    for request in requests[:2]:
        request.finish_reason = {"type": "length"}
        last.changed(request)
        last.changed(request)  # told twice (a token, then the end): counted once
    assert wakes == []
    requests[2].finish_reason = {"type": "abort"}  # an abort ends a sequence too
    last.changed(requests[2])
    assert wakes == [1]


def test_done_is_made_on_first_use_and_set_however_late_it_is_asked_for():
    """A request's `done` event exists only once someone asks for it, and is set whether it was asked for
    before the request finished or after."""
    import threading

    from dsv4rl.engine.generator import GenRequest
    from dsv4rl.engine.sampling import SamplingParams

    early, late = GenRequest([5], SamplingParams()), GenRequest([5], SamplingParams())
    assert early._done is None and late._done is None  # no event per sequence of a request
    waiting = early.done
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: waiting.wait(10) and woke.set())
    waiter.start()
    for request in (early, late):  # what Generator._finish does
        request.finish_reason = {"type": "length"}
        request._set_done()
    waiter.join(10)
    assert woke.is_set() and early.done is waiting
    assert late.done.is_set()  # made after the end: born set


def test_calls_sent_together_by_a_splitting_client_run_as_one_batch(client):
    """A client that sends a step's work in several concurrent calls (a trainer scoring each group as it
    lands) gets them started as one batch, once seen splitting; a one-call client never waits."""
    import threading

    from dsv4rl.engine.generator import GenRequest
    from dsv4rl.engine.sampling import SamplingParams

    generator = client.app.state.engine.generator
    batches: list[int] = []
    take = generator._take_batch

    def recording() -> list:
        batch = take()
        batches.append(len(batch))
        return batch

    generator._take_batch = recording
    try:

        def submit_calls(calls: int) -> None:
            requests = []
            for _ in range(calls):
                call = [GenRequest([1, 5, 6], SamplingParams(max_new_tokens=2)) for _ in range(4)]
                requests += call
                generator.submit(call)
                threading.Event().wait(0.002)  # calls land a few milliseconds apart, as over HTTP
            for request in requests:
                assert request.done.wait(30)

        submit_calls(1)
        assert batches == [4] and not generator._split_calls
        submit_calls(4)  # the first split step may start before all calls landed
        assert generator._split_calls and sum(batches[1:]) == 16
        batches.clear()
        submit_calls(4)
        assert batches == [16]
    finally:
        generator._take_batch = take


def test_a_generate_batch_is_busy_at_its_weight_version_so_a_fault_point_can_name_it(
    client, tmp_path, monkeypatch
):
    """`DSV4RL_INJECT_KILL=engine-1:generate:20` needs a step: a generate batch carries the weight version
    it samples with (the trainer's step whose weights these are); before any numbered version, none."""
    import dsv4rl.faults.heartbeat as module

    seen = []
    monkeypatch.setattr(module, "maybe_hang", lambda process, point, step, **_: seen.append((point, step)))
    monkeypatch.setattr(module, "_heartbeat", None)
    module.configure(tmp_path / "hb.json", "engine-1")
    generator = client.app.state.engine.generator
    before = generator.weight_version
    try:
        generate(client, input_ids=[0, 5], sampling_params={"max_new_tokens": 1})
        generator.set_weight_version("20")
        generate(client, input_ids=[0, 5], sampling_params={"max_new_tokens": 1})
    finally:
        generator.set_weight_version(before)
    steps = [step for point, step in seen if point == "generate"]
    assert steps[-1] == 20 and (before.isdigit() or steps[0] is None), seen
