"""The checksum /weights_checker reports: `miles.common.weights.weights_digest` over named tensors in one dtype.

Each tensor is converted to the requested dtype and hashed as its raw contiguous little-endian bytes, under its
Hugging Face name: the names the trainer's `named_parameters()` of the same `miles.model.CausalLM` gives (tied
embeddings: `model.embed_tokens.weight` only, no `lm_head.weight`). So a trainer, weight-sync and an engine
that hold the same values in that dtype compute the same digest. `exact` says whether the conversion lost
nothing: every value converted back equals the original bit for bit, so that a bfloat16 digest of float32
weights holding bfloat16 values means "these are exactly those weights".

Limits: conversions between floating dtypes only; a NaN payload that a conversion changes makes `exact` false;
the bytes are the CPU's own, so this assumes a little-endian CPU (x86, ARM), as safetensors does.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from miles.common.weights import tensor_sha256, weights_digest


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _round_trips(original: torch.Tensor, converted: torch.Tensor) -> bool:
    if converted.dtype == original.dtype:
        return True
    back = converted.to(original.dtype)
    return bool(torch.equal(back.reshape(-1).view(torch.uint8), original.contiguous().reshape(-1).view(torch.uint8)))


def named_tensors_checksum(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> tuple[str, bool]:
    """(digest, exact) of the tensors converted to `dtype`."""
    hashes: dict[str, str] = {}
    exact = True
    for name, tensor in tensors.items():
        converted = tensor.detach().to(dtype)
        exact = exact and _round_trips(tensor, converted)
        hashes[name] = tensor_sha256(_raw(converted))
    return weights_digest(hashes), exact
