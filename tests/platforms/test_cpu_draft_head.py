"""The cpu platform's one-call forward of an EAGLE-family draft head (``draft_head_inputs`` and
the head's decoder stack), its greedy drafts and Gumiho's MLP heads in one call each, and the
compiled greedy verification: the modules' numbers bit for bit at every call of a run (serial
EAGLE, P-EAGLE's masked slots, Gumiho's serial and MLP heads), torch's argmax of the LM head's
logits, the numpy verifier's tokens; a greedy step's drafting in one ``greedy_head_drafts``
call, the same drafts as the modules' step for step; the modules where the one call does not
apply."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.testing.tiny_models import (
    TinyModelSpec,
    add_random_mtp_layer,
    write_random_eagle_head,
    write_random_gumiho_head,
    write_tiny_model,
)
from octavo_cpu import kernels, plugin
from octavo_cpu.draft_head import (
    DRAFT_WEIGHTS_ENV,
    DraftHeadPass,
    GumihoHeadPass,
    describe_draft_weights,
    draft_weights,
)
from octavo_cpu.rejection_sampler import greedy_verify, make_greedy_verify

OPS = kernels.load_kernels().ops
pytestmark = pytest.mark.skipif(OPS is None, reason="the compiled kernels do not run here")

# Prompts of 37, 5, 21 and 2 tokens, 24 tokens a step: prefill chunks mixed with decodes.
PROMPTS = [
    [1] + [(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((36, 4, 20, 1))
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("draft_head") / "model", TinyModelSpec())


def make_llm(folder, spec) -> LLM:
    return LLM(
        str(folder),
        kv_cache_memory="2MiB",
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        speculative_config={**spec, "adaptive": False},
    )


def generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


class BothWays:
    """A head's one call, checked: at every call the modules run, then the one call; each call
    records ``(kind, rows, any masked slot, whether they agreed)`` (the modules write a pass's
    KV first, the one call writes it again)."""

    def __init__(self, head):
        self.head, self.one_call, self.calls = head, head.head_pass, []
        head.head_pass = self

    def _modules(self, run):
        self.head.head_pass = None
        try:
            return run()
        finally:
            self.head.head_pass = self

    def __call__(self, input_ids, hidden, positions, metadata, masked=None):
        extra = {} if masked is None else {"masked": masked}
        expected = self._modules(lambda: self.head(input_ids, hidden, positions, metadata, **extra))
        got = self.one_call(input_ids, hidden, positions, metadata, masked)
        any_masked = masked is not None and bool(masked.any())
        self.calls.append(("pass", len(input_ids), any_masked, torch.equal(got, expected)))
        return expected

    def _logits(self, hidden):
        """The LM head the one call scores with: the target's, its weights rounded as the
        head's are kept."""
        weight = self.head.lm_head.weight.detach().to(draft_weights()).float()
        logits = torch.empty(len(hidden), weight.shape[0])
        OPS.linear(logits, hidden.contiguous(), OPS.pack_linear_weight(weight))
        return logits

    def compute_logits(self, hidden):
        expected = self._logits(hidden)
        got = self.one_call.compute_logits(hidden)
        self.calls.append(("logits", len(hidden), False, torch.equal(got, expected)))
        return expected

    def greedy_drafts(self, hidden):
        expected = self._logits(hidden).argmax(dim=-1)
        got = self.one_call.greedy_drafts(hidden)
        self.calls.append(("greedy", len(hidden), False, torch.equal(got, expected)))
        return expected

    def draft_in_parallel(self, last_drafts, hidden, count):
        expected = self._modules(lambda: self.head.draft_in_parallel(last_drafts, hidden, count))
        got = self.one_call.draft_in_parallel(last_drafts, hidden, count)
        self.calls.append(("mlp", len(last_drafts), False, torch.equal(got, expected)))
        return expected


def heads(target, tmp_path) -> dict:
    eagle = write_random_eagle_head(tmp_path / "eagle", target, seed=1)
    p_eagle = write_random_eagle_head(tmp_path / "p-eagle", target, seed=2, parallel_drafting=True)
    gumiho = write_random_gumiho_head(tmp_path / "gumiho", target, seed=3)
    p_eagle_2 = write_random_eagle_head(
        tmp_path / "p-eagle-2", target, seed=4, parallel_drafting=True, layers=2
    )
    eagle_2 = write_random_eagle_head(tmp_path / "eagle-2", target, seed=5, layers=2)
    return {
        "eagle": {"method": "eagle", "model": str(eagle), "num_speculative_tokens": 3},
        "eagle-2-layers": {"method": "eagle", "model": str(eagle_2), "num_speculative_tokens": 3},
        "p-eagle": {
            "method": "eagle",
            "model": str(p_eagle),
            "num_speculative_tokens": 3,
            "parallel_drafting": True,
        },
        "p-eagle-2-layers": {
            "method": "eagle",
            "model": str(p_eagle_2),
            "num_speculative_tokens": 3,
            "parallel_drafting": True,
        },
        "gumiho": {"method": "gumiho", "model": str(gumiho), "num_speculative_tokens": 4},
    }


