"""Engine configuration: vLLM-compatible arguments, grouped into frozen configs.

``EngineArgs`` is what users pass (``LLM(model, **kwargs)`` or ``octavo serve`` flags, same names
as vLLM's); ``EngineArgs.validate()`` checks what can be checked before the model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Optional

from octavo.errors import ConfigError
from octavo.spec_decode.config import METHODS as SPECULATIVE_METHODS
from octavo.spec_decode.config import SpeculativeConfig

PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
DTYPES = ("auto", "float32", "bfloat16", "float16")
HASH_ALGOS = ("sha256", "fast")
QUANTIZATIONS = ("fp8", "int8")
GiB = 1 << 30


def parse_memory_size(text: str | int | None) -> Optional[int]:
    """``"4GiB"``, ``"512MiB"``, ``"2G"`` or a byte count -> bytes (None stays None)."""
    if text is None or isinstance(text, int):
        return text
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        if s and s[-1] in units:
            return int(float(s[:-1]) * units[s[-1]])
        return int(s)
    except ValueError:
        raise ConfigError(
            f"cannot read memory size {text!r}; write e.g. 4GiB, 512MiB or a byte count"
        ) from None


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size, memory budget, prefix caching, swap space."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.90
    kv_cache_memory: Optional[int] = None  # bytes; wins over gpu_memory_utilization
    swap_space: float = 4.0  # GiB of host memory for swapped-out blocks
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits and policies of the scheduler."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    max_model_len: Optional[int] = None  # None: the model's own context length
    num_lookahead_tokens: int = 0  # KV slots past the scheduled tokens (a draft model's drafts)
    max_loras: int = 0  # distinct LoRA adapters among running requests (0: LoRA is off)


def check_quantization(quantization: Optional[str]) -> Optional[str]:
    """``quantization`` if octavo supports it (None: no quantisation), else a ConfigError."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ConfigError(
            f"quantization {quantization!r} is not supported; supported: "
            f"{', '.join(QUANTIZATIONS)} (or leave it unset for none)"
        )
    return quantization


