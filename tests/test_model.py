"""model.py against transformers.LlamaForCausalLM on the same weights."""
import json
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import hf_config_dict, tiny_pair
import model as model_mod
from cpu import speed
from model import ModelLoadError, Seq, make_batch
from weights.loader import config_from_hf, load_model

TOL = 2e-4  # fp32 logits; observed differences are ~5e-6


def run_chunks(model, pool, ids, chunks, table, block_size):
    """Feed ids in the given chunk lengths through the paged cache; return logits of every position."""
    rows, start = [], 0
    for n in chunks:
        b = make_batch([Seq(ids[start:start + n], start, table, True)], block_size)
        b.logits_indices = torch.arange(n)
        rows.append(model(b, pool))
        start += n
    return torch.cat(rows)


def split(total, rng):
    chunks = []
    while total:
        n = rng.randint(1, total)
        chunks.append(n)
        total -= n
    return chunks


rope_st = st.sampled_from([None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                           {"rope_type": "linear", "factor": 2.0}])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kv_heads=st.sampled_from([1, 2, 4]), tied=st.booleans(), rope=rope_st,
       vocab=st.integers(5, 300), head_dim=st.sampled_from([4, 8, 16]), block_size=st.sampled_from([1, 3, 4, 16]),
       seq_len=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_logits_match_hf_prefill_and_decode(kv_heads, tied, rope, vocab, head_dim, block_size, seq_len, seed):
    ours, hf = tiny_pair(seed=seed, vocab=vocab, hidden=4 * head_dim, heads=4, kv_heads=kv_heads,
                         tied=tied, rope=rope)
    rng = random.Random(seed)
    ids = [rng.randrange(vocab) for _ in range(seq_len)]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    nblocks = -(-seq_len // block_size)
    table = rng.sample(range(nblocks + 5), nblocks)  # any physical ids, any order
    pool = torch.zeros(nblocks + 5, *ours.kv_block_shape(block_size))
    whole = run_chunks(ours, pool, ids, [seq_len], table, block_size)
    torch.testing.assert_close(whole, ref, atol=TOL, rtol=0)
    pool.zero_()
    stepwise = run_chunks(ours, pool, ids, split(seq_len, rng), table, block_size)  # chunks, then decodes
    torch.testing.assert_close(stepwise, ref, atol=TOL, rtol=0)
    pool.zero_()
    decode = run_chunks(ours, pool, ids, [1] * seq_len, table, block_size)
    torch.testing.assert_close(decode, ref, atol=TOL, rtol=0)


@settings(max_examples=25, deadline=None)
@given(block_size=st.integers(1, 9), lens=st.lists(st.integers(1, 20), min_size=1, max_size=5),
       seed=st.integers(0, 2**16), group_cost=st.sampled_from([0, 1, 16]),
       gather_bytes=st.sampled_from([0, 1 << 12, 4 << 20]), gather_min=st.sampled_from([1, 2]))
def test_paged_equals_dense_any_block_size_and_permutation(block_size, lens, seed, group_cost,
                                                           gather_bytes, gather_min):
    """Many sequences in one flat batch, scattered over permuted blocks, equal each run densely,
    whichever groups the decodes are split into (cost 0: one group per distinct width) and
    however the groups are sliced to bound the bytes they gather (0: GATHER_MIN a slice)."""
    old = model_mod.GROUP_COST_BLOCKS, speed.GATHER_BYTES, speed.GATHER_MIN
    model_mod.GROUP_COST_BLOCKS, speed.GATHER_BYTES = group_cost, gather_bytes
    speed.GATHER_MIN = gather_min
    try:
        check_paged_equals_dense(block_size, lens, seed)
    finally:
        model_mod.GROUP_COST_BLOCKS, speed.GATHER_BYTES, speed.GATHER_MIN = old


def test_decode_groups_are_sliced_to_the_gather_bound():
    """On the CPU a group whose K/V copy would exceed GATHER_BYTES a layer runs in as few slices
    within the bound as it takes (GATHER_MIN sequences if fewer fit), which cover its rows in
    order, their sizes within one of each other."""
    ours, _ = tiny_pair(seed=1)
    pool = torch.zeros(40, *ours.kv_block_shape(4))
    per_seq = 2 * pool[0, 0].nbytes  # two blocks of context each
    old, speed.GATHER_BYTES = speed.GATHER_BYTES, 3 * per_seq
    try:
        b = make_batch([Seq([5], 6, [2 * i, 2 * i + 1], True) for i in range(8)], 4)
        assert [(g.row, g.length) for g in b.decodes] == [(0, 8)]
        ours(b, pool)
        assert [(g.row, g.length) for g in b.decodes] == [(0, 2), (2, 3), (5, 3)]
        assert [g.block_tables.tolist() for g in b.decodes][1] == [[4, 5], [6, 7], [8, 9]]
        b = make_batch([Seq([5], 6, [2 * i, 2 * i + 1], True) for i in range(7)], 4)
        ours(b, pool)   # 7 in slices of 3 at most: 2, 2, 3, not 3, 3, 1
        assert [(g.row, g.length) for g in b.decodes] == [(0, 2), (2, 2), (4, 3)]
        speed.GATHER_BYTES = per_seq // 2  # not one sequence fits: GATHER_MIN (2) a slice
        b = make_batch([Seq([5], 6, [2 * i, 2 * i + 1], True) for i in range(6)], 4)
        ours(b, pool)
        assert [g.length for g in b.decodes] == [2, 2, 2] and speed.GATHER_MIN == 2
    finally:
        speed.GATHER_BYTES = old


def check_paged_equals_dense(block_size, lens, seed):
    ours, _ = tiny_pair(seed=1)
    rng = random.Random(seed)
    seqs = [[rng.randrange(97) for _ in range(n)] for n in lens]
    dense = []
    for s in seqs:  # dense: one sequence, one block holding everything
        pool = torch.zeros(1, *ours.kv_block_shape(64))
        dense.append(run_chunks(ours, pool, s, [len(s)], [0], 64))
    need = [-(-n // block_size) for n in lens]
    ids = rng.sample(range(sum(need) + 3), sum(need))
    tables, pos = [], 0
    for k in need:
        tables.append(ids[pos:pos + k])
        pos += k
    pool = torch.zeros(sum(need) + 3, *ours.kv_block_shape(block_size))
    done = [0] * len(seqs)
    got = [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs)):  # a mixed flat batch each step
        step = [(i, rng.randint(1, len(s) - done[i])) for i, s in enumerate(seqs) if done[i] < len(s)]
        b = make_batch([Seq(seqs[i][done[i]:done[i] + n], done[i], tables[i], True)
                        for i, n in step], block_size)
        logits = ours(b, pool)
        for row, (i, n) in enumerate(step):
            if n == 1:
                got[i].append(logits[row])
            else:  # rerun this chunk's interior rows is costly; check its last row
                got[i].append(None)
                got[i].extend([None] * (n - 2))
                got[i].append(logits[row])
            done[i] += n
    for i, s in enumerate(seqs):
        for p, row in enumerate(got[i]):
            if row is not None:
                torch.testing.assert_close(row, dense[i][p], atol=1e-5, rtol=0)


@given(widths=st.lists(st.integers(1, 12), max_size=9).map(sorted), cost=st.integers(0, 20))
def test_decode_groups_cover_in_order_at_least_cost(widths, cost):
    """The cut covers every decode once, in order, and no other cut at the distinct widths'
    boundaries pads fewer blocks plus `cost` per group (checked against all of them)."""
    ends = model_mod.decode_groups(widths, cost)
    assert ends == sorted(set(ends)) and (ends[-1:] == [len(widths)] if widths else ends == [])
    total = lambda cut: sum((e - s) * widths[e - 1] + cost for s, e in zip([0] + cut, cut))
    bounds = [i for i in range(1, len(widths)) if widths[i] != widths[i - 1]]
    for mask in range(1 << len(bounds)):
        cut = [b for k, b in enumerate(bounds) if mask >> k & 1] + [len(widths)] * bool(widths)
        assert total(ends) <= total(cut)


PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain what a KV cache is in one sentence.", "List three prime numbers."]


def test_embedded_smollm_greedy_matches_hf(smollm, smollm_hf):
    model, tok = smollm
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_dict=False)
        with torch.no_grad():
            ref = smollm_hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                     pad_token_id=0)[0, len(ids):].tolist()
        pool = torch.zeros(8, *model.kv_block_shape(16))
        table, start, toks, gen = [5, 2, 7, 0, 1, 3, 4, 6], 0, ids, []
        for _ in range(32):
            logits = model(make_batch([Seq(toks, start, table, True)], 16), pool)
            start += len(toks)
            toks = [int(logits[0].argmax())]
            gen.append(toks[0])
        assert gen == ref, (prompt, tok.decode(gen), tok.decode(ref))


