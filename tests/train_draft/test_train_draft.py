"""``octavo train-draft``: the head it trains is the head the engine runs (same weights, same
hidden states), it sees no later token, and a short run on a tiny model writes a head folder
that serves, with its loss going down and its acceptance measured."""

from __future__ import annotations

import json

import pytest
import torch

from octavo import LLM
from octavo.cli import main
from octavo.platform.types import AttentionMetadata
from octavo.spec_decode.eagle_head import head_config
from octavo.testing.tiny_models import TinyModelSpec, write_random_eagle_head, write_tiny_model
from octavo.train_draft.eagle import TrainableEagleHead

SPEC = TinyModelSpec("LlamaForCausalLM", hidden_size=64, num_hidden_layers=2, seed=5)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("train_draft") / "llama", SPEC)


def _trainable(target_dir, head_dir=None) -> TrainableEagleHead:
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target_dir).eval()
    config = head_config(json.loads((target_dir / "config.json").read_text()))
    head = TrainableEagleHead(LlamaConfig(**config), model)
    if head_dir is not None:
        head.load_state_dict(load_file(str(head_dir / "model.safetensors")))
    return head.eval()


def test_the_trained_head_sees_no_later_token(target):
    head = _trainable(target)
    ids, hidden = torch.randint(3, 500, (1, 12)), torch.randn(1, 12, SPEC.hidden_size)
    later = ids.clone()
    later[0, 8:] = 7
    with torch.no_grad():
        before, after = head(ids, hidden), head(later, hidden)
    assert torch.allclose(before[0, :8], after[0, :8], atol=1e-6)
    assert not torch.allclose(before[0, 8:], after[0, 8:])


def test_the_engine_runs_the_head_that_was_trained(target, tmp_path, monkeypatch):
    """The same checkpoint in the trainer's module and the engine's EagleHead on the paged
    cache: the same predicted hidden states."""
    monkeypatch.setenv("OCTAVO_CPU_DRAFT_WEIGHTS", "float32")  # the trained numbers
    head_dir = write_random_eagle_head(tmp_path / "head", target, seed=3)
    trained = _trainable(target, head_dir)
    llm = LLM(
        str(target),
        speculative_config={"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 2},
        kv_cache_memory="8MiB",
    )
    engine_head = llm.engine.core.runner.speculation.proposer.model
    num = 20
    ids = torch.randint(3, 500, (num,))
    hidden = torch.randn(num, SPEC.hidden_size)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, num], dtype=torch.int32),
        seq_lens=torch.tensor([num], dtype=torch.int32),
        block_table=torch.tensor([[0, 1]], dtype=torch.int32),  # an idle engine's free blocks
        slot_mapping=torch.arange(num),
        max_query_len=num,
        max_seq_len=num,
        num_actual_tokens=num,
    )
    with torch.no_grad():
        served = engine_head(ids, hidden, torch.arange(num), metadata)
        wanted = trained(ids[None], hidden[None])[0]
    torch.testing.assert_close(served, wanted, atol=1e-4, rtol=1e-4)


