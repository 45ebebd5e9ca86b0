"""AsyncEngine without HTTP: it idles without spinning, streams deltas that add up to the offline
output, aborts on cancellation, refuses bad prompts without dying, and fails requests on shutdown."""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest

from octavo import SamplingParams
from octavo.config import EngineArgs
from octavo.engine.async_engine import AsyncEngine, EngineDeadError
from octavo.engine.llm_engine import LLMEngine
from octavo.sampling_params import RequestOutputKind

from server_constants import ENGINE_DEFAULTS  # noqa: E402  (tests/server/conftest.py)


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
    (expected,) = offline.generate(["once upon a time"], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)

    async def collect() -> tuple[str, list[int], int]:
        text, token_ids, num_outputs = "", [], 0
        async for output in async_engine.generate("a", "once upon a time", params):
            text += output.outputs[0].text
            token_ids += output.outputs[0].token_ids
            num_outputs += 1
        return text, token_ids, num_outputs

    async def cancelled() -> None:
        long = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        async def consume():
            async for _ in async_engine.generate("b", "the cat", long):
                pass
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

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
    while async_engine.engine.has_unfinished_requests() or kv.num_free_blocks != kv.block_pool.num_blocks:
        assert time.monotonic() < deadline, "the cancelled request was not aborted"
        time.sleep(0.01)
    assert async_engine.metrics.requests.labels("aborted")._value.get() == 1


def test_bad_prompt_is_refused_and_the_loop_lives_on(async_engine):
    async def main():
        async_engine.start()
        with pytest.raises(ValueError, match="empty"):
            async for _ in async_engine.generate("bad", [], SamplingParams()):
                pass
        outputs = [o async for o in async_engine.generate("good", [1, 5, 9], SamplingParams(max_tokens=2))]
        return outputs[-1]

    final = asyncio.run(main())
    assert final.finished and len(final.outputs[0].token_ids) == 2 and async_engine.is_alive


def test_shutdown_fails_requests_in_flight(async_engine):
    async def main():
        async_engine.start()
        params = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        generator = async_engine.generate("long", "the dog", params)
        await generator.__anext__()
        await asyncio.to_thread(async_engine.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in generator:
                pass
        with pytest.raises(EngineDeadError):
            await async_engine.generate("late", "x", params).__anext__()

    asyncio.run(main())
    assert not async_engine.is_alive
