"""The async API (astream, astream_chat, agenerate, achat) with ScriptedModel and the default
model's real tokenizer: same results as the sync twins, the event loop keeps running while a
stream waits, cancelling the awaiting task aborts the request and frees its KV blocks, and it
works inside an ASGI app (Starlette under httpx.AsyncClient). The notebook test
(tests/test_notebook.py) runs it inside Jupyter's loop.
"""
import asyncio
import json
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

import engine
from engine.errors import EngineDead
from engine.loader import default_model_path
from engine.params import SamplingParams
from engine.testing import ScriptedModel
from tests.server_fixtures import CountingModel

TEXT = "Async streams: 안녕하세요 👩‍👩‍👧‍👦 done."
MESSAGES = [{"role": "user", "content": "Hello"}]
LONG = 30000  # tokens: a request that runs for seconds, so it is still running when cancelled
DEADLINE = 60.0  # seconds; a bound for waits on a busy machine, not a timing assertion


@pytest.fixture(scope="module")
def tok():
    return engine.load_tokenizer(default_model_path())


@pytest.fixture
def script(tok):
    return tok.encode(TEXT, add_special_tokens=False)


def make_engine(tok, script, **options):
    options.setdefault("max_model_len", 4096)
    options.setdefault("kv_cache_tokens", 8192)
    return engine.Engine(ScriptedModel(script, tok.vocab_size), tok, **options)


async def wait_idle(eng) -> dict:
    """Stats once no request runs or waits (the engine thread handles aborts between ticks)."""
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        stats = eng.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_usage"] == 0.0:
            return stats
        await asyncio.sleep(0.01)
    return eng.stats()


def test_async_twins_match_the_sync_ones(tok, script):
    params = SamplingParams(max_tokens=len(script), temperature=0, logprobs=True, top_logprobs=2)
    with make_engine(tok, script) as eng:
        sync_events = list(eng.stream("prompt", params))
        sync_chat = eng.chat(MESSAGES, params)
        sync_batch = eng.generate(["a", [1, 2, 3]], params)

        async def main():
            events = [ev async for ev in eng.astream("prompt", params)]
            chat_events = [ev async for ev in eng.astream_chat(MESSAGES, params)]
            return events, chat_events, await eng.achat(MESSAGES, params), await eng.agenerate(["a", [1, 2, 3]], params)

        events, chat_events, chat, batch = asyncio.run(main())
    assert [(e.text, e.token_ids, e.finish_reason) for e in events] == \
        [(e.text, e.token_ids, e.finish_reason) for e in sync_events]
    assert "".join(e.text for e in events) == TEXT
    assert "".join(e.text for e in chat_events) == chat.text == sync_chat.text == TEXT
    assert chat.token_ids == sync_chat.token_ids == script
    assert chat.prompt_token_ids == sync_chat.prompt_token_ids
    assert [lp.token_id for lp in chat.logprobs] == script
    assert [(c.text, c.token_ids, c.finish_reason, c.usage) for c in batch] == \
        [(c.text, c.token_ids, c.finish_reason, c.usage) for c in sync_batch]


def test_the_loop_runs_while_a_stream_waits(tok, script):
    """A ticker coroutine advances between events: waiting for tokens never blocks the loop."""
    params = SamplingParams(max_tokens=200, temperature=0)
    with make_engine(tok, script) as eng:
        async def main():
            ticks = 0
            stop = asyncio.Event()

            async def ticker():
                nonlocal ticks
                while not stop.is_set():
                    ticks += 1
                    await asyncio.sleep(0)

            task = asyncio.create_task(ticker())
            seen = [ticks async for _ in eng.astream("prompt", params)]
            stop.set()
            await task
            return seen

        seen = asyncio.run(main())
    assert len(seen) == 200
    assert len(set(seen)) > 1  # the ticker ran while the stream was parked


def test_many_streams_wait_on_one_loop(tok, script):
    """More streams than any thread pool has threads: none holds a thread while it waits."""
    params = SamplingParams(max_tokens=len(script), temperature=0)
    with make_engine(tok, script, max_num_seqs=64) as eng:
        async def main():
            return await eng.agenerate([f"prompt {i}" for i in range(100)], params)

        done = asyncio.run(main())
    assert [c.text for c in done] == [TEXT] * 100


