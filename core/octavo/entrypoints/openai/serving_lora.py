"""LoRA adapters over HTTP: the model cards ``/v1/models`` lists for them, and vLLM's
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``, refused unless runtime updates are
allowed (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, or ``OCTAVO_ALLOW_RUNTIME_LORA_UPDATING``, set
to 1 or true, as vLLM guards them)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from octavo.entrypoints.openai.errors import OpenAIError, bad_request
from octavo.entrypoints.openai.protocol import (
    LoadLoRAAdapterRequest,
    ModelCard,
    UnloadLoRAAdapterRequest,
)
from octavo.entrypoints.openai.serving_common import ServingContext
from octavo.errors import ConfigError

RUNTIME_UPDATING_ENVS = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "OCTAVO_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed(environ) -> bool:
    """Whether the environment allows loading and unloading adapters at run time."""
    return any(
        environ.get(name, "").strip().lower() in ("1", "true") for name in RUNTIME_UPDATING_ENVS
    )


def adapter_cards(ctx: ServingContext) -> list[ModelCard]:
    """One card per adapter served, its ``parent`` the base model."""
    return [
        ModelCard(
            id=name,
            root=lora.lora_path,
            parent=lora.base_model_name or ctx.config.served_model_name,
            max_model_len=ctx.max_model_len,
        )
        for name, lora in ctx.lora_registry.adapters.items()
    ]


def _check_allowed(ctx: ServingContext) -> None:
    if not ctx.config.allow_runtime_lora_updating:
        raise OpenAIError(
            "loading and unloading LoRA adapters at run time is off: start the server with "
            f"{RUNTIME_UPDATING_ENVS[0]}=1 (or {RUNTIME_UPDATING_ENVS[1]}=1)",
            404,
            code="runtime_lora_updating_disabled",
        )
    if not ctx.lora_registry.enabled:
        raise bad_request(
            "this server serves no LoRA adapters: start it with --enable-lora",
            param="lora_name",
            code="lora_disabled",
        )


async def load_lora_adapter(ctx: ServingContext, raw_request: Request) -> Response:
    """Serve one more adapter (checked against the base model first)."""
    _check_allowed(ctx)
    body = ctx.parse(LoadLoRAAdapterRequest, await raw_request.body())
    if body.lora_name == ctx.config.served_model_name:
        raise bad_request(
            f"{body.lora_name!r} is the base model's name; give the adapter another",
            param="lora_name",
        )
    if ctx.lora_registry.get(body.lora_name) is not None:
        raise bad_request(
            f"a LoRA adapter named {body.lora_name!r} is already loaded; unload it first",
            param="lora_name",
            code="lora_already_loaded",
        )
    try:
        ctx.lora_registry.add(body.lora_name, body.lora_path)
    except ConfigError as exc:
        raise bad_request(str(exc), param="lora_path", code="invalid_lora_adapter") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(ctx: ServingContext, raw_request: Request) -> Response:
    """Stop serving an adapter; refused while requests that use it are in flight."""
    _check_allowed(ctx)
    body = ctx.parse(UnloadLoRAAdapterRequest, await raw_request.body())
    lora = ctx.lora_registry.get(body.lora_name)
    if lora is None:
        raise OpenAIError(
            f"no LoRA adapter named {body.lora_name!r} is loaded",
            404,
            param="lora_name",
            code="lora_not_found",
        )
    if body.lora_int_id is not None and body.lora_int_id != lora.lora_int_id:
        raise bad_request(
            f"adapter {body.lora_name!r} has lora_int_id {lora.lora_int_id}, not "
            f"{body.lora_int_id}",
            param="lora_int_id",
        )
    in_flight = ctx.engine.lora_in_flight[lora.lora_int_id]
    if in_flight:
        raise bad_request(
            f"LoRA adapter {body.lora_name!r} has {in_flight} request(s) in flight; unload it "
            "once they finish",
            param="lora_name",
            code="lora_in_use",
        )
    ctx.lora_registry.remove(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
