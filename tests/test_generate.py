"""Generation (``mode="inference"``): a causal LM's prefill and decode steps planned as
forward-only programs with a static KV cache, and ``generate()`` beside HuggingFace's.

One process here (the cache-aware zoo forwards, the HuggingFace twins, sampling's
filters against transformers' own, the API's errors, plans without processes); several
ranks through tests/generate_worker.py (tokens equal to ``transformers``' ``generate`` on
one device, sampling reproducible across runs and rank counts, the collectives the plans
list) and tests/load_worker.py (a model on ``meta`` filled from a sharded snapshot, each
rank's peak host memory near its share).
"""

from __future__ import annotations

import json

import pytest
import torch
import worker_io

import torchalpa
from torchalpa.models import GPT, GPTConfig, Llama, LlamaConfig
from torchalpa.models.kv_cache import KVCache
from torchalpa.runtime.serving.sampling import HF_DEFAULTS, Sampling, next_tokens, resolve_sampling

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_process_world")   # conftest.py


def _zoo(kind: str):
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(max_seq_len=32, dropout=0.0)) if kind == "gpt" else \
        Llama(LlamaConfig.tiny(max_seq_len=32))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)          # decisive logits: greedy has no near-ties
    return model.eval()


def _left_padded(rows: int = 3, length: int = 6):
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (rows, length))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids.masked_fill(mask == 0, 0), mask


# -- the zoo's cache-aware forward and its HuggingFace twins ---------------------------------

@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_zoo_cached_forward_continues_the_full_forward(kind):
    from torchalpa.models.hf_twins import hf_twin
    model = _zoo(kind)
    twin = hf_twin(model).eval()
    ids, mask = _left_padded()
    with torch.no_grad():
        assert torch.allclose(model(ids), twin(ids).logits, atol=1e-5)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        full = twin(ids, attention_mask=mask, position_ids=positions).logits   # (B, T, V)
        c = model.config
        shape = (3, c.num_heads if kind == "gpt" else c.num_kv_heads, 10, c.hidden // c.num_heads)
        keys = [torch.zeros(shape) for _ in range(c.num_layers)]
        values = [torch.zeros(shape) for _ in range(c.num_layers)]
        valid = torch.zeros(3, 10, dtype=torch.bool)
        valid[:, :6] = mask.bool()
        out = model(ids[:, :4], cache=KVCache(keys, values, torch.tensor(0), valid,
                                              positions[:, :4]))
        real = mask[:, :4].bool()                     # padding's outputs are never read
        assert torch.allclose(out[real], full[:, :4][real], atol=1e-4)
        for t in (4, 5):                              # one token at a time, on the cache
            out = model(ids[:, t:t + 1], cache=KVCache(keys, values, torch.tensor(t), valid,
                                                       positions[:, t:t + 1]))
            assert torch.allclose(out[:, 0], full[:, t], atol=1e-4)


# -- sampling means what it means to transformers -------------------------------------------

@pytest.mark.parametrize("settings", [dict(temperature=0.7), dict(top_k=5), dict(top_p=0.8),
                                      dict(temperature=1.3, top_k=20, top_p=0.5)])
def test_sampling_filters_and_draws_as_transformers(settings):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )
    torch.manual_seed(0)
    logits = torch.randn(4, 64) * 3
    s = Sampling(max_new_tokens=1, do_sample=True, **settings)
    warpers = LogitsProcessorList(
        ([TemperatureLogitsWarper(s.temperature)] if s.temperature != 1.0 else [])
        + ([TopKLogitsWarper(s.top_k)] if s.top_k else [])
        + ([TopPLogitsWarper(s.top_p)] if s.top_p < 1.0 else []))
    theirs = warpers(None, logits.clone())
    torch.manual_seed(3)
    want = torch.multinomial(theirs.softmax(-1), num_samples=1).squeeze(1)
    torch.manual_seed(3)
    assert torch.equal(next_tokens(logits, s), want)
    greedy = Sampling(max_new_tokens=1)
    assert torch.equal(next_tokens(logits, greedy), logits.argmax(-1))