@pytest.mark.parametrize("api", ["astream", "agenerate", "achat"])
def test_cancelling_the_task_aborts_the_request(tok, script, api):
    params = SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True)
    with make_engine(tok, script, max_model_len=LONG + 64, kv_cache_tokens=4 * LONG) as eng:
        async def main():
            started = asyncio.Event()

            async def consume():
                if api == "astream":
                    async for _ in eng.astream("prompt", params):
                        started.set()
                elif api == "agenerate":
                    await eng.agenerate(["a", "b"], params)
                else:
                    await eng.achat(MESSAGES, params)

            task = asyncio.create_task(consume())
            if api == "astream":
                await asyncio.wait_for(started.wait(), DEADLINE)
            else:
                end = time.monotonic() + DEADLINE
                while eng.stats()["num_running"] == 0 and time.monotonic() < end:
                    await asyncio.sleep(0.005)
            busy = eng.stats()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return busy, await wait_idle(eng)

        busy, idle = asyncio.run(main())
        generated = idle["num_generated_tokens"]
    assert busy["num_running"] >= 1 and busy["kv_usage"] > 0
    assert idle["num_running"] == 0 and idle["num_waiting"] == 0 and idle["kv_usage"] == 0.0
    assert generated < LONG  # stopped early


def test_a_stream_left_early_aborts(tok, script):
    params = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
    with make_engine(tok, script) as eng:
        async def main():
            stream = eng.astream("prompt", params)
            async for _ in stream:
                break
            await stream.aclose()
            return await wait_idle(eng)

        idle = asyncio.run(main())
    assert idle["num_running"] == 0 and idle["kv_usage"] == 0.0


def test_closing_the_engine_ends_a_waiting_stream_with_engine_dead(tok, script):
    params = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
    eng = make_engine(tok, script)

    async def main():
        stream = eng.astream("prompt", params)
        await stream.__anext__()
        eng.close()
        async for _ in stream:
            pass

    with pytest.raises(EngineDead):
        asyncio.run(main())


# ---------------------------------------------------------------- an ASGI app

def make_app(eng) -> Starlette:
    async def chat(request: Request):
        body = await request.json()
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=0, ignore_eos=True)
        if not body.get("stream"):
            completion = await eng.achat(body["messages"], params)
            return JSONResponse({"text": completion.text, "finish_reason": completion.finish_reason})

        async def events():
            async for event in eng.astream_chat(body["messages"], params):
                yield f"data: {json.dumps({'text': event.text})}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/chat", chat, methods=["POST"])])


def test_in_a_starlette_app_under_httpx(tok, script):
    with make_engine(tok, script) as eng:
        reference = eng.chat(MESSAGES, SamplingParams(max_tokens=len(script) + 5, temperature=0, ignore_eos=True))

        async def main():
            transport = httpx.ASGITransport(app=make_app(eng))
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
                body = {"messages": MESSAGES, "max_tokens": len(script) + 5}
                one_shot = (await client.post("/chat", json=body)).json()
                streamed = await client.post("/chat", json=dict(body, stream=True))
                texts = [json.loads(line[6:])["text"] for line in streamed.text.split("\n\n") if line]
                # A client that gives up: its request task is cancelled, and the engine's request goes.
                task = asyncio.create_task(client.post("/chat", json={"messages": MESSAGES, "max_tokens": 3000}))
                end = time.monotonic() + DEADLINE
                while eng.stats()["num_running"] == 0 and time.monotonic() < end:
                    await asyncio.sleep(0.005)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                return one_shot, texts, await wait_idle(eng)

        one_shot, texts, idle = asyncio.run(main())
    assert one_shot == {"text": reference.text, "finish_reason": "length"}
    assert "".join(texts) == reference.text
    assert idle["num_running"] == 0 and idle["kv_usage"] == 0.0


def test_n_choices_async_match_sync(tok, script):
    params = SamplingParams(max_tokens=len(script), temperature=0, n=3)
    with make_engine(tok, script) as eng:
        sync_choices = eng.chat(MESSAGES, params)
        sync_batch = eng.generate(["a", "b"], params)

        async def main():
            return await eng.achat(MESSAGES, params), await eng.agenerate(["a", "b"], params)

        choices, batch = asyncio.run(main())
    assert [(c.index, c.text, c.token_ids) for c in choices] == \
        [(c.index, c.text, c.token_ids) for c in sync_choices] == [(i, TEXT, script) for i in range(3)]
    assert [(c.index, c.text) for c in batch] == [(c.index, c.text) for c in sync_batch]
    assert len(batch) == 6


def test_agenerate_hands_every_prompt_to_the_first_tick(tok, script):
    """As generate: the prompts reach the engine at once, so its first forward prefills all of them
    in every run (one at a time, a tick could start between two)."""
    model = CountingModel(script, tok.vocab_size)
    params = SamplingParams(max_tokens=len(script), temperature=0)
    prompts = [f"prompt number {i}: " + TEXT * 2 for i in range(6)]
    with engine.Engine(model, tok, max_model_len=4096, max_num_batched_tokens=4096) as eng:
        for _ in range(5):
            model.sequences_per_forward.clear()
            done = asyncio.run(eng.agenerate(prompts, params))
            assert [c.text for c in done] == [TEXT] * len(prompts)
            assert model.sequences_per_forward[0] == len(prompts), model.sequences_per_forward
