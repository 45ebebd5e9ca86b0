"""AsyncEngine without HTTP: it idles without spinning, streams deltas that add up to the
offline output, aborts on cancellation, refuses bad prompts without dying, and fails
requests on shutdown."""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest
from engine_gate import EngineGate  # noqa: E402  (tests/server/engine_gate.py)
from server_constants import ENGINE_DEFAULTS  # noqa: E402  (tests/server/conftest.py)

from octavo import SamplingParams
from octavo.config import EngineArgs
from octavo.engine.async_engine import AsyncEngine, EngineDeadError
from octavo.engine.llm_engine import LLMEngine
from octavo.sampling_params import RequestOutputKind


@pytest.fixture
def async_engine(server_model):
    engine = AsyncEngine(LLMEngine(EngineArgs(model=str(server_model), **ENGINE_DEFAULTS)))
    yield engine
    engine.shutdown()


def thread_cpu_seconds(native_id: int) -> float:
    for thread in psutil.Process().threads():
        if thread.id == native_id:
            return thread.user_time + thread.system_time
    raise AssertionError("engine thread not found")


def _request(async_engine, request_id, prompt, params):
    """An engine request through the engine's input processor, as the server makes one."""
    return async_engine.engine.input_processor.process(request_id, prompt, params)


def test_idle_loop_blocks_instead_of_spinning(async_engine):
    async def main() -> float:
        async_engine.start()
        await asyncio.sleep(0.2)
        before = thread_cpu_seconds(async_engine._thread.native_id)
        await asyncio.sleep(1.0)
        return thread_cpu_seconds(async_engine._thread.native_id) - before

    assert asyncio.run(main()) < 0.05


def test_deltas_add_up_to_the_offline_output_and_cancel_aborts(async_engine, offline):
    params = SamplingParams(max_tokens=12, temperature=0, output_kind=RequestOutputKind.DELTA)
    (expected,) = offline.generate(
        ["once upon a time"], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
    )

    async def collect() -> tuple[str, list[int], int]:
        text, token_ids, num_outputs = "", [], 0
        async for output in async_engine.generate(
            _request(async_engine, "a", "once upon a time", params)
        ):
            text += output.outputs[0].text
            token_ids += output.outputs[0].token_ids
            num_outputs += 1
        return text, token_ids, num_outputs

    async def cancelled() -> None:
        # The engine is held in the request's 2nd step (as by a hung device) until the cancel has
        # sent its abort, so the request cannot finish first however fast the machine is.
        long = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        first = asyncio.Event()

        async def consume():
            async for _ in async_engine.generate(_request(async_engine, "b", "the cat", long)):
                first.set()

        with EngineGate(async_engine.engine, passes=1):
            task = asyncio.ensure_future(consume())
            await asyncio.wait_for(first.wait(), 30)
            task.cancel()
            await asyncio.gather(
                task, return_exceptions=True
            )  # the generator sent its abort on the way out

    async def main():
        async_engine.start()
        result = await collect()
        await cancelled()
        return result

    text, token_ids, num_outputs = asyncio.run(main())
    assert text == expected.outputs[0].text and token_ids == list(expected.outputs[0].token_ids)
    assert num_outputs > 1
    kv = async_engine.engine.core.kv_cache_manager
    deadline = time.monotonic() + 10
    while (
        async_engine.engine.has_unfinished_requests()
        or kv.num_free_blocks != kv.block_pool.num_blocks
    ):
        assert time.monotonic() < deadline, "the cancelled request was not aborted"
        time.sleep(0.01)
    assert async_engine.metrics.requests.labels("aborted")._value.get() == 1
    assert async_engine.metrics.requests.labels("finished")._value.get() == 1  # "a" only
    assert async_engine.metrics.tokens_generated._value.get() <= 12 + 2, (
        "the abort landed right after the held step"
    )


def test_bad_prompt_is_refused_and_the_loop_lives_on(async_engine):
    async def main():
        async_engine.start()
        with pytest.raises(ValueError, match="empty"):
            async for _ in async_engine.generate(
                _request(async_engine, "bad", [], SamplingParams())
            ):
                pass
        outputs = [
            o
            async for o in async_engine.generate(
                _request(async_engine, "good", [1, 5, 9], SamplingParams(max_tokens=2))
            )
        ]
        return outputs[-1]

    final = asyncio.run(main())
    assert final.finished and len(final.outputs[0].token_ids) == 2 and async_engine.is_alive


def test_shutdown_fails_requests_in_flight(async_engine):
    async def main():
        async_engine.start()
        params = SamplingParams(
            max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        # Held in the request's 2nd step until shutdown has been asked, so it is in flight then
        # however fast the machine is; timeout=0: ask, and do not wait for the held thread.
        with EngineGate(async_engine.engine, passes=1):
            generator = async_engine.generate(_request(async_engine, "long", "the dog", params))
            await generator.__anext__()
            async_engine.shutdown(timeout=0)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in generator:
                pass
        await asyncio.to_thread(async_engine.shutdown)  # wait for the thread to end
        with pytest.raises(EngineDeadError):
            await async_engine.generate(_request(async_engine, "late", "x", params)).__anext__()

    asyncio.run(main())
    assert not async_engine.is_alive