def _corpus(tmp_path):
    """A folder of 40 small Python files to train on."""
    data = tmp_path / "text"
    data.mkdir()
    for i in range(40):  # one file in twenty is held out, by a hash of its name
        (data / f"f{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 20)
    return data


def test_a_short_run_writes_a_head_that_serves(target, tmp_path):
    data = _corpus(tmp_path)
    out = tmp_path / "head"
    argv = ["train-draft", str(target), "--data", str(data), "--out", str(out), "--steps", "12"]
    argv += ["--batch-size", "2", "--window", "32", "--threads", "1", "--eval-prompts", "2"]
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    history = metrics["history"]
    assert history[-1]["loss"] < history[0]["loss"]
    assert metrics["data"]["held_out_files"] >= 1 and metrics["data"]["train_files"] >= 30
    acceptance = metrics["acceptance"]
    assert acceptance["k"] == 4 and len(acceptance["acceptance_per_position"]) >= 1
    assert (out / "loss_curve.png").stat().st_size > 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["EagleHead"]
    # --stop-after: the same schedule's first steps give the same losses
    again = tmp_path / "again"
    argv[argv.index(str(out))] = str(again)
    assert main([*argv, "--stop-after", "11"]) == 0
    rerun = json.loads((again / "metrics.json").read_text())

    def losses(entries):
        return [(e["step"], e["loss"], e["top1_agreement"]) for e in entries]

    assert losses(rerun["history"]) == losses(history[:2]) and rerun["acceptance"] is None


@pytest.mark.parametrize("layers", [1, 2])
def test_the_engine_runs_the_p_eagle_head_that_was_trained(target, tmp_path, monkeypatch, layers):
    """A pass anchored at t in the engine (real positions up to t, then masked slots, causal on
    the paged cache) predicts what the trainer's all-anchors pass predicts for anchor t, with
    one layer or more (a later layer's slot reads the earlier layers' outputs before it)."""
    monkeypatch.setenv("OCTAVO_CPU_DRAFT_WEIGHTS", "float32")  # the trained numbers
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from octavo.train_draft.p_eagle import TrainableParallelHead

    head_dir = write_random_eagle_head(
        tmp_path / "head", target, seed=4, parallel_drafting=True, layers=layers
    )
    config = head_config(json.loads((target / "config.json").read_text()), layers)
    trained = TrainableParallelHead(LlamaConfig(**config), LlamaForCausalLM.from_pretrained(target))
    trained.load_state_dict(load_file(str(head_dir / "model.safetensors")))
    spec = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 3}
    llm = LLM(str(target), speculative_config={**spec, "parallel_drafting": True})
    engine_head = llm.engine.core.runner.speculation.proposer.model
    anchor, depth, length = 9, 3, 14
    ids = torch.randint(3, 500, (length,))
    hidden = torch.randn(length, SPEC.hidden_size)
    num = anchor + depth  # real 0..anchor, masked anchor+1 .. anchor+depth-1
    masked = torch.arange(num) > anchor
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, num], dtype=torch.int32),
        seq_lens=torch.tensor([num], dtype=torch.int32),
        block_table=torch.tensor([[0, 1]], dtype=torch.int32),
        slot_mapping=torch.arange(num),
        max_query_len=num,
        max_seq_len=num,
        num_actual_tokens=num,
    )
    with torch.no_grad():
        # the masked slots read no hidden state rows
        real = hidden[:num][~masked]
        served = engine_head(ids[:num], real, torch.arange(num), metadata, masked=masked)
        wanted = trained.eval().forward_parallel(ids[None], hidden[None], depth)[0]
    for j in range(depth):
        torch.testing.assert_close(served[anchor + j], wanted[j, anchor], atol=1e-4, rtol=1e-4)


