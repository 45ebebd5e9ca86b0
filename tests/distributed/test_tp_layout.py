"""The tensor-parallel layout without processes: how heads split or replicate, what cannot be
split, the rendezvous settings, and a rank reading only its shard of the checkpoint."""

from __future__ import annotations

import socket

import pytest
import torch

from octavo import LLM
from octavo.distributed.parallel import ParallelConfig
from octavo.errors import ConfigError
from octavo.model_executor.loader import iterate_checkpoint
from octavo.model_executor.model_config import ModelConfig
from octavo.models.layers.linear import TPGroup
from octavo.models.llama import LlamaForCausalLM
from octavo.platform.facade import Platform
from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model


def test_kv_heads_split_when_they_divide_and_replicate_when_ranks_outnumber_them():
    assert [TPGroup(2, r, object()).kv_heads(4) for r in range(2)] == [(0, 2), (2, 2)]
    assert [TPGroup(4, r, object()).kv_heads(2) for r in range(4)] == [
        (0, 1),
        (0, 1),
        (1, 1),
        (1, 1),
    ]
    with pytest.raises(ValueError, match="neither a divisor nor a multiple"):
        TPGroup(4, 0, object()).kv_heads(3)


def test_shapes_that_cannot_be_split_are_a_config_error_before_any_worker_starts(tmp_path):
    model = write_tiny_model(tmp_path / "m", TinyModelSpec(num_attention_heads=4))
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) is not divisible by 3"):
        LLM(str(model), tensor_parallel_size=3, kv_cache_memory="8MiB")
    odd = write_tiny_model(
        tmp_path / "odd",
        TinyModelSpec(num_attention_heads=6, num_key_value_heads=3, hidden_size=48),
    )
    with pytest.raises(ConfigError, match="num_key_value_heads \\(3\\) neither divides"):
        LLM(str(odd), tensor_parallel_size=2, kv_cache_memory="8MiB")


def test_a_node_other_than_0_is_refused_an_engine(tmp_path):
    model = write_tiny_model(tmp_path / "m", TinyModelSpec())
    with pytest.raises(ConfigError, match="runs tensor-parallel workers only"):
        LLM(str(model), tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=29999)


def test_rendezvous_settings_come_from_flags_then_the_environment(monkeypatch):
    from octavo.config import EngineArgs

    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29511")
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("NODE_RANK", "1")
    parallel = EngineArgs(model="m", tensor_parallel_size=4).parallel_config
    assert (parallel.master_addr, parallel.master_port, parallel.nnodes) == ("10.0.0.7", 29511, 2)
    assert list(parallel.local_ranks) == [2, 3]
    flags = EngineArgs(model="m", tensor_parallel_size=4, node_rank=0, master_port=29600)
    assert (flags.parallel_config.node_rank, flags.parallel_config.master_port) == (0, 29600)
    assert EngineArgs(model="m").parallel_config.nnodes == 1  # one rank: the env is not asked
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ConfigError, match="--master-port"):
        EngineArgs(model="m", tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="node_rank must be in"):
        EngineArgs(model="m", tensor_parallel_size=4, node_rank=2, master_port=1)


def test_a_rendezvous_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"rendezvous port {port} is in use"):
            ParallelConfig(2, master_port=port).with_rendezvous_port()
    free = ParallelConfig(2).with_rendezvous_port()
    assert free.master_port is not None and free.init_method.startswith("tcp://127.0.0.1:")


class _Recorded:
    """Wraps the checkpoint iterator, keeping each lazy tensor to read its count after."""

    def __init__(self, folder):
        self.tensors = {}
        self.folder = folder

    def __iter__(self):
        for name, tensor in iterate_checkpoint(self.folder):
            self.tensors[name] = tensor
            yield name, tensor


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_each_rank_reads_only_its_shard_and_the_shards_make_the_whole(tmp_path, kv_heads):
    spec = TinyModelSpec(num_attention_heads=4, num_key_value_heads=kv_heads)
    folder = write_tiny_model(tmp_path / "m", spec)
    platform = Platform.select("cpu")
    config = ModelConfig.from_folder(folder, dtype="float32")

    def load(tp: TPGroup):
        model = LlamaForCausalLM(config, platform, block_size=16, device="cpu", tp=tp)
        recorded = _Recorded(folder)
        model.load_weights(recorded)
        return model, {name: t.elements_read for name, t in recorded.tensors.items()}

    whole, _ = load(TPGroup())
    shards = [load(TPGroup(2, rank, communicator=object())) for rank in range(2)]
    full = {name: t.shape.numel() for name, t in iterate_checkpoint(folder)}
    for name, numel in full.items():
        read = [reads[name] for _, reads in shards]
        if "norm" in name:
            assert read == [numel, numel], name
        elif kv_heads == 1 and (".k_proj." in name or ".v_proj." in name):
            assert read == [numel, numel], name  # one KV head, replicated
        else:
            assert read == [numel // 2, numel // 2], name
    layer = "model.layers.0."
    params = [dict(model.named_parameters()) for model, _ in shards]
    whole_params = dict(whole.named_parameters())
    down = torch.cat([p[layer + "mlp.down_proj.weight"] for p in params], dim=1)
    assert torch.equal(down, whole_params[layer + "mlp.down_proj.weight"])
    embed = torch.cat([p["model.embed_tokens.weight"] for p in params])[: spec.vocab_size]
    assert torch.equal(embed, whole_params["model.embed_tokens.weight"])


def test_what_crosses_to_a_worker_pickles_whole(tmp_path):
    import pickle

    from octavo.errors import RequestError
    from octavo.structured_output.backend import LazyGrammarBackend

    error = pickle.loads(pickle.dumps(RequestError({"a": "bad seed", "b": "no token"})))
    assert error.messages == {"a": "bad seed", "b": "no token"} and error.request_ids == ["a", "b"]
    folder = write_tiny_model(tmp_path / "m", TinyModelSpec())
    config = ModelConfig.from_folder(folder, dtype="float32")
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config and dict(copy.hf_config) == dict(config.hf_config)
    with pytest.raises(TypeError):
        copy.hf_config["x"] = 1  # still read-only
    backend = pickle.loads(pickle.dumps(LazyGrammarBackend(None, 512, (2,), any_whitespace=True)))
    assert backend.any_whitespace is True