def test_embedded_model_knows_paris(smollm):
    """Catches a wrong Q/K unpermutation, which HF on the same tensors would share."""
    model, tok = smollm
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                  return_dict=False)
    pool = torch.zeros(4, *model.kv_block_shape(16))
    start, toks, gen = 0, ids, []
    for _ in range(8):
        logits = model(make_batch([Seq(toks, start, [0, 1, 2, 3], True)], 16), pool)
        start += len(toks)
        toks = [int(logits[0].argmax())]
        gen.append(toks[0])
    assert "Paris" in tok.decode(gen)


# ---------------------------------------------------------------- loader errors

def write_checkpoint(path, cfg, tensors=None):
    from safetensors.torch import save_file
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors, str(path / "model.safetensors"))


def test_hf_dir_roundtrip(tmp_path):
    ours, hf = tiny_pair(seed=3)
    write_checkpoint(tmp_path / "ck", hf_config_dict(), {k: v.contiguous() for k, v in hf.state_dict().items()})
    loaded, tok = load_model(str(tmp_path / "ck"), "cpu", "float32")
    assert tok is None
    for (n, a), b in zip(ours.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), n


def test_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path), "cpu")


def test_missing_weights(tmp_path):
    write_checkpoint(tmp_path / "ck", hf_config_dict())
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path / "ck"), "cpu")


