"""Model exactness: chunked prefill == whole prefill, batched decode == solo decode."""

from __future__ import annotations

import pytest
import torch

from limiter.errors import InvalidArgument
from tests.support.torch_device import DEVICE, ON_GPU
from worker.model import PRESETS, ModelConfig, Transformer, build_model, preset

torch.set_num_threads(2)

ATOL = 1e-4
SMALL = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=160, max_seq_len=512)
SMALL_MHA = ModelConfig(n_layer=2, n_head=4, n_kv_head=None, d_model=64, d_ff=160, max_seq_len=512)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.fixture(scope="module", params=[SMALL, SMALL_MHA], ids=["gqa", "mha"])
def model(request: pytest.FixtureRequest) -> Transformer:
    return build_model(request.param, seed=7, device=DEVICE)


@pytest.mark.parametrize("chunk", [1, 3, 16, 37, 100])
def test_chunked_prefill_then_decode_matches_one_pass(model: Transformer, chunk: int) -> None:
    prompt, follow = _ids(100, 1), _ids(5, 2)
    with torch.inference_mode():
        whole_cache = model.new_cache(capacity=8)  # small start: exercises cache growth too
        whole = model.prefill(prompt, whole_cache)
        whole_dec = [model.decode(follow[i : i + 1], [whole_cache]) for i in range(5)]

        cache = model.new_cache(capacity=8)
        parts = [model.prefill(prompt[s : s + chunk], cache) for s in range(0, len(prompt), chunk)]
        dec = [model.decode(follow[i : i + 1], [cache]) for i in range(5)]
    torch.testing.assert_close(torch.cat(parts), whole, atol=ATOL, rtol=0)
    for a, b in zip(dec, whole_dec, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert cache.length == whole_cache.length == 105


@pytest.mark.skipif(not ON_GPU, reason="bf16 flash kernels: QOS_TEST_DEVICE=cuda (tests/gpu/check.sh)")
@pytest.mark.parametrize("cfg", [SMALL, SMALL_MHA], ids=["gqa", "mha"])
def test_chunked_prefill_matches_one_pass_in_the_gpus_bf16(cfg: ModelConfig) -> None:
    """The worker's dtype on a GPU, where SDPA picks other kernels than on a CPU for the same
    masks. bf16 rounds to ~3 significant digits, so agreement is judged against the logits'
    scale (a wrong mask or offset differs by the scale itself)."""
    m = build_model(cfg, seed=7, device=DEVICE, dtype=torch.bfloat16)
    prompt = _ids(300, 1)
    with torch.inference_mode():
        whole = m.prefill(prompt, m.new_cache(capacity=8))
        cache = m.new_cache(capacity=8)
        parts = torch.cat([m.prefill(prompt[s : s + 64], cache) for s in range(0, 300, 64)])
    scale = whole.abs().max().item()
    assert (parts - whole).abs().max().item() <= 0.03 * scale


def test_batched_decode_equals_each_sequence_alone(model: Transformer) -> None:
    lengths = [5, 40, 17, 1]
    steps = [_ids(len(lengths), 100 + i) for i in range(3)]
    with torch.inference_mode():
        batch_caches = [model.new_cache() for _ in lengths]
        solo_caches = [model.new_cache() for _ in lengths]
        for i, n in enumerate(lengths):
            model.prefill(_ids(n, i), batch_caches[i])
            model.prefill(_ids(n, i), solo_caches[i])
        for tokens in steps:
            batched = model.decode(tokens, batch_caches)
            for i in range(len(lengths)):
                alone = model.decode(tokens[i : i + 1], [solo_caches[i]])[0]
                torch.testing.assert_close(batched[i], alone, atol=ATOL, rtol=0)
    assert [c.length for c in batch_caches] == [n + 3 for n in lengths]


def test_attention_is_causal(model: Transformer) -> None:
    a, b = _ids(30, 3), _ids(30, 3).clone()
    b[20:] = (b[20:] + 1) % 256
    with torch.inference_mode():
        la = model.prefill(a, model.new_cache())
        lb = model.prefill(b, model.new_cache())
    torch.testing.assert_close(la[:20], lb[:20], atol=ATOL, rtol=0)
    assert not torch.allclose(la[20:], lb[20:], atol=ATOL)


def test_seeded_init_is_reproducible() -> None:
    a, b, c = (build_model(SMALL, seed=s, device=DEVICE) for s in (1, 1, 2))
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_a_cache_grows_by_doubling_up_to_its_limit_and_past_it_only_when_it_must(model: Transformer) -> None:
    """A cache's growth stops at its sequence's limit (prompt + max_tokens - 1): doubling past
    it allocated KV the sequence could never use. A sequence run past its limit grows on."""
    with torch.inference_mode():
        cache = model.new_cache(capacity=8, limit=40)
        model.prefill(_ids(9, 0), cache)  # 8 -> 16
        assert cache.capacity == 16
        model.prefill(_ids(20, 1), cache)  # 29 needed: 32
        assert cache.capacity == 32
        model.prefill(_ids(4, 2), cache)  # 33 needed: 40, not 64
        assert cache.capacity == 40
        model.prefill(_ids(8, 3), cache)  # 41 needed, past the limit: doubling again
        assert cache.capacity == 80 and cache.length == 41
        assert model.new_cache(capacity=64, limit=10).capacity == 10


def test_context_overflow_and_bad_inputs_raise(model: Transformer) -> None:
    with torch.inference_mode():
        cache = model.new_cache()
        model.prefill(_ids(510, 0), cache)
        with pytest.raises(InvalidArgument, match="max_seq_len"):
            model.prefill(_ids(3, 0), cache)
        assert cache.length == 510  # nothing was written
        with pytest.raises(InvalidArgument):
            model.prefill(torch.tensor([], dtype=torch.long, device=DEVICE), cache)
        with pytest.raises(InvalidArgument):
            model.decode(torch.tensor([1, 2], device=DEVICE), [cache])
        with pytest.raises(InvalidArgument):
            model.decode(torch.tensor([1, 2], device=DEVICE), [cache, cache])


@pytest.mark.parametrize(
    "overrides",
    [{"n_head": 3}, {"n_kv_head": 3}, {"n_layer": 0}, {"rope_theta": 0.0}, {"d_model": 72, "n_head": 8}],
)
def test_bad_config_is_rejected(overrides: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        preset("tiny", **overrides)
    with pytest.raises(InvalidArgument):
        preset("nope")


def test_presets_have_the_promised_sizes() -> None:
    tiny = build_model(PRESETS["tiny"], seed=0)
    assert sum(p.numel() for p in tiny.parameters()) == PRESETS["tiny"].num_params() < 10_000_000
    big = PRESETS["1b"]
    assert 0.9e9 < big.num_params() < 1.3e9
    assert big.kv_bytes_per_token(torch.bfloat16) == 32 * 1024
    assert big.max_seq_len >= 32768