def json_object(text: str) -> dict:
    """An argparse type: a JSON object given on the command line."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"must be a JSON object like '{{\"temperature\": 0.5}}', got {text!r}"
        )
    return value


STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar")


def structured_outputs_config(value: Optional[dict]) -> dict:
    """vLLM's ``--structured-outputs-config`` with octavo's defaults filled in: ``backend``
    (auto or xgrammar, the one octavo has) and ``disable_any_whitespace`` (true: compact JSON
    unless a request asks otherwise; vLLM's default is false)."""
    config = {"backend": "auto", "disable_any_whitespace": True}
    if value is None:
        return config
    if not isinstance(value, dict):
        raise ConfigError(f"structured_outputs_config must be a dict; got {value!r}")
    unknown = sorted(set(value) - set(config))
    if unknown:
        raise ConfigError(
            f"structured_outputs_config.{unknown[0]} is not supported; known: {', '.join(config)}"
        )
    config.update(value)
    if config["backend"] not in STRUCTURED_OUTPUT_BACKENDS:
        raise ConfigError(
            "structured_outputs_config.backend must be one of "
            f"{', '.join(STRUCTURED_OUTPUT_BACKENDS)}; got {config['backend']!r}"
        )
    if not isinstance(config["disable_any_whitespace"], bool):
        raise ConfigError("structured_outputs_config.disable_any_whitespace must be true or false")
    return config


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """Everything that configures an engine, with vLLM's names and defaults."""

    model: Optional[str] = None
    tokenizer: Optional[str] = None
    served_model_name: Optional[str] = None
    dtype: str = "auto"
    device: Optional[str] = None
    seed: int = 0
    max_model_len: Optional[int] = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.90
    kv_cache_memory: Optional[int] = None
    swap_space: float = 4.0
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    nnodes: Optional[int] = None  # None: NNODES, else 1 (octavo.distributed.parallel)
    node_rank: Optional[int] = None  # None: NODE_RANK, else 0
    master_addr: Optional[str] = None  # None: MASTER_ADDR, else 127.0.0.1
    master_port: Optional[int] = None  # None: MASTER_PORT, else a free port (one node)
    enable_expert_parallel: bool = False  # refused: MoE experts are split by inner width
    quantization: Optional[str] = None
    enforce_eager: bool = True
    compile_cache_dir: Optional[str] = None  # --no-enforce-eager's compiled graphs on disk
    generation_config: str = "auto"
    override_generation_config: Optional[dict] = None
    speculative_config: Optional[SpeculativeConfig] = None  # or vLLM's dict / its JSON text
    structured_outputs_config: Optional[dict] = None  # vLLM's: backend, disable_any_whitespace
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None  # None: max_loras

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_memory", parse_memory_size(self.kv_cache_memory))
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config)
        )
        object.__setattr__(
            self,
            "structured_outputs_config",
            structured_outputs_config(self.structured_outputs_config),
        )
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError for any value that cannot work, saying what to change."""
        choices = {
            "dtype": DTYPES,
            "preemption_mode": PREEMPTION_MODES,
            "scheduling_policy": SCHEDULING_POLICIES,
            "prefix_caching_hash_algo": HASH_ALGOS,
        }
        for field, allowed in choices.items():
            if getattr(self, field) not in allowed:
                raise ConfigError(
                    f"{field} must be one of {', '.join(allowed)}; got {getattr(self, field)!r}"
                )
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size")
        for field in positive:
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                raise ConfigError(
                    f"{field} must be a positive integer; got {getattr(self, field)!r}"
                )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization!r}"
            )
        if self.swap_space < 0:
            raise ConfigError(f"swap_space must be >= 0 GiB; got {self.swap_space!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1; got {self.max_model_len!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ConfigError(
                "generation_config must be 'auto', 'vllm' or a folder path; "
                f"got {self.generation_config!r}"
            )
        if self.override_generation_config is not None and not isinstance(
            self.override_generation_config, dict
        ):
            raise ConfigError(
                "override_generation_config must be a dict (a JSON object on the command line), "
                f'e.g. {{"temperature": 0.5}}; got {self.override_generation_config!r}'
            )
        check_quantization(self.quantization)
        if self.enable_expert_parallel:
            raise ConfigError(
                "--enable-expert-parallel: expert parallelism is not built yet; drop it (under "
                "--tensor-parallel-size N every rank holds a share of each expert's inner width)"
            )
        _ = self.parallel_config  # resolving the layout checks it
        spec = self.speculative_config
        if self.enable_lora:
            self._check_lora()
        elif (self.max_loras, self.max_lora_rank, self.max_cpu_loras) != (1, 16, None):
            raise ConfigError(
                "--max-loras, --max-lora-rank and --max-cpu-loras size the LoRA slots: "
                "add --enable-lora, or drop them"
            )
        if self.tensor_parallel_size > 1 and spec is not None and spec.method != "ngram":
            raise ConfigError(
                f"speculative decoding by {spec.method!r} does not run with tensor parallelism "
                "yet (its draft model is not sharded): use the ngram method, or "
                "--tensor-parallel-size 1"
            )

    def _check_lora(self) -> None:
        """--enable-lora's flags, and the features it does not run with yet."""
        _ = self.lora_config  # checks max_loras, max_lora_rank, max_cpu_loras
        refused = {
            "--tensor-parallel-size > 1 (adapters are not sharded yet): use -tp 1": (
                self.tensor_parallel_size > 1
            ),
            "--no-enforce-eager (the compiled graph runs no LoRA deltas): drop it": (
                not self.enforce_eager
            ),
            "speculative decoding with a draft model or head (it drafts without the adapter): "
            "use the ngram method or none": (
                self.speculative_config is not None and self.speculative_config.method != "ngram"
            ),
        }
        for what, refuse in refused.items():
            if refuse:
                raise ConfigError(f"--enable-lora does not run with {what}")

    @property
    def lora_config(self):
        """The LoRA slots' configuration (:class:`octavo.lora.config.LoRAConfig`), or None
        without ``--enable-lora``."""
        if not self.enable_lora:
            return None
        from octavo.lora.config import LoRAConfig

        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    @property
    def parallel_config(self):
        """The tensor-parallel layout (:class:`octavo.distributed.parallel.ParallelConfig`)."""
        from octavo.distributed.parallel import ParallelConfig

        return ParallelConfig.from_args(self)

    @property
    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory=self.kv_cache_memory,
            swap_space=self.swap_space,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
        )

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's limits once the model's context length is known."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
            scheduling_policy=self.scheduling_policy,
            max_model_len=max_model_len,
            num_lookahead_tokens=self.num_lookahead_tokens,
            max_loras=self.max_loras if self.enable_lora else 0,
        )

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a proposer writes past the scheduled tokens: K for a draft model."""
        spec = self.speculative_config
        if spec is None or spec.method == "ngram":
            return 0
        return spec.num_speculative_tokens

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add vLLM-compatible flags (``--max-num-seqs``, ``--block-size``, ...) to a parser."""
        group = parser.add_argument_group("engine")
        group.add_argument("--tokenizer", default=None)
        group.add_argument("--served-model-name", default=None)
        group.add_argument("--dtype", default="auto", choices=DTYPES)
        group.add_argument("--device", default=None, help="platform to use (default: detected)")
        group.add_argument("--seed", type=int, default=0)
        group.add_argument("--max-model-len", type=int, default=None)
        group.add_argument("--block-size", type=int, default=16)
        group.add_argument("--gpu-memory-utilization", type=float, default=0.90)
        group.add_argument(
            "--kv-cache-memory",
            default=None,
            help="KV cache size, e.g. 4GiB (wins over --gpu-memory-utilization)",
        )
        group.add_argument(
            "--swap-space",
            type=float,
            default=4.0,
            help="GiB of host memory for swapped-out KV blocks",
        )
        group.add_argument(
            "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
        )
        group.add_argument("--prefix-caching-hash-algo", default="sha256", choices=HASH_ALGOS)
        group.add_argument("--max-num-seqs", type=int, default=256)
        group.add_argument("--max-num-batched-tokens", type=int, default=2048)
        group.add_argument(
            "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
        )
        group.add_argument("--preemption-mode", default="recompute", choices=PREEMPTION_MODES)
        group.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES)
        add_parallel_args(group)
        group.add_argument("--quantization", "-q", default=None, choices=[None, *QUANTIZATIONS])
        add_compile_args(group)
        group.add_argument(
            "--generation-config",
            default="auto",
            help="request defaults (temperature, top_k, top_p, min_p, repetition_penalty) and the "
            "max_new_tokens cap from the model's generation_config.json ('auto'), none ('vllm'), "
            "or a folder's",
        )
        group.add_argument(
            "--override-generation-config",
            type=json_object,
            default=None,
            help="JSON object of generation-config fields that win over the file's, "
            "e.g. '{\"temperature\": 0.5}'",
        )
        group.add_argument(
            "--structured-outputs-config",
            type=json_object,
            default=None,
            help='structured output, as vLLM\'s JSON: \'{"backend": "xgrammar", '
            '"disable_any_whitespace": false}\' lets JSON hold free whitespace (default: compact)',
        )
        group.add_argument(
            "--speculative-config",
            type=json_object,
            default=None,
            help="speculative decoding, as vLLM's JSON: "
            '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}\' or '
            '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\' '
            f"(methods: {', '.join(SPECULATIVE_METHODS)})",
        )
        add_lora_args(group)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names}
        values.update(overrides)
        return cls(**values)