def test_missing_tensor_named(tmp_path):
    _, hf = tiny_pair()
    sd = {k: v.contiguous() for k, v in hf.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    write_checkpoint(tmp_path / "ck", hf_config_dict(), sd)
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(str(tmp_path / "ck"), "cpu")


def test_shape_mismatch_named(tmp_path):
    _, hf = tiny_pair()
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    sd["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(32, 31)
    write_checkpoint(tmp_path / "ck", hf_config_dict(), sd)
    with pytest.raises(ModelLoadError, match="shape mismatch.*o_proj"):
        load_model(str(tmp_path / "ck"), "cpu")


@pytest.mark.parametrize("field,value,match", [
    ("architectures", ["GPT2LMHeadModel"], "unsupported architecture"),
    ("hidden_act", "gelu", "hidden_act"),
    ("attention_bias", True, "attention_bias"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope scaling type 'yarn'"),
    ("num_key_value_heads", 3, "multiple of num_key_value_heads"),
])
def test_unsupported_config_fields(field, value, match):
    cfg = hf_config_dict()
    cfg[field] = value
    with pytest.raises(ModelLoadError, match=match):
        config_from_hf(cfg)


def test_missing_config_field():
    cfg = hf_config_dict()
    del cfg["hidden_size"]
    with pytest.raises(ModelLoadError, match="hidden_size"):
        config_from_hf(cfg)


def test_bad_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="x.gguf"):
        load_model(str(bad), "cpu")


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        load_model(None, "cpu", "float33")


def test_bf16_cpu_path_tracks_fp32(smollm):
    """The bfloat16 model (2x faster decoding on CPUs with AVX512-BF16) against fp32 on the same
    weights: every logit within 1.5, the top token the same at >= 90% of positions, and fp32's
    32-token greedy answer to the Paris prompt decoded through bf16 (teacher-forced) with bf16's
    top token the same at >= 29 steps and never below its third."""
    from conftest import share_weights
    model, tok = smollm
    bf16 = share_weights(model, torch.bfloat16)
    for k, prompt in enumerate(PROMPTS):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True, return_dict=False)
        logits = []
        for m, dtype in ((model, torch.float32), (bf16, torch.bfloat16)):
            b = make_batch([Seq(ids, 0, list(range(8)), True)], 16)
            b.logits_indices = torch.arange(len(ids))
            logits.append(m(b, torch.zeros(8, *m.kv_block_shape(16), dtype=dtype)))
        assert (logits[0] - logits[1]).abs().max() < 1.5
        assert (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean() >= 0.9
    # decode fp32's greedy answer through both (teacher-forced): bf16 picks fp32's token at >= 90%
    # of the steps and never ranks it below third (near-ties may flip with the hardware's bf16)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}],
                                  add_generation_prompt=True, return_dict=False)
    pools = [torch.zeros(8, *m.kv_block_shape(16), dtype=d) for m, d in
             ((model, torch.float32), (bf16, torch.bfloat16))]
    start, toks, same = 0, ids, 0
    for _ in range(32):
        b = lambda: make_batch([Seq(toks, start, list(range(8)), True)], 16)
        ref, low = model(b(), pools[0])[0], bf16(b(), pools[1])[0]
        start, toks = start + len(toks), [int(ref.argmax())]
        same += int(low.argmax()) == toks[0]
        assert toks[0] in low.topk(3).indices.tolist()
    assert same >= 29


@pytest.mark.parametrize("edit,match", [
    (lambda cfg: "{not json", "not valid JSON"),
    (lambda cfg: "[1, 2]", "expected a JSON object"),
    (lambda cfg: json.dumps(cfg | {"num_attention_heads": 0}), "num_heads must be positive"),
    (lambda cfg: json.dumps(cfg | {"vocab_size": "97"}), "vocab_size must be a positive integer"),
    (lambda cfg: json.dumps(cfg | {"rope_scaling": {"rope_type": "linear"}}),
     "rope_scaling.factor must be a positive number"),
    (lambda cfg: json.dumps(cfg | {"eos_token_id": "x"}), "eos_token_id"),
])
def test_malformed_config_json_is_named(tmp_path, edit, match):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text(edit(hf_config_dict()))
    with pytest.raises(ModelLoadError, match=match) as e:
        load_model(str(ck), "cpu")
    assert "config.json" in str(e.value)


def test_truncated_safetensors_is_named(tmp_path):
    _, hf = tiny_pair()
    write_checkpoint(tmp_path / "ck", hf_config_dict(), {k: v.contiguous() for k, v in hf.state_dict().items()})
    weights = tmp_path / "ck" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="model.safetensors: not a readable safetensors file"):
        load_model(str(tmp_path / "ck"), "cpu")


