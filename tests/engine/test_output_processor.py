"""OutputProcessor: stop conditions, finish reasons, logprobs, output modes
and n > 1 aggregation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from octavo.engine.core_output import EngineCoreOutput
from octavo.model_executor.runner_output import StepLogprobs
from octavo.outputs import FinishReason, RequestOutput
from octavo.outputs.processor import OutputProcessor
from octavo.sampling_params import RequestOutputKind, SamplingParams
from octavo.testing.tokenizers import byte_level_bpe

BOS, EOS = 1, 2
CUMULATIVE, DELTA, FINAL = (
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.DELTA,
    RequestOutputKind.FINAL_ONLY,
)


@pytest.fixture(scope="module")
def bpe():
    return byte_level_bpe()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text).ids


def feed(processor, request_id, token_ids, per_step=1):
    """Feed tokens ``per_step`` at a time until the request finishes; all outputs and aborts."""
    outputs: list[RequestOutput] = []
    to_abort: list[str] = []
    for start in range(0, len(token_ids), per_step):
        result = processor.process_outputs(
            [EngineCoreOutput(request_id, token_ids[start : start + per_step])]
        )
        outputs += result.request_outputs
        to_abort += result.reqs_finished + result.reqs_aborted
        if outputs and outputs[-1].finished:
            break
    return outputs, to_abort


def shown_text(outputs: list[RequestOutput], kind: RequestOutputKind) -> str:
    """The text a user has seen after these outputs of one request with n == 1."""
    if kind == DELTA:
        return "".join(output.outputs[0].text for output in outputs)
    return outputs[-1].outputs[0].text if outputs else ""


def run(tokenizer, text_or_ids, per_step=1, prompt=(BOS,), **params):
    processor = OutputProcessor(tokenizer, eos_token_id=EOS)
    params.setdefault("max_tokens", 200)
    processor.add_request("r", list(prompt), SamplingParams(**params))
    ids = encode(tokenizer, text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    outputs, to_abort = feed(processor, "r", ids, per_step)
    assert not processor.has_unfinished_requests()
    return outputs, to_abort


@pytest.mark.parametrize("per_step", [1, 3, 100])
def test_stop_string_spanning_tokens_ends_the_output(bpe, per_step):
    ids = encode(bpe, "Hello world! STOP. The end.")
    assert "STOP" not in [bpe.decode([i]) for i in ids]  # the stop string spans tokens
    outputs, to_abort = run(bpe, ids, per_step, stop=["STOP"])
    final = outputs[-1].outputs[0]
    assert final.text == "Hello world! "
    assert (final.finish_reason, final.stop_reason) == ("stop", "STOP")
    # The token that completed the stop string is kept; everything after it is dropped.
    assert (
        bpe.decode(final.token_ids).endswith("STOP")
        and final.token_ids == ids[: len(final.token_ids)]
    )
    assert to_abort == ["r"]


def test_include_stop_str_in_output_keeps_it_and_drops_the_rest(bpe):
    outputs, _ = run(
        bpe, "Hello world! STOP. The end.", 100, stop=["STOP"], include_stop_str_in_output=True
    )
    assert outputs[-1].outputs[0].text == "Hello world! STOP"


def test_earliest_stop_string_wins_within_a_step(bpe):
    outputs, _ = run(bpe, "Hello world", 100, stop=["world", "lo w"])
    final = outputs[-1].outputs[0]
    assert (final.text, final.stop_reason) == ("Hel", "lo w")


ALPHABET = "aSTOP 日😀."


@settings(max_examples=120, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, min_size=1, max_size=30),
    stop=st.text(alphabet=ALPHABET, min_size=1, max_size=5),
    include=st.booleans(),
    per_step=st.integers(1, 3),
)
def test_streams_never_show_text_a_stop_string_later_removes(bpe, text, stop, include, per_step):
    ids = encode(bpe, text)
    index = text.find(stop)
    expected = text if index < 0 else text[: index + (len(stop) if include else 0)]
    texts = {}
    for kind in (DELTA, CUMULATIVE):
        outputs, _ = run(
            bpe,
            ids,
            per_step,
            stop=[stop],
            include_stop_str_in_output=include,
            max_tokens=len(ids),
            output_kind=kind,
        )
        for num_seen in range(1, len(outputs) + 1):
            shown = shown_text(outputs[:num_seen], kind)
            assert expected.startswith(shown), (shown, expected)  # nothing shown is ever retracted
        texts[kind] = shown_text(outputs, kind)
        assert outputs[-1].outputs[0].finish_reason == ("length" if index < 0 else "stop")
    assert texts[DELTA] == texts[CUMULATIVE] == expected


def test_partial_stop_string_is_held_back_then_released(bpe):
    processor = OutputProcessor(bpe, eos_token_id=EOS)
    processor.add_request(
        "r", [BOS], SamplingParams(stop=["STOP!"], output_kind=DELTA, max_tokens=50)
    )
    deltas = [o.outputs[0].text for o in feed(processor, "r", encode(bpe, "a STOP. a"))[0]]
    assert "STOP" not in "".join(deltas[:-2])  # held while it could still become "STOP!"
    assert "".join(deltas) == "a STOP. a"


def test_stop_token_ids_keep_the_token_but_not_its_text(bpe):
    bang = encode(bpe, "!")[0]
    ids = encode(bpe, "Hello world! more")
    outputs, to_abort = run(bpe, ids, stop_token_ids=[bang])
    final = outputs[-1].outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == ("Hello world", "stop", bang)
    assert final.token_ids[-1] == bang and to_abort == ["r"]
    outputs, _ = run(bpe, ids, stop_token_ids=[bang], include_stop_str_in_output=True)
    assert outputs[-1].outputs[0].text == "Hello world!"


def test_eos_stops_with_no_stop_reason_unless_ignored(bpe):
    ids = encode(bpe, "Hi there") + [EOS] + encode(bpe, " more")
    final = run(bpe, ids)[0][-1].outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == ("Hi there", "stop", None)
    assert final.token_ids[-1] == EOS
    final = run(bpe, ids, ignore_eos=True, max_tokens=len(ids))[0][-1].outputs[0]
    assert (final.text, final.finish_reason, final.token_ids) == ("Hi there more", "length", ids)


def test_min_tokens_delays_every_stop(bpe):
    ids = encode(bpe, "a STOP b STOP c")
    second_stop = len(encode(bpe, "a STOP b S"))
    final = run(bpe, ids + [EOS], stop=["STOP"], min_tokens=second_stop - 1)[0][-1].outputs[0]
    assert (final.text, final.stop_reason) == ("a STOP b ", "STOP")
    early_eos = [EOS] + ids + [EOS]
    final = run(bpe, early_eos, min_tokens=1)[0][-1].outputs[0]
    assert (
        final.token_ids == early_eos and final.text == "a STOP b STOP c"
    )  # the first EOS is the only one < min_tokens


@pytest.mark.parametrize("per_step", [1, 4])
def test_max_tokens_finishes_with_length(bpe, per_step):
    ids = encode(bpe, "The quick brown fox jumps over the lazy dog.")
    final = run(bpe, ids, per_step, max_tokens=5)[0][-1].outputs[0]
    assert (final.token_ids, final.finish_reason, final.stop_reason) == (ids[:5], "length", None)
    assert final.text == bpe.decode(ids[:5])


def test_max_model_len_caps_the_output(bpe):
    processor = OutputProcessor(bpe, eos_token_id=EOS, max_model_len=6)
    processor.add_request("r", [BOS, 5, 6], SamplingParams(max_tokens=None))
    outputs, to_abort = feed(processor, "r", encode(bpe, "Hello world! STOP."))
    assert (
        len(outputs[-1].outputs[0].token_ids) == 3
        and outputs[-1].outputs[0].finish_reason == "length"
    )


def test_abort_by_user_and_by_the_core(bpe):
    processor = OutputProcessor(bpe, eos_token_id=EOS)
    children = processor.add_request("u", [BOS], SamplingParams(n=2, output_kind=FINAL))
    processor.add_request("c", [BOS], SamplingParams())
    processor.process_outputs(
        [EngineCoreOutput("0_u", encode(bpe, "Hi")), EngineCoreOutput("c", [5])]
    )
    result = processor.abort_requests(["u", "unknown"])
    assert result.reqs_aborted == [child.request_id for child in children]
    [aborted] = result.request_outputs
    assert aborted.finished and [o.finish_reason for o in aborted.outputs] == ["abort", "abort"]
    assert aborted.outputs[0].text == "Hi"
    assert (
        processor.process_outputs([EngineCoreOutput("0_u", [5])]).request_outputs == []
    )  # late deltas ignored
    result = processor.process_outputs(
        [EngineCoreOutput("c", [6], finish_reason="abort")]
    )  # plain str works too
    assert result.reqs_finished == result.reqs_aborted == []  # the core already knows
    assert result.request_outputs[0].outputs[0].finish_reason == "abort"
    assert not processor.has_unfinished_requests()


def test_delta_cumulative_and_final_only_agree(bpe):
    ids = encode(bpe, "Once upon a time 日本 😀 STOP there")
    results = {
        kind: run(bpe, ids, 2, stop=["STOP"], output_kind=kind)[0]
        for kind in (DELTA, CUMULATIVE, FINAL)
    }
    final = results[CUMULATIVE][-1].outputs[0]
    assert final.text == "Once upon a time 日本 😀 "
    assert len(results[FINAL]) == 1 and results[FINAL][0].outputs[0] == final
    deltas = [o.outputs[0] for o in results[DELTA]]
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert all(len(o.outputs[0].token_ids) == 2 for o in results[DELTA][:-1])
    assert [o.finished for o in results[CUMULATIVE]] == [False] * (len(results[CUMULATIVE]) - 1) + [
        True
    ]


def test_n_samples_are_gathered_into_one_request_output(bpe):
    processor = OutputProcessor(bpe, eos_token_id=EOS)
    children = processor.add_request(
        "p", [BOS], SamplingParams(n=3, seed=7, output_kind=FINAL, stop=["STOP"])
    )
    assert [
        (c.request_id, c.index, c.sampling_params.seed, c.sampling_params.n) for c in children
    ] == [("0_p", 0, 7, 1), ("1_p", 1, 8, 1), ("2_p", 2, 9, 1)]
    streams = {
        "0_p": encode(bpe, "Hello world"),
        "1_p": encode(bpe, "a STOP b"),
        "2_p": encode(bpe, "日本") + [EOS],
    }
    outputs = []
    for step in range(max(map(len, streams.values()))):
        deltas = [
            EngineCoreOutput(rid, ids[step : step + 1])
            for rid, ids in streams.items()
            if step < len(ids)
        ]
        outputs += processor.process_outputs(deltas).request_outputs
    assert outputs == []  # FINAL_ONLY waits for every sample; sample 0 has no stop yet
    outputs = processor.process_outputs(
        [EngineCoreOutput("0_p", [], finish_reason=FinishReason.LENGTH)]
    ).request_outputs
    [result] = outputs
    assert result.finished and [o.index for o in result.outputs] == [0, 1, 2]
    assert [o.text for o in result.outputs] == ["Hello world", "a ", "日本"]
    assert [o.finish_reason for o in result.outputs] == ["length", "stop", "stop"]


def test_n_samples_stream_one_output_per_step(bpe):
    processor = OutputProcessor(bpe, eos_token_id=EOS)
    processor.add_request("p", [BOS], SamplingParams(n=2, output_kind=DELTA, max_tokens=2))
    first = processor.process_outputs(
        [EngineCoreOutput("0_p", [5]), EngineCoreOutput("1_p", [6])]
    ).request_outputs
    assert (
        len(first) == 1 and [o.index for o in first[0].outputs] == [0, 1] and not first[0].finished
    )
    second = processor.process_outputs([EngineCoreOutput("1_p", [7])]).request_outputs
    assert [o.index for o in second[0].outputs] == [1] and second[0].outputs[
        0
    ].finish_reason == "length"
    assert not second[0].finished  # sample 0 is still running
    third = processor.process_outputs([EngineCoreOutput("0_p", [8])]).request_outputs
    assert [o.index for o in third[0].outputs] == [0] and third[0].finished


def make_step_logprobs(logits: torch.Tensor, chosen: torch.Tensor, num_top: int) -> StepLogprobs:
    """What a runner reports: chosen token first, then the top ``num_top``, and the chosen rank."""
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    top = torch.topk(logprobs, num_top, dim=-1)
    chosen_logprobs = logprobs.gather(1, chosen[:, None])
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1
    return StepLogprobs(
        token_ids=torch.cat([chosen[:, None], top.indices], dim=1),
        logprobs=torch.cat([chosen_logprobs, top.values], dim=1),
        ranks=ranks,
    )


@pytest.mark.parametrize("num_logprobs", [0, 2, 5])
def test_sample_logprobs_follow_vllm_layout(bpe, num_logprobs):
    generator = torch.Generator().manual_seed(0)
    vocab = bpe.get_vocab_size()
    logits = torch.randn(6, vocab, generator=generator) * 3
    chosen = torch.tensor(
        [logits[0].argmax(), 100, 101, 102, 103, 104]
    )  # greedy first, then arbitrary
    processor = OutputProcessor(bpe, eos_token_id=EOS)
    processor.add_request("r", [BOS], SamplingParams(logprobs=num_logprobs, max_tokens=6))
    step = make_step_logprobs(logits, chosen, num_top=5)  # runners may send more than asked
    [output] = processor.process_outputs(
        [EngineCoreOutput("r", chosen.tolist(), new_logprobs=step)]
    ).request_outputs
    completion = output.outputs[0]
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert len(completion.logprobs) == 6
    for position, (token_id, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
        order = torch.argsort(reference[position], descending=True).tolist()
        assert next(iter(entries)) == token_id  # the chosen token comes first
        assert entries[token_id].rank == order.index(token_id) + 1
        assert set(entries) == {token_id, *order[:num_logprobs]}
        for candidate, logprob in entries.items():
            assert logprob.logprob == pytest.approx(reference[position, candidate].item())
            assert logprob.decoded_token == bpe.decode([candidate])
        top_ranks = sorted(entries[t].rank for t in order[:num_logprobs])
        assert top_ranks == list(range(1, num_logprobs + 1))
    expected = sum(reference[i, t].item() for i, t in enumerate(chosen.tolist()))
    assert math.isclose(completion.cumulative_logprob, expected, rel_tol=1e-9)


def test_logprobs_are_cut_with_the_tokens_on_stop(bpe):
    ids = encode(bpe, "Hi there") + [EOS] + encode(bpe, "x")
    logits = torch.randn(len(ids), bpe.get_vocab_size(), generator=torch.Generator().manual_seed(1))
    step = make_step_logprobs(logits, torch.tensor(ids), num_top=1)
    processor = OutputProcessor(bpe, eos_token_id=EOS)
    processor.add_request("r", [BOS], SamplingParams(logprobs=1, output_kind=DELTA))
    [output] = processor.process_outputs(
        [EngineCoreOutput("r", ids, new_logprobs=step)]
    ).request_outputs
    assert len(output.outputs[0].token_ids) == len(output.outputs[0].logprobs) == len(ids) - 1


def test_no_logprobs_requested_means_none(bpe):
    final = run(bpe, "Hi", max_tokens=1)[0][-1].outputs[0]
    assert final.logprobs is None and final.cumulative_logprob is None


def test_prompt_logprobs_arrive_in_chunks_with_a_leading_none(bpe):
    prompt = [BOS] + encode(bpe, "Hello world")
    logits = torch.randn(
        len(prompt) - 1, bpe.get_vocab_size(), generator=torch.Generator().manual_seed(2)
    )
    step = make_step_logprobs(logits, torch.tensor(prompt[1:]), num_top=3)
    first = StepLogprobs(step.token_ids[:2], step.logprobs[:2], step.ranks[:2])
    rest = StepLogprobs(step.token_ids[2:], step.logprobs[2:], step.ranks[2:])
    reference = torch.log_softmax(logits.double(), dim=-1)
    for kind in (DELTA, CUMULATIVE):
        processor = OutputProcessor(bpe, eos_token_id=EOS)
        processor.add_request(
            "r", prompt, SamplingParams(prompt_logprobs=2, output_kind=kind, max_tokens=2)
        )
        # A prefill chunk: prompt positions but no token yet, so nothing to show the user.
        assert (
            processor.process_outputs(
                [EngineCoreOutput("r", [], new_prompt_logprobs=first)]
            ).request_outputs
            == []
        )
        [output] = processor.process_outputs(
            [EngineCoreOutput("r", [5], new_prompt_logprobs=rest)]
        ).request_outputs
        prompt_logprobs = output.prompt_logprobs
        assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
        for position, entries in enumerate(prompt_logprobs[1:], start=1):
            assert next(iter(entries)) == prompt[position] and 2 <= len(entries) <= 3
            for candidate, logprob in entries.items():
                assert logprob.logprob == pytest.approx(reference[position - 1, candidate].item())
        [later] = processor.process_outputs([EngineCoreOutput("r", [6])]).request_outputs
        assert later.prompt_logprobs == (None if kind == DELTA else prompt_logprobs)


def test_without_a_tokenizer_there_is_no_text(bpe):
    # (stop strings without a tokenizer are refused by the InputProcessor, before this)
    processor = OutputProcessor(None, eos_token_id=EOS)
    processor.add_request("r", [BOS], SamplingParams(logprobs=1))
    step = make_step_logprobs(torch.randn(2, 10), torch.tensor([5, EOS]), num_top=1)
    [output] = processor.process_outputs(
        [EngineCoreOutput("r", [5, EOS], new_logprobs=step)]
    ).request_outputs
    completion = output.outputs[0]
    assert (completion.text, completion.token_ids, completion.finish_reason) == (
        "",
        [5, EOS],
        "stop",
    )
    assert all(
        lp.decoded_token is None for entries in completion.logprobs for lp in entries.values()
    )


def test_request_ids_must_be_unique(bpe):
    processor = OutputProcessor(bpe)
    processor.add_request("r", [BOS], SamplingParams())
    with pytest.raises(ValueError, match="already running"):
        processor.add_request("r", [BOS], SamplingParams())


def test_metrics_record_token_times(bpe):
    outputs, _ = run(bpe, "Hello world", max_tokens=3)
    metrics = outputs[-1].metrics
    assert metrics.num_generation_tokens == 3
    assert (
        metrics.arrival_time
        <= metrics.first_token_time
        <= metrics.last_token_time
        <= metrics.finished_time
    )
    # A gap per later step (a token a step here; two steps within one clock tick give one),
    # summing to the span from the first token to the last.
    assert 1 <= len(metrics.token_gaps) <= 2
    span = metrics.last_token_time - metrics.first_token_time
    assert sum(metrics.token_gaps) == pytest.approx(span)


@pytest.fixture(scope="module")
def stories260k(stories260k_path):
    """The real tokenizer and the recorded greedy continuations (reference_outputs.json).

    The ``tokenizers`` object is loaded directly (fast); the transformers wrapper of the same
    file is covered in test_detokenizer.py.
    """
    tokenizer = Tokenizer.from_file(str(stories260k_path / "tokenizer.json"))
    references = json.loads((stories260k_path / "reference_outputs.json").read_text())[
        "reference_outputs"
    ]
    return tokenizer, references


@pytest.mark.shared
@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE])
def test_stories260k_greedy_continuations_stream_to_the_reference_text(stories260k, kind):
    tokenizer, references = stories260k
    for reference in references:
        processor = OutputProcessor(tokenizer, eos_token_id=EOS)
        params = SamplingParams(max_tokens=len(reference["new_ids"]), output_kind=kind)
        processor.add_request("r", reference["prompt_ids"], params, prompt=reference["prompt"])
        outputs, _ = feed(processor, "r", reference["new_ids"])
        assert shown_text(outputs, kind) == reference["continuation"]
        assert (
            outputs[-1].prompt == reference["prompt"]
            and outputs[-1].outputs[0].finish_reason == "length"
        )


@pytest.mark.shared
def test_stories260k_stop_string_across_a_token_boundary(stories260k):
    tokenizer, references = stories260k
    reference = references[0]
    new_ids, continuation = reference["new_ids"], reference["continuation"]
    prompt_text = tokenizer.decode(reference["prompt_ids"], skip_special_tokens=True)
    # The last 2 characters of one token and the first 2 of the next.
    boundary = len(
        tokenizer.decode(reference["prompt_ids"] + new_ids[:20], skip_special_tokens=True)
    ) - len(prompt_text)
    stop = continuation[boundary - 2 : boundary + 2]
    assert len(stop) == 4 and stop not in [tokenizer.decode([i]) for i in new_ids]
    for kind in (DELTA, CUMULATIVE):
        processor = OutputProcessor(tokenizer, eos_token_id=EOS)
        processor.add_request(
            "r",
            reference["prompt_ids"],
            SamplingParams(max_tokens=64, stop=[stop], output_kind=kind),
        )
        outputs, to_abort = feed(processor, "r", new_ids)
        assert shown_text(outputs, kind) == continuation[: continuation.find(stop)]
        assert outputs[-1].outputs[0].stop_reason == stop and to_abort == ["r"]
