"""A small Llama-style decoder-only transformer with a per-sequence KV cache.

One pure file in the spirit of nanoGPT's ``model.py``: RMSNorm, rotary position
embeddings (rotate-half form), grouped-query causal attention through
``torch.nn.functional.scaled_dot_product_attention``, a SwiGLU MLP. No I/O happens here;
the caller picks device and dtype, and weights come either from :func:`init_weights`
(seeded, so a random model is reproducible) or from a checkpoint loaded by the engine.

The two entry points are the two things continuous batching needs:

* :meth:`Transformer.prefill` runs a *chunk* of one sequence's prompt at whatever offset
  that sequence's :class:`KVCache` has reached, so a 32K prompt can be fed in 512-token
  slices interleaved with other requests' decode steps (chunked prefill).
* :meth:`Transformer.decode` runs one new token for each of several sequences of
  different lengths in one batched call; shorter caches are zero-padded and masked out.

Both go through the same ``_forward`` so chunked and whole-prompt processing compute the
same function; the tests check logits agree to fp32 tolerance.

Attention masks: a whole prompt at offset 0 uses SDPA's ``is_causal`` (flash kernels, no
mask tensor, so a one-shot 32K prefill does not allocate a 32K x 32K mask); a chunk at an
offset or a ragged decode batch passes an explicit boolean mask, because ``is_causal`` is
top-left aligned. Grouped-query attention uses SDPA's ``enable_gqa`` (torch >= 2.5).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from limiter.errors import InvalidArgument
from worker.tokenizer import VOCAB_SIZE


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters. ``n_kv_head=None`` means plain multi-head attention."""

    vocab_size: int = VOCAB_SIZE
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = 2
    d_model: int = 256
    d_ff: int = 704
    max_seq_len: int = 16384
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgument(name, f"{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise InvalidArgument("d_model", "d_model must split into n_head heads of even size (RoPE)")
        if self.n_kv_head is not None and (self.n_kv_head < 1 or self.n_head % self.n_kv_head):
            raise InvalidArgument("n_kv_head", "n_kv_head must be a positive divisor of n_head")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise InvalidArgument("rope_theta", "rope_theta and norm_eps must be > 0")

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV-cache bytes one token occupies: what capacity planning divides memory by."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.n_layer * self.kv_heads * self.head_dim * elem

    def num_params(self) -> int:
        attn = self.d_model * self.d_model * 2 + 2 * self.d_model * self.kv_heads * self.head_dim
        mlp = 3 * self.d_model * self.d_ff
        per_layer = attn + mlp + 2 * self.d_model
        return self.n_layer * per_layer + 2 * self.vocab_size * self.d_model + self.d_model


PRESETS: dict[str, ModelConfig] = {
    # Tests and the CPU demo: ~3.4M parameters, fast enough to prefill thousands of tokens
    # on two CPU cores in about a second.
    "tiny": ModelConfig(),
    # A ~1B-parameter Llama-3.2-1B-shaped model for one GPU: 16 layers, d_model 2048,
    # GQA 32/8 heads, 32K context (the original problem's long-prompt case). bf16 KV: 32 KiB/token.
    "1b": ModelConfig(
        n_layer=16,
        n_head=32,
        n_kv_head=8,
        d_model=2048,
        d_ff=8192,
        max_seq_len=32768,
        rope_theta=500000.0,
    ),
}


def preset(name: str, **overrides: object) -> ModelConfig:
    """Return the named preset, optionally with fields replaced."""
    if name not in PRESETS:
        raise InvalidArgument("model", f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)  # type: ignore[arg-type]


GROW_PAST_ROOM = 16  # tokens a cache grows beyond its need once its owner's KV has no room left


class KVCache:
    """Keys and values of one sequence, all layers, growing as tokens are appended.

    One object per sequence (rather than one batch-wide tensor) makes admission,
    completion and preemption O(1) bookkeeping: freeing a sequence is dropping its cache.
    Storage grows by doubling, so appends are amortised O(1), capped at ``limit``: the most
    tokens the sequence will hold (its prompt + max_tokens - 1: the last token generated is
    never fed back), ``max_seq_len`` when not known. Capped only at ``max_seq_len``, a cache
    doubled past what its sequence could use: the torch engine's caches held up to 1.65x the
    KV tokens the worker accounts (a review). A sequence that outgrows ``limit`` anyway
    (a caller past the max_tokens it gave) grows on by doubling, up to ``max_seq_len``.
    ``room`` (when given) says how many more token slots its owner's KV may allocate now: a
    doubling is cut to it, and past it a cache grows by GROW_PAST_ROOM tokens beyond its
    need (one copy per that many tokens, not one a step). Without it, caches whose prompt +
    max_tokens passed the engine's capacity together (a look-ahead request started on KV
    used) doubled to up to 2x the KV they used, past ``kv_capacity_tokens``. Now a cache
    takes slack only from the room left, and past it holds at most GROW_PAST_ROOM slots
    beyond its tokens; what caches took while there was room stays theirs (a cache never
    shrinks), so the bound is that slack plus the tokens held.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        capacity: int = 64,
        limit: int | None = None,
        room: Callable[[], int] | None = None,
    ) -> None:
        self.cfg = cfg
        self.length = 0
        self.room = room
        self.limit = cfg.max_seq_len if limit is None else max(1, min(limit, cfg.max_seq_len))
        cap = max(1, min(capacity, self.limit))
        shape = (cfg.n_layer, cfg.kv_heads, cap, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more tokens, or raise if the context would overflow."""
        need = self.length + extra
        if need > self.cfg.max_seq_len:
            raise InvalidArgument(
                "tokens", f"sequence would reach {need} tokens, over max_seq_len {self.cfg.max_seq_len}"
            )
        if need <= self.capacity:
            return
        most = self.limit if need <= self.limit else self.cfg.max_seq_len
        cap = min(most, max(need, 2 * self.capacity))
        if self.room is not None:
            cap = max(min(cap, self.capacity + self.room()), min(most, need + GROW_PAST_ROOM))
        # Keys, then values: each old buffer is dropped once copied, so growing holds one
        # buffer (half the cache) twice at most, not the old and the new cache whole.
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], old.shape[1], cap, old.shape[3]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
            del old, new


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 so bf16 activations do not lose range."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables for absolute ``positions`` (B, T) -> (B, 1, T, head_dim), in fp32.

    Computed from positions on every call (it is tiny) rather than from a cached table, so a
    chunk at any offset gets exactly the angles the whole-prompt pass would give it.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = positions.float()[..., None] * inv_freq  # (B, T, head_dim/2)
    angles = torch.cat((angles, angles), dim=-1)[:, None]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (i, i + d/2) of ``x`` (B, H, T, d) by the position angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd, kvh = cfg.head_dim, cfg.kv_heads
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * hd, bias=False)
        self.wk = nn.Linear(cfg.d_model, kvh * hd, bias=False)
        self.wv = nn.Linear(cfg.d_model, kvh * hd, bias=False)
        self.wo = nn.Linear(cfg.n_head * hd, cfg.d_model, bias=False)

    def forward(self, x: Tensor, layer: int, rope: tuple[Tensor, Tensor], ctx: _StepContext) -> Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, cfg.n_head, cfg.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        for i, cache in enumerate(ctx.caches):
            start = ctx.starts[i]
            cache.k[layer, :, start : start + t] = k[i]
            cache.v[layer, :, start : start + t] = v[i]
        if b == 1:
            end = ctx.ends[0]
            keys = ctx.caches[0].k[layer, None, :, :end]
            values = ctx.caches[0].v[layer, None, :, :end]
        else:  # ragged batch: left-aligned, zero-padded to the longest, padding masked out
            keys = x.new_zeros((b, cfg.kv_heads, ctx.max_end, cfg.head_dim))
            values = torch.zeros_like(keys)
            for i, cache in enumerate(ctx.caches):
                keys[i, :, : ctx.ends[i]] = cache.k[layer, :, : ctx.ends[i]]
                values[i, :, : ctx.ends[i]] = cache.v[layer, :, : ctx.ends[i]]
        # grouped-query attention: SDPA shares each KV head across its query heads itself,
        # without materialising repeated keys (that copy dominated CPU decode steps)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=ctx.mask, is_causal=ctx.causal, enable_gqa=cfg.kv_heads != cfg.n_head
        )
        return self.wo(out.transpose(1, 2).reshape(b, t, cfg.n_head * cfg.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w_down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: Tensor, layer: int, rope: tuple[Tensor, Tensor], ctx: _StepContext) -> Tensor:
        x = x + self.attn(self.attn_norm(x), layer, rope, ctx)
        return x + self.mlp(self.mlp_norm(x))


@dataclass(frozen=True)
class _StepContext:
    """Where each batch row's new tokens go in its cache, and the attention mask."""

    caches: Sequence[KVCache]
    starts: list[int]
    ends: list[int]
    max_end: int
    mask: Tensor | None
    causal: bool


class Transformer(nn.Module):
    """The decoder. Call :meth:`prefill` / :meth:`decode` under ``torch.inference_mode()``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def new_cache(self, capacity: int = 64, limit: int | None = None,
                  room: Callable[[], int] | None = None) -> KVCache:
        """An empty cache on this model's device and dtype (``limit``, ``room``: :class:`KVCache`)."""
        p = self.embed.weight
        return KVCache(self.cfg, device=p.device, dtype=p.dtype, capacity=capacity, limit=limit, room=room)

    def prefill(self, token_ids: Tensor, cache: KVCache) -> Tensor:
        """Append ``token_ids`` (T,) to ``cache`` at offset ``cache.length``; return (T, vocab) logits.

        Row ``j`` of the result predicts the token after position ``cache.length + j``, so the
        last row of the final chunk gives the prompt's first generated token.
        """
        if token_ids.dim() != 1 or token_ids.numel() == 0:
            raise InvalidArgument("token_ids", "prefill takes a non-empty 1-D tensor of ids")
        return self._forward(token_ids[None], [cache])[0]

    def decode(self, token_ids: Tensor, caches: Sequence[KVCache]) -> Tensor:
        """One new token per sequence: ``token_ids`` (B,) -> (B, vocab) logits."""
        if token_ids.dim() != 1 or token_ids.numel() != len(caches) or not caches:
            raise InvalidArgument("token_ids", "decode takes one id per cache (1-D, same length)")
        return self._forward(token_ids[:, None], caches)[:, 0]

    def _forward(self, ids: Tensor, caches: Sequence[KVCache]) -> Tensor:
        b, t = ids.shape
        if len({id(c) for c in caches}) != len(caches):
            raise InvalidArgument("caches", "a sequence may appear only once in a batch")
        for cache in caches:
            cache.reserve(t)
        device = self.embed.weight.device
        starts = [c.length for c in caches]
        ends = [s + t for s in starts]
        max_end = max(ends)
        start_t = torch.tensor(starts, device=device)
        positions = start_t[:, None] + torch.arange(t, device=device)[None]  # (B, T)
        mask: Tensor | None = None
        causal = False
        if b == 1 and starts[0] == 0:
            causal = t > 1  # SDPA's is_causal is top-left aligned: right only at offset 0
        elif not (b == 1 and t == 1):
            # key j is visible to query i of row r iff j <= position(r, i); this also hides
            # the zero padding beyond a shorter row's end.
            key_pos = torch.arange(max_end, device=device)
            mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # (B, 1, T, S)
        ctx = _StepContext(caches, starts, ends, max_end, mask, causal)
        rope = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        x = self.embed(ids)
        for layer, block in enumerate(self.layers):
            x = block(x, layer, rope, ctx)
        for cache in caches:
            cache.length += t
        return self.lm_head(self.norm(x)).float()


def init_weights(model: Transformer, seed: int) -> Transformer:
    """Fill ``model`` with seeded random weights on its own device; returns it.

    GPT-2 style: N(0, 0.02), with the residual output projections scaled by
    1/sqrt(2 * n_layer) so the residual stream does not grow with depth. Norm gains are 1.
    The generator lives on the parameters' device, so the same seed gives the same model
    on a given device type (CPU and CUDA streams differ).
    """
    params = list(model.parameters())
    gen = torch.Generator(device=params[0].device)
    gen.manual_seed(seed)
    resid_std = 0.02 / math.sqrt(2 * model.cfg.n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("attn.wo.weight", "mlp.w_down.weight")):
                p.normal_(0.0, resid_std, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def build_model(
    cfg: ModelConfig, *, seed: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    """A seeded random model, allocated directly on ``device`` (no CPU detour for a 1B model)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device)
    init_weights(model, seed)
    return model.to(dtype).eval()