def test_gguf_by_a_bare_relative_name(tmp_path, monkeypatch):
    """LLM('model.gguf') from the file's own directory: the path is made absolute (the
    tokenizer comes from the file's own metadata, never from a directory or a hub)."""
    from weights import loader
    (tmp_path / "m.gguf").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    seen = []
    monkeypatch.setattr(loader, "load_gguf", lambda path, device, dtype: seen.append(path))
    load_model("m.gguf", "cpu", "float32")
    assert seen == [str(tmp_path / "m.gguf")]


# ---------------------------------------------------------------- packed CPU weights

@given(st.integers(1, 1 << 16))
def test_padded_rows_bounds_the_padding_and_the_shapes(m):
    """Rows pad up by less than a quarter, to one of at most four counts an octave past 8
    (oneDNN keeps state per shape, so the shapes must stay few)."""
    p = speed.padded_rows(m)
    assert m <= p and 4 * (p - m) < m and speed.padded_rows(p) == p
    lo = 1 << max(3, m.bit_length() - 1)
    octave = {speed.padded_rows(k) for k in range(lo, 2 * lo)}
    assert m <= 8 or len(octave) <= 5


def packed_pair(dtype):
    """A bias-free Linear and a copy of it packed for oneDNN."""
    torch.manual_seed(0)
    plain = model_mod.Linear(256, 96, bias=False).to(dtype).requires_grad_(False)
    packed = model_mod.Linear(256, 96, bias=False).to(dtype)
    packed.load_state_dict(plain.state_dict())
    speed.pack_weights(packed)
    return plain, packed


@pytest.mark.skipif(not speed.PACK_WEIGHTS, reason="no oneDNN in this torch build")
@pytest.mark.parametrize("widen", [False, True])
def test_bf16_linear_widened_to_fp32_gives_the_bf16_gemm(monkeypatch, widen):
    """Where the CPU has no bf16 GEMM the bf16 weights are packed as fp32 and multiplied in fp32:
    bf16 in, bf16 out, the products of the same bf16 values summed in fp32."""
    if not widen and speed.WIDEN_BF16:
        pytest.skip("this CPU has no native bf16 GEMM")
    monkeypatch.setattr(speed, "WIDEN_BF16", widen)
    plain, lin = packed_pair(torch.bfloat16)
    x = torch.randn(9, 256, dtype=torch.bfloat16)
    out = lin(x)
    exact = torch.nn.functional.linear(x.double(), plain.weight.double())
    assert out.dtype == torch.bfloat16 and out.shape == (9, 96)
    assert lin.weight.dtype == (torch.float32 if widen else torch.bfloat16)
    # within bf16's rounding of the exact sum (2^-8 relative), plus fp32 summation error
    assert torch.allclose(out.double(), exact, rtol=2 ** -8, atol=1e-4)