def test_generate_arguments_resolve_as_transformers_defaults_them():
    s = resolve_sampling({}, None, prompt_length=6)
    assert (s.max_new_tokens, s.do_sample) == (HF_DEFAULTS["max_length"] - 6, False)
    config = transformers.GenerationConfig(do_sample=True, temperature=0.5, eos_token_id=7)
    s = resolve_sampling({"max_new_tokens": 4, "top_p": 0.9}, config, prompt_length=6)
    assert (s.do_sample, s.temperature, s.top_k, s.top_p) == (True, 0.5, 50, 0.9)
    assert (s.eos_token_ids, s.pad_token_id) == ((7,), 7)    # pad falls back to eos
    with pytest.raises(NotImplementedError, match="num_beams"):
        resolve_sampling({"num_beams": 4}, None, prompt_length=6)
    assert resolve_sampling({"num_beams": 1}, None, prompt_length=6).max_new_tokens == 14
    with pytest.raises(ValueError, match="temperature must be > 0"):
        resolve_sampling({"temperature": 0.0, "max_new_tokens": 2}, None, prompt_length=6)
    with pytest.raises(ValueError, match="nothing to generate"):
        resolve_sampling({"max_length": 6}, None, prompt_length=6)


# -- one process: the whole path, against transformers ---------------------------------------

@pytest.fixture(scope="module")
def one_rank_llama():
    """An HF Llama built for generation on this one process, and a copy for reference."""
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ref = transformers.LlamaForCausalLM(config).eval()
    ref.load_state_dict(model.state_dict())
    ids, _ = _left_padded(rows=4)
    pm = torchalpa.auto_parallel(model, ids, mode=torchalpa.Inference(max_context=20))
    return pm, ref


def test_one_rank_generates_what_transformers_generates(one_rank_llama):
    pm, ref = one_rank_llama
    ids, mask = _left_padded()
    got = pm.generate(ids, attention_mask=mask, max_new_tokens=8)
    assert torch.equal(got, ref.generate(ids, attention_mask=mask, max_new_tokens=8))
    assert pm.plan.mode == "inference" and json.loads(pm.plan.to_json())["mode"] == "inference"
    # the cache is written where it lies: one in-place write per key and value per layer
    assert pm.local_program().count("aten.index_put_.default(") == 2 * 2
    torch.manual_seed(4)
    sampled = pm.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=10)
    torch.manual_seed(4)
    assert torch.equal(sampled, ref.generate(ids, attention_mask=mask, max_new_tokens=8,
                                             do_sample=True, top_k=10))


def test_eos_finishes_rows_and_pads_them_as_transformers(one_rank_llama):
    pm, ref = one_rank_llama
    ids, mask = _left_padded()
    free = ref.generate(ids, attention_mask=mask, max_new_tokens=8)
    eos = int(free[0, 8])                  # row 0's third new token ends it
    kwargs = dict(attention_mask=mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=1)
    got = pm.generate(ids, **kwargs)
    assert torch.equal(got, ref.generate(ids, **kwargs))
    assert (got[0, 9:] == 1).all()


def test_limits_of_the_planned_cache_are_named(one_rank_llama):
    pm, _ = one_rank_llama
    ids, _ = _left_padded(rows=5)
    with pytest.raises(ValueError, match="a batch of 5 prompts does not fit the planned "
                                         "cache of 4 sequences"):
        pm.generate(ids, max_new_tokens=2)
    ids, _ = _left_padded(rows=2, length=12)
    with pytest.raises(ValueError, match=r"needs 22 cache slots, but the cache holds "
                                         r"max_context=20 tokens per sequence"):
        pm.generate(ids, max_new_tokens=10)


def test_a_context_beyond_the_model_positions_is_refused():
    model = _zoo("llama")
    ids, _ = _left_padded()
    with pytest.raises(ValueError, match="max_context=64 exceeds the 32 positions Llama has"):
        torchalpa.auto_parallel(model, ids, mode=torchalpa.Inference(max_context=64))


