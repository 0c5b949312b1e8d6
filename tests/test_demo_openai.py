"""The official ``openai`` Python client against the demo, served by uvicorn on 127.0.0.1."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from demo_service import LoadedModel  # noqa: E402

from ._demo import ledger_of, loaded_model, model_dir, serving  # noqa: E402

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers."}]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return loaded_model(model_dir(tmp_path_factory))


def client(port: int) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="not-needed", max_retries=0)


async def test_models_and_completions(model: LoadedModel) -> None:
    async with serving(model) as (app, port), client(port) as api:
        (card,) = (await api.models.list()).data
        completion = await api.completions.create(model=card.id, prompt="Once upon a time", max_tokens=6, temperature=0)
        several = await api.completions.create(
            model=card.id, prompt=["a", "b"], n=2, max_tokens=3, temperature=0.8, seed=1
        )
        assert ledger_of(app).statistics().reserved_bytes == 0
    assert card.id == "qwen2-tiny"
    (choice,) = completion.choices
    assert choice.text and choice.finish_reason == "length" and completion.usage.completion_tokens == 6
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    assert [c.index for c in several.choices] == [0, 1, 2, 3]


async def test_completions_stream(model: LoadedModel) -> None:
    async with serving(model) as (_app, port), client(port) as api:
        stream = await api.completions.create(
            model="qwen2-tiny", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True
        )
        chunks = [chunk async for chunk in stream]
        plain = await api.completions.create(model="qwen2-tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_chat_completion(model: LoadedModel) -> None:
    async with serving(model) as (_app, port), client(port) as api:
        chat = await api.chat.completions.create(model="qwen2-tiny", messages=CHAT, max_tokens=5, temperature=0)
    (choice,) = chat.choices
    assert choice.message.role == "assistant" and choice.message.content
    rendered = model.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat.usage.prompt_tokens == len(model.tokenizer.encode(rendered, add_special_tokens=False))
    assert chat.usage.completion_tokens == 5 and chat.object == "chat.completion"


async def test_chat_stream_with_usage(model: LoadedModel) -> None:
    async with serving(model) as (app, port), client(port) as api:
        stream = await api.chat.completions.create(
            model="qwen2-tiny",
            messages=CHAT,
            max_completion_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        plain = await api.chat.completions.create(model="qwen2-tiny", messages=CHAT, max_tokens=7, temperature=0)
        assert ledger_of(app).statistics().reserved_bytes == 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7


async def test_errors_reach_the_client_as_its_own_exceptions(model: LoadedModel) -> None:
    async with serving(model) as (_app, port), client(port) as api:
        with pytest.raises(openai.NotFoundError, match="not served here"):
            await api.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
        with pytest.raises(openai.UnprocessableEntityError, match="not supported"):
            await api.chat.completions.create(model="qwen2-tiny", messages=CHAT, logprobs=True)
        with pytest.raises(openai.APIStatusError) as too_big:  # more than the whole 256 MiB budget (SDPA: ~16k tokens)
            long = [{"role": "user", "content": "word " * 16000}]
            await api.chat.completions.create(model="qwen2-tiny", messages=long, max_tokens=1024)
    assert too_big.value.status_code == 413 and too_big.value.code == "exceeds-budget"
    assert "needs more GPU memory than the budget" in str(too_big.value)
    assert too_big.value.response.json()["type"] == "urn:gpu-asgi:problem:exceeds-budget"  # still problem+json


async def test_gpu_asgi_refusals_show_their_reason_in_the_client(model: LoadedModel) -> None:
    # gpu_asgi answers these before the endpoint runs; the client's exception must say why.
    async with serving(model, max_new_tokens_cap=64, default_max_new_tokens=16) as (_app, port), client(port) as api:
        with pytest.raises(openai.UnprocessableEntityError) as over_cap:
            await api.chat.completions.create(model="qwen2-tiny", messages=CHAT, max_tokens=65)
        with pytest.raises(openai.UnprocessableEntityError) as too_many:
            await api.completions.create(model="qwen2-tiny", prompt="hi", n=9, max_tokens=2)
    assert over_cap.value.code == "invalid-field" and over_cap.value.param == "max_tokens"
    assert "max_tokens" in str(over_cap.value) and "64" in str(over_cap.value)
    assert too_many.value.param == "n" and "'n'" in str(too_many.value)