@pytest.mark.skipif(not speed.PACK_WEIGHTS, reason="no oneDNN in this torch build")
@pytest.mark.parametrize("dtype", speed.PACKABLE)
def test_packed_linear_matches_f_linear_and_keeps_one_copy(dtype):
    """The packed Linear gives F.linear's product at any row count, holds only the packed copy,
    and its state_dict() gives back the plain weight exactly (what tensor parallelism and a
    dtype change read)."""
    plain, lin = packed_pair(dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert lin.weight.is_mkldnn and [n for n, _ in lin.named_parameters()] == ["weight"]
    for m in (1, 3, 9, 17, 33, 130):
        x = torch.randn(m, 256, dtype=dtype)
        ref = torch.nn.functional.linear(x, plain.weight)
        out = lin(x)
        assert out.shape == (m, 96) and out.dtype == dtype
        assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol)
    state = lin.state_dict()["weight"]
    assert not state.is_mkldnn and state.dtype == dtype and torch.equal(state, plain.weight)
    speed.pack_weights(lin)                 # packing twice leaves the packed copy as it is
    assert torch.equal(lin.state_dict()["weight"], plain.weight)


def test_a_tied_head_gets_its_own_packed_copy_and_the_embedding_stays_plain():
    ours, _ = tiny_pair(seed=2, tied=True)
    assert ours.lm_head.weight is ours.embed.weight
    speed.pack_weights(ours)
    assert not ours.embed.weight.is_mkldnn
    assert ours.lm_head.weight.is_mkldnn == speed.PACK_WEIGHTS
    assert torch.equal(ours.state_dict()["lm_head.weight"], ours.embed.weight)


# ---------------------------------------------------------------- the converted GGUF and its tokenizer

def test_the_converted_gguf_holds_the_gguf_weights(smollm):
    """The model loaded from the cache (gguf_cache) has exactly the weights read from the GGUF."""
    from weights.loader import build_model, embedded_gguf_path, read_gguf
    cfg, tensors = read_gguf(embedded_gguf_path())
    direct = build_model(cfg, tensors, "cpu", torch.float32, "gguf").state_dict()
    cached = smollm[0].state_dict()
    assert direct.keys() == cached.keys()
    assert all(torch.equal(direct[k], cached[k]) for k in direct)


def test_the_cache_is_made_once_and_an_unwritable_one_is_said(tmp_path, monkeypatch, capsys):
    from weights import loader
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"stand-in bytes")
    made = []
    monkeypatch.setattr(loader, "export_hf", lambda out, path: made.append(
        (out, open(os.path.join(out, "config.json"), "w").close())))
    monkeypatch.setenv("SUPERINFER_CACHE", str(tmp_path / "cache"))
    first = loader.gguf_cache(str(gguf))
    assert "converting m.gguf once" in capsys.readouterr().err and len(made) == 1
    assert loader.gguf_cache(str(gguf)) == first and len(made) == 1
    assert capsys.readouterr().err == ""
    gguf.write_bytes(b"other bytes")            # a changed file is converted anew
    assert loader.gguf_cache(str(gguf)) != first and len(made) == 2
    monkeypatch.setenv("SUPERINFER_CACHE", str(gguf))     # a file where the folder would be
    assert loader.gguf_cache(str(gguf)) is None
    assert "cannot write the cache" in capsys.readouterr().err
    assert not [p for p in os.listdir(tmp_path / "cache") if p.startswith(".")]  # no leftovers


@pytest.fixture(scope="module")
def hf_tokenizer():
    """transformers' tokenizer converted from the GGUF itself: what ours must reproduce."""
    from weights.loader import embedded_gguf_path, gguf_tokenizer, open_gguf
    return gguf_tokenizer(open_gguf(embedded_gguf_path()), "embedded")


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]),
                                st.text(max_size=30)), min_size=1, max_size=4),
       generation=st.booleans())
def test_our_tokenizer_gives_transformers_ids_and_text(smollm, hf_tokenizer, turns, generation):
    ours, theirs = smollm[1], hf_tokenizer
    messages = [{"role": r, "content": c} for r, c in turns]
    for tokenize in (True, False):
        kw = dict(add_generation_prompt=generation, tokenize=tokenize, return_dict=False)
        assert ours.apply_chat_template(messages, **kw) == theirs.apply_chat_template(messages, **kw)
    text = turns[-1][1]
    ids = ours(text).input_ids
    assert ids == theirs(text).input_ids
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip)
    assert ours.eos_token_id == theirs.eos_token_id