def test_generate_on_a_model_wrapped_for_training_says_how_to_wrap_for_inference():
    model = _zoo("gpt")
    ids, _ = _left_padded()
    pm = torchalpa.auto_parallel(model, (ids, ids.clone()), torchalpa.models.lm_loss)
    with pytest.raises(ValueError, match=r"wrapped for training .* mode='inference'"):
        pm.generate(ids, max_new_tokens=2)


def test_options_that_mean_nothing_for_generation_are_refused():
    model = _zoo("gpt")
    ids, _ = _left_padded()
    with pytest.raises(ValueError, match="has no loss"):
        torchalpa.plan(model, (ids, ids), torchalpa.models.lm_loss, mode="inference")
    with pytest.raises(ValueError, match="optimizer do"):
        torchalpa.auto_parallel(model, ids, mode="inference", optimizer=torch.optim.SGD)
    with pytest.raises(ValueError, match="use ShardParallel"):
        torchalpa.plan(model, ids, method=torchalpa.PipeshardParallel(), mode="inference")
    with pytest.raises(ValueError, match="mode must be one of"):
        torchalpa.plan(model, ids, mode="serving")
    with pytest.raises(TypeError, match="causal LM"):
        torchalpa.plan(torch.nn.Linear(4, 4), ids, mode="inference")


# -- planning without processes ---------------------------------------------------------

def test_an_inference_plan_reports_memory_and_token_time_per_device():
    with torch.device("meta"):
        model = Llama(LlamaConfig.tiny(max_seq_len=64))
    ids = torch.empty(8, 16, dtype=torch.int64, device="meta")
    plan = torchalpa.plan(model, ids, mode="inference", cluster=torchalpa.Cluster.h100(1, 2))
    est = plan.estimates
    assert plan.mode == "inference"
    c = model.config
    cache_whole = 2 * c.num_layers * 8 * c.num_kv_heads * 64 * c.head_dim * 4   # fp32
    assert cache_whole / 2 <= est["kv_cache_bytes_per_device"] <= cache_whole
    assert est["tokens_per_s"] == pytest.approx(8 / est["token_latency_s"])
    assert est["prefill_time_s"] > 0 and est["weight_bytes_per_device"] > 0
    assert any("generation: a cache of 8 sequences x 64 tokens" in n for n in plan.notes)
    again = torchalpa.Plan.from_json(plan.to_json())
    assert again.mode == "inference" and again.estimates == est
    x = torch.empty(8, 4, device="meta")
    training = torchalpa.plan(torch.nn.Linear(4, 4, device="meta"), (x, x),
                              torch.nn.functional.mse_loss)
    assert json.loads(training.to_json())["mode"] == "training"


# -- several ranks: tests/generate_worker.py ------------------------------------------------

def _launch(nproc: int, scenarios: list[str], tmp_path) -> dict:
    return worker_io.launch("generate_worker.py", tmp_path / f"generate_{nproc}.json",
                            ",".join(scenarios), nproc=nproc, timeout=1800, timeout_env="300")


def _check(r: dict, scenario: str) -> None:
    assert "error" not in r, f"{scenario}:\n{r.get('trace')}"
    assert r["mode"] == "inference"
    assert r["tokens"] == r["expected"], f"{scenario}: not the tokens transformers generates"
    assert r["again"] == r["tokens"], f"{scenario}: the same seed gave other tokens"
    assert r["executed"] == r["planned"], f"{scenario}: other collectives than the plans list"
    # each rank holds its blocks of the cache, never the whole (several ranks: a share)
    assert r["cache_bytes"] < r["cache_whole_bytes"]


# make test: two ranks, a HuggingFace model, 1D (the zoo GPT among the slow ones)
FAST = ["hf_llama:1d"]
# make test-all: every model on 2 ranks (1D) and on 4 (1D and 2x2), weights forced to
# shards, and sampling (compared across rank counts below)
SLOW_2 = ["hf_gpt2:1d", "hf_opt:1d", "gpt:1d", "llama:1d", "sample_llama:1d"]
SLOW_4 = ["hf_gpt2:1d", "hf_llama:2x2", "hf_opt:2x2", "gpt:2x2", "llama:1d",
          "sharded_llama:2x2", "sample_llama:1d", "sample_llama:2x2"]


