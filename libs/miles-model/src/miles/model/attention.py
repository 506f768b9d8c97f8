"""Causal self-attention of one sequence segment against its keys, in two implementations.

Layout everywhere: queries (num_new, num_heads, head_dim); keys and values token-major
(num_keys, num_kv_heads, head_dim), where the last `num_new` keys belong to the queries and the first
`past_len` come from a KV cache. Token-major keys make every prefix `keys[:t]` the same strided view whether it
is cut from a KV-cache buffer or from a freshly computed tensor, which the exact path relies on.

- `fast_attention`: torch's scaled_dot_product_attention (grouped-query, causal offset by `past_len`).
- `exact_attention`: one query at a time over exactly its own `past_len + i + 1` keys, so the result for a
  query does not depend on how many queries or keys were computed with it (decode and prefill agree bit for
  bit). O(n) Python steps: meant for the deterministic mode and small models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812


def fast_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past_len: int, scale: float
) -> torch.Tensor:
    num_new, num_heads, head_dim = queries.shape
    num_keys = keys.shape[0]
    q = queries.transpose(0, 1).unsqueeze(0)
    k = keys.transpose(0, 1).unsqueeze(0)
    v = values.transpose(0, 1).unsqueeze(0)
    if past_len == 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=num_new > 1, scale=scale, enable_gqa=True)
    elif num_new == 1:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    else:
        key_pos = torch.arange(num_keys, device=keys.device)  # the mask must live where the keys do (CUDA)
        query_pos = past_len + torch.arange(num_new, device=keys.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(num_new, num_heads, head_dim)


def exact_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past_len: int, scale: float
) -> torch.Tensor:
    num_new, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    grouped = queries.reshape(num_new, num_kv_heads, num_heads // num_kv_heads, head_dim)
    outputs = []
    for i in range(num_new):
        num_keys = past_len + i + 1
        own_keys = keys[:num_keys].unsqueeze(2)
        own_values = values[:num_keys].unsqueeze(2)
        scores = (grouped[i].unsqueeze(0) * own_keys).sum(-1) * scale
        weights = torch.exp(scores - scores.amax(0, keepdim=True))
        numerator = (weights.unsqueeze(-1) * own_values).sum(0)
        denominator = weights.sum(0)
        outputs.append((numerator / denominator.unsqueeze(-1)).reshape(num_heads, head_dim))
    return torch.stack(outputs)