def add_parallel_args(group) -> None:
    """The tensor-parallel and multi-node flags (:mod:`octavo.distributed.parallel`)."""
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="shard the model over this many worker processes (torch.distributed)",
    )
    group.add_argument(
        "--nnodes", type=int, default=None, help="nodes the ranks span (default: NNODES or 1)"
    )
    group.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this node's index; nodes other than 0 run workers only (default: NODE_RANK or 0)",
    )
    group.add_argument(
        "--master-addr",
        default=None,
        help="node 0's address for the rendezvous (default: MASTER_ADDR or 127.0.0.1)",
    )
    group.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="the rendezvous port (default: MASTER_PORT, else a free port on one node)",
    )
    group.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="refused: expert parallelism is not built (MoE experts split by inner width)",
    )


def add_lora_args(group) -> None:
    """``--enable-lora`` and the slots' sizes, as vLLM names them (the adapters themselves:
    ``octavo serve --lora-modules``, or a ``LoRARequest`` per offline call)."""
    group.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (PEFT folders) over the base model, many in one batch",
    )
    group.add_argument(
        "--max-loras", type=int, default=1, help="adapters in one batch (each takes a slot)"
    )
    group.add_argument(
        "--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted"
    )
    group.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept loaded in host memory beyond the batch's (default: --max-loras)",
    )


def add_compile_args(group) -> None:
    """``--enforce-eager`` / ``--no-enforce-eager`` and where compiled graphs are kept."""
    group.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the model eagerly (the default); --no-enforce-eager compiles its forward "
        "with torch.compile where the platform supports it (about a minute the first time)",
    )
    group.add_argument(
        "--compile-cache-dir",
        default=None,
        help="where --no-enforce-eager keeps its compiled graphs for later starts (default: "
        "TORCHINDUCTOR_CACHE_DIR, else ~/.cache/octavo/torch_compile)",
    )