def test_two_ranks_generate_what_transformers_generates(tmp_path):
    results = _launch(2, FAST, tmp_path)
    for scenario in FAST:
        _check(results[scenario], scenario)


@pytest.mark.slow
def test_two_and_four_ranks_1d_and_2d_generate_what_transformers_generates(tmp_path):
    two = _launch(2, SLOW_2, tmp_path)
    four = _launch(4, SLOW_4, tmp_path)
    for scenario in SLOW_2:
        _check(two[scenario], scenario)
    for scenario in SLOW_4:
        _check(four[scenario], scenario)
        if scenario.endswith("2x2"):
            assert four[scenario]["mesh"] == [2, 2]
    # no weight left whole when the option says so; the cache split on both axes; and the
    # weights are used where they lie: a step's all-gathers carry less than one rank's
    # quarter of the model (gathering the weights would send at least that)
    sharded = four["sharded_llama:2x2"]
    assert sharded["whole_params"] == []
    assert sharded["cache_bytes"] * 4 == sharded["cache_whole_bytes"]
    gathered = sum(b for kind, _, b in sharded["executed"] if kind == "all_gather")
    assert gathered / sharded["steps"] < sharded["weight_whole_bytes"] / 4
    # sampling with one seed: the same tokens on 2 ranks, 4 ranks (1D, 2x2) and one device
    sampled = [two["sample_llama:1d"]["tokens"], four["sample_llama:1d"]["tokens"],
               four["sample_llama:2x2"]["tokens"]]
    assert all(s == sampled[0] for s in sampled)


@pytest.mark.slow
def test_a_meta_model_loads_a_sharded_snapshot_within_its_share_of_host_memory(tmp_path):
    """4 ranks: each reads a quarter of a 200 MiB snapshot; its resident set grows by at
    most about that while loading (tests/load_worker.py)."""
    out = worker_io.launch("load_worker.py", tmp_path / "load.json", tmp_path / "snapshot",
                           "768", "8", nproc=4, timeout=1800, timeout_env="300")
    for rank, r in enumerate(out["ranks"]):
        assert "error" not in r, f"rank {rank}:\n{r.get('trace')}"
        assert r["info"] == {"missing_keys": [], "unexpected_keys": []}
        assert r["files"] == 4
        assert r["bytes_read"] == r["share_bytes"]          # its blocks, nothing more
        assert r["snapshot_bytes"] >= 3.9 * r["bytes_read"]  # a quarter of the model
        growth = r["peak_rss"] - r["rss_before"]
        assert growth <= 1.25 * r["share_bytes"] + 16 * 2 ** 20, r["report"]
        assert growth < r["snapshot_bytes"] / 2, r["report"]
        assert r["tokens"] == r["expected"]


def test_cache_writes_are_priced_as_the_entries_they_move():
    from torchalpa.parallel.generation import cached_step, capture_generation_step
    from torchalpa.passes.pricing.inplace_pricing import priced_in_place
    with torch.device("meta"):
        model = Llama(LlamaConfig.tiny(max_seq_len=64))
    step = cached_step(model, torch.empty(4, 8, dtype=torch.int64), torchalpa.Inference())
    graph = capture_generation_step(step, 1).graph
    priced = priced_in_place(graph)
    writes = [n for n in priced if n.op == "aten.index_put.default"]
    assert len(writes) == 2 * model.config.num_layers          # a key and a value per layer
    c = model.config
    entry = 4 * c.num_kv_heads * 1 * c.head_dim * 4            # one token's, fp32
    for n in writes:
        assert n.bytes == 2 * (entry + 8)                          # values and int64 slot
        assert graph.node(n.name).bytes > 64 * entry               # the whole cache, twice