@pytest.mark.parametrize(
    "method", ["eagle", "eagle-2-layers", "p-eagle", "p-eagle-2-layers", "gumiho"]
)
def test_the_one_call_gives_the_modules_hidden_states_bit_for_bit(target, tmp_path, method):
    llm = make_llm(target, heads(target, tmp_path)[method])
    head = llm.engine.core.runner.speculation.proposer.model
    assert isinstance(head.head_pass, GumihoHeadPass if method == "gumiho" else DraftHeadPass)
    calls = BothWays(head).calls
    generate(llm)
    assert len(calls) > 10 and all(equal for *_, equal in calls), calls
    assert any(kind == "pass" and rows > 4 for kind, rows, *_ in calls), "no prompt chunk pass"
    assert any(kind == "greedy" for kind, *_ in calls), "no greedy drafts"
    if method.startswith("p-eagle"):
        assert any(masked for _, _, masked, _ in calls), "no pass with masked slots"
    if method == "gumiho":
        assert any(kind == "mlp" for kind, *_ in calls), "no MLP heads' drafts"


def drafts_of_a_run(llm: LLM) -> list:
    """Every proposal of a greedy run of PROMPTS, and its tokens."""
    proposer = llm.engine.core.runner.speculation.proposer
    drafted = []

    def recorded(context, propose=proposer.propose):
        drafts, num_drafts = propose(context)
        drafted.append([row[:n].tolist() for row, n in zip(drafts, num_drafts)])
        return drafts, num_drafts

    proposer.propose = recorded
    return [generate(llm), drafted]


@pytest.mark.parametrize(
    "method", ["eagle", "eagle-2-layers", "p-eagle", "p-eagle-2-layers", "gumiho"]
)
def test_the_one_call_drafts_what_the_modules_draft_over_float32_weights(
    target, tmp_path, monkeypatch, method
):
    """Over float32 weights both paths score with the target's own LM head: a run drafts the
    same tokens step for step (the head's KV the one call writes is the modules'). Greedy steps
    run the pass and the drafts in one ``greedy_head_drafts`` call (a serial head's steps, the
    prediction Gumiho's MLP heads read, P-EAGLE's masked slots), the modules a kernel at a
    time."""
    monkeypatch.setenv(DRAFT_WEIGHTS_ENV, "float32")
    spec = heads(target, tmp_path)[method]
    with_one_call = make_llm(target, spec)
    modules = make_llm(target, spec)
    modules.engine.core.runner.speculation.proposer.model.head_pass = None
    head_pass = with_one_call.engine.core.runner.speculation.proposer.model.head_pass
    at_once = []  # (steps, parallel, MLP heads' drafts) of each call

    def counted(*args, run=head_pass.greedy_head_drafts, **kwargs):
        at_once.append((args[4], args[5], kwargs.get("mlp_drafts", 0)))
        return run(*args, **kwargs)

    head_pass.greedy_head_drafts = counted
    one_call_run, modules_run = drafts_of_a_run(with_one_call), drafts_of_a_run(modules)
    assert len(one_call_run[1]) > 5 and one_call_run == modules_run
    # EAGLE drafts its 3 serially, P-EAGLE its 3 from one pass, Gumiho its first 2 serially
    # and the other 2 from its MLP heads (all of them where every row drafts 4)
    expected = {
        "eagle": {(3, False, 0)},
        "eagle-2-layers": {(3, False, 0)},
        "p-eagle": {(3, True, 0)},
        "p-eagle-2-layers": {(3, True, 0)},
        "gumiho": {(2, False, 2), (2, False, 0)},
    }[method]
    assert len(at_once) > 5 and set(at_once) <= expected
    assert method != "gumiho" or (2, False, 2) in at_once


def test_an_mtp_layer_runs_its_modules(target, tmp_path):
    mtp_target = add_random_mtp_layer(write_tiny_model(tmp_path / "mtp", TinyModelSpec()))
    mtp = make_llm(mtp_target, {"method": "mtp", "num_speculative_tokens": 2})
    assert mtp.engine.core.runner.speculation.proposer.model.head_pass is None  # norms its inputs