def _short_run(target, tmp_path, method: str):
    """``(head folder, metrics)`` of a 12-step ``--method`` run on a tiny corpus."""
    data = _corpus(tmp_path)
    out = tmp_path / "head"
    argv = ["train-draft", str(target), "--method", method, "--data", str(data)]
    argv += ["--out", str(out), "--steps", "12", "--batch-size", "2", "--window", "32"]
    assert main([*argv, "--threads", "1", "--eval-prompts", "2"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["method"] == method
    assert metrics["history"][-1]["loss"] < metrics["history"][0]["loss"]
    assert metrics["acceptance"]["k"] == 4
    return out, metrics


def test_a_short_p_eagle_run_writes_a_head_that_serves(target, tmp_path):
    out, metrics = _short_run(target, tmp_path, "p-eagle")
    assert len(metrics["history"][0]["top1_agreement"]) == 4  # one per draft depth
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as head:
        assert {"mask_embedding", "mask_hidden"} <= set(head.keys())


def test_the_engine_runs_the_gumiho_mlp_heads_that_were_trained(target, tmp_path, monkeypatch):
    """The same checkpoint in the trainer's MLP heads and the engine's: the same predictions
    from the same last drafts and hidden states."""
    monkeypatch.setenv("OCTAVO_CPU_DRAFT_WEIGHTS", "float32")  # the trained numbers
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from octavo.testing.tiny_models import write_random_gumiho_head
    from octavo.train_draft.gumiho import TrainableGumihoHead

    head_dir = write_random_gumiho_head(tmp_path / "head", target, num_parallel_heads=3, seed=5)
    config = json.loads((head_dir / "config.json").read_text())
    trained = TrainableGumihoHead(LlamaConfig(**config), LlamaForCausalLM.from_pretrained(target))
    trained.load_state_dict(load_file(str(head_dir / "model.safetensors")))
    spec = {"method": "gumiho", "model": str(head_dir), "num_speculative_tokens": 5}
    llm = LLM(str(target), speculative_config=spec, kv_cache_memory="8MiB")
    engine_head = llm.engine.core.runner.speculation.proposer.model
    ids, hidden = torch.randint(3, 500, (6,)), torch.randn(6, SPEC.hidden_size)
    with torch.no_grad():
        served = engine_head.draft_in_parallel(ids, hidden, 3)
        wanted = trained.eval().draft_in_parallel(ids[None], hidden[None])
    for i in range(3):
        torch.testing.assert_close(served[i], wanted[i][0], atol=1e-4, rtol=1e-4)


def test_a_short_gumiho_run_writes_a_head_that_serves(target, tmp_path):
    out, metrics = _short_run(target, tmp_path, "gumiho")
    assert len(metrics["history"][0]["top1_agreement"]) == 6  # 2 serial drafts, 4 parallel
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GumihoHead"] and config["num_parallel_heads"] == 4


def test_init_starts_a_p_eagle_head_from_an_eagle_head(target, tmp_path, capsys):
    """``--init``: the tensors both heads have start from the given head's (with a zero learning
    rate they are saved unchanged), the mask inputs from the seed; a head made for another
    target is refused."""
    from safetensors.torch import load_file

    init = write_random_eagle_head(tmp_path / "eagle", target, seed=6)
    data = _corpus(tmp_path)
    out = tmp_path / "p-eagle"
    argv = ["train-draft", str(target), "--method", "p-eagle", "--data", str(data)]
    argv += ["--steps", "2", "--stop-after", "1", "--batch-size", "2", "--window", "32"]
    argv += ["--threads", "1", "--lr", "0", "--init", str(init)]
    assert main([*argv, "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["init"]["from_seed"] == ["mask_embedding", "mask_hidden"]
    started = load_file(str(init / "model.safetensors"))
    saved = load_file(str(out / "model.safetensors"))
    assert sorted(started) == metrics["init"]["loaded"]
    for name, tensor in started.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0)

    config = json.loads((init / "config.json").read_text())
    (init / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    assert main([*argv, "--out", str(tmp_path / "refused")]) == 2
    assert "hidden_size 32" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_more_layers_than_the_init_head_start_as_the_identity(target, tmp_path, capsys):
    """``--layers 2 --init`` a one-layer head: the second layer starts with zero output
    projections, so the new head predicts what the init head does (its drafts to start from);
    ``--layers 0`` is refused."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from octavo.train_draft.p_eagle import TrainableParallelHead

    init = write_random_eagle_head(tmp_path / "one", target, seed=7, parallel_drafting=True)
    data = _corpus(tmp_path)
    out = tmp_path / "two"
    argv = ["train-draft", str(target), "--method", "p-eagle", "--data", str(data)]
    argv += ["--steps", "2", "--stop-after", "1", "--batch-size", "2", "--window", "32"]
    argv += ["--threads", "1", "--lr", "0", "--init", str(init)]
    assert main([*argv, "--out", str(out), "--layers", "2"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["init"]["identity_layers"] == [1]
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    model = LlamaForCausalLM.from_pretrained(target)
    target_config = json.loads((target / "config.json").read_text())
    predictions = []
    for folder, layers in ((init, 1), (out, 2)):
        head = TrainableParallelHead(LlamaConfig(**head_config(target_config, layers)), model)
        head.load_state_dict(load_file(str(folder / "model.safetensors")))
        with torch.no_grad():
            torch.manual_seed(0)
            ids, hidden = torch.randint(3, 500, (1, 10)), torch.randn(1, 10, SPEC.hidden_size)
            predictions.append(head.eval().forward_parallel(ids, hidden, 3))
    torch.testing.assert_close(predictions[0], predictions[1], rtol=0, atol=0)

    assert main([*argv, "--out", str(tmp_path / "none"), "--layers", "0"]) == 2
    assert "--layers is 0" in capsys.readouterr().err


def test_a_failed_acceptance_measurement_keeps_the_runs_metrics(target, tmp_path, monkeypatch):
    """The head and metrics.json (its history) are written before the held-out measurement."""
    import octavo.train_draft.cli as cli

    def fails(*args, **kwargs):
        raise RuntimeError("the measurement failed")

    monkeypatch.setattr(cli, "measure_acceptance", fails)
    data = _corpus(tmp_path)
    out = tmp_path / "head"
    argv = ["train-draft", str(target), "--data", str(data), "--out", str(out), "--steps", "2"]
    argv += ["--batch-size", "2", "--window", "32", "--threads", "1"]
    with pytest.raises(RuntimeError, match="the measurement failed"):
        main(argv)
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["history"]) == 2 and metrics["acceptance"] is None
    assert (out / "model.safetensors").is_file()