@pytest.mark.parametrize("stored", ["bfloat16", "float32"])
def test_the_heads_weights_are_kept_as_asked_and_the_output_does_not_change(
    target, tmp_path, monkeypatch, stored
):
    monkeypatch.setenv(DRAFT_WEIGHTS_ENV, stored)
    spec = heads(target, tmp_path)["gumiho"]
    llm = make_llm(target, spec)
    head = llm.engine.core.runner.speculation.proposer.model
    products = [
        layer.quant_method.product_for(0, layer.weight.shape[0]).packed
        for layer in (head.fc, head.layers[0].self_attn.o_proj, head.parallel_heads[0].fc)
    ]
    assert {p.dtype for p in products} == {getattr(torch, stored)}
    plain = LLM(
        str(target),
        kv_cache_memory="2MiB",
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=24,
    )
    assert generate(llm) == generate(plain)  # lossless whatever the drafts


def test_an_unknown_draft_weight_dtype_is_refused(target, tmp_path, monkeypatch):
    monkeypatch.setenv(DRAFT_WEIGHTS_ENV, "float16")
    assert describe_draft_weights().startswith(f"not usable: {DRAFT_WEIGHTS_ENV}='float16'")
    with pytest.raises(ValueError, match=DRAFT_WEIGHTS_ENV):
        make_llm(target, heads(target, tmp_path)["eagle"])


def test_the_torch_path_runs_the_heads_modules(target, tmp_path, monkeypatch):
    monkeypatch.setattr(plugin, "load_kernels", lambda: kernels._load("torch"))
    llm = make_llm(target, heads(target, tmp_path)["eagle"])
    assert llm.engine.core.runner.speculation.proposer.model.head_pass is None


def test_the_compiled_greedy_verification_gives_the_numpy_verifiers_tokens():
    generator = torch.Generator().manual_seed(0)
    compiled = make_greedy_verify(OPS)
    for trial in range(200):
        k = torch.randint(
            0, 5, (int(torch.randint(1, 6, (1,), generator=generator)),), generator=generator
        ).numpy()
        vocab = int(torch.randint(1, 70, (1,), generator=generator))
        # few distinct values: ties, which both take the first index of
        logits = torch.randint(-3, 3, (int(k.sum()) + len(k), vocab), generator=generator)
        logits = logits.float()
        if trial % 7 == 0:
            logits[0, vocab // 2] = float("nan")
        best = logits.argmax(dim=-1)
        first = np.cumsum(k) - k
        drafts = []
        for r, count in enumerate(k.tolist()):  # mostly right drafts, some wrong ones
            for j in range(count):
                right = int(best[first[r] + r + j])
                wrong = torch.randint(0, vocab, (1,), generator=generator).item()
                drafts.append(right if torch.rand(1, generator=generator) < 0.7 else wrong)
        drafts = torch.tensor(drafts, dtype=torch.int64)
        expected = greedy_verify(drafts, k, logits)
        assert torch.equal(compiled(drafts, k, logits), expected), (k, logits, drafts)


def test_drafts_past_the_block_table_or_the_tokens_are_refused(target, tmp_path):
    llm = make_llm(target, heads(target, tmp_path)["eagle"])
    head_pass = llm.engine.core.runner.speculation.proposer.model.head_pass
    hidden = torch.zeros(2, TinyModelSpec().hidden_size)
    tokens = torch.ones(1, 40, dtype=torch.int32)
    one_block = torch.zeros(1, 1, dtype=torch.int32)  # positions 0 .. 15
    rows, first, verified = torch.tensor([0]), torch.tensor([13]), torch.tensor([2])

    def drafts(steps, first=first, tokens=tokens):
        return head_pass.greedy_head_drafts(
            hidden, rows, first, verified, steps, False, tokens, one_block, 16
        )

    with pytest.raises(RuntimeError, match="up to 16 need more than the 1 blocks"):
        drafts(3)  # the second head step writes position 16
    with pytest.raises(RuntimeError, match="outside the token table"):
        drafts(1, tokens=tokens[:, :15])  # the token after position 14 is not in it
    block, predicted = drafts(2)
    assert block.shape == (1, 2) and predicted.shape == (1, TinyModelSpec().hidden_size)


def test_a_quantized_lm_head_is_not_handed_to_the_float_gemm():
    """A GGUF target's LM head multiplies quantized rows (uint8): the one-call drafting scores
    its drafts only through a float32 GEMM packing, so it gets None and the modules score."""
    from types import SimpleNamespace

    from octavo_cpu.draft_head import _packed_lm_head

    def head_over(packed: torch.Tensor):
        product = SimpleNamespace(packed=packed)
        lm_head = SimpleNamespace(
            tp=SimpleNamespace(size=1),
            widened_weight=None,
            weight=torch.zeros(4, 2),
            packed=product,
        )
        return SimpleNamespace(lm_head=lm_head)

    floats = torch.zeros(8)
    assert _packed_lm_head(head_over(floats)) is floats
    assert _packed_lm_head(head_over(torch.zeros(4, 34, dtype=torch.uint8))) is None
