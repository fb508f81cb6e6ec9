"""Real models called as real code calls them: ``generate`` on decoder families (with and
without a KV cache, routed through the wrapper by ``attach``), and an encoder fed batches
whose sequence length changes every call. Tokens and hidden states equal eager's; the
paths the calls ran are asserted."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import streamsched as ss  # noqa: E402
from streamsched.testing import last_path  # noqa: E402

VOCAB = 96


def _gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


def _llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg)


def _opt() -> torch.nn.Module:
    cfg = transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
    )
    return transformers.OPTForCausalLM(cfg)


DECODERS = {"gpt2": _gpt2, "llama": _llama, "opt": _opt}


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("family", sorted(DECODERS))
def test_generate_through_the_wrapper_gives_eagers_tokens(family, use_cache):
    torch.manual_seed(0)
    model = DECODERS[family]().eval()
    prompt = torch.randint(1, VOCAB, (2, 5))
    kwargs = dict(max_new_tokens=8, do_sample=False, use_cache=use_cache, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(prompt, **kwargs)
        sm = ss.StreamScheduledModule(model)
        paths = []
        calls = {"n": 0}
        entry = sm._entry

        def counting(args, kw, inside):
            out = entry(args, kw, inside)
            calls["n"] += 1
            paths.append(last_path(sm))
            return out

        sm._entry = counting
        try:
            out = sm.attach().generate(prompt, **kwargs)
            again = model.generate(prompt, **kwargs)
        finally:
            sm.detach()
    assert torch.equal(out, expected) and torch.equal(again, expected)
    # Every forward of generate went through the wrapper.
    assert calls["n"] == 16, calls
    assert all(p for p in paths)
    with torch.no_grad():
        assert torch.equal(model.generate(prompt, **kwargs), expected)


def test_a_wrapper_in_place_of_t5s_encoder_under_generate():
    """The wrapper standing in for a submodule: T5's generate reads
    ``encoder.main_input_name`` (a plain value of the encoder, read through) and calls the
    encoder once per generate, through the plan."""
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    kwargs = dict(max_new_tokens=6, do_sample=False)
    prompts = [torch.randint(2, VOCAB, (2, 7)) for _ in range(3)]
    with torch.no_grad():
        expected = [model.generate(p, **kwargs) for p in prompts]
        encoder = model.encoder
        sm = ss.StreamScheduledModule(encoder, executor="serial")
        model.encoder = sm
        paths = []
        for p, e in zip(prompts, expected):
            assert torch.equal(model.generate(p, **kwargs), e)
            paths.append(last_path(sm))
    assert paths == ["recorded", "plan:serial", "plan:serial"]


def test_an_encoder_with_a_new_sequence_length_every_batch():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    model = transformers.BertModel(cfg).eval()
    sm = ss.StreamScheduledModule(model)
    paths = []
    with torch.no_grad():
        for _epoch in range(3):
            for n in (7, 12, 9, 16, 5, 21):
                ids = torch.randint(1, VOCAB, (3, n))
                mask = torch.ones_like(ids)
                mask[0, n // 2 :] = 0
                out = sm(input_ids=ids, attention_mask=mask)
                ref = model(input_ids=ids, attention_mask=mask)
                assert type(out) is type(ref)
                torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-5, atol=1e-5)
                paths.append(last_path(sm))
    # No length is recorded twice, and the last epoch records nothing: every call runs a
    # plan, the model as written, or (BERT's own forward cannot be traced) eager dispatch.
    assert paths.count("recorded") <= 6
    assert all(p != "recorded" for p in paths[-6:]), paths
    assert len(sm.plans) <= 6


def _mistral_sliding() -> torch.nn.Module:
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=4,
    )
    return transformers.MistralForCausalLM(cfg)


def _mixtral() -> torch.nn.Module:
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
    )
    return transformers.MixtralForCausalLM(cfg)


@pytest.mark.parametrize(
    "family, executor", [("llama", "auto"), ("llama", "serial"), ("mixtral", "serial")], ids=lambda v: v
)
def test_a_decoder_fed_batches_with_and_without_padding_of_one_shape(family, executor):
    """transformers builds no mask for a batch without padding (``None``: causal
    attention) and a mask for one with padding, of the same shape: the plan made for one
    meets the other (its check stops it) and the calls run as written, equal to eager,
    in eval and in training with every gradient. Mixtral's experts add their rows into a
    tensor of the call's own in place, which is no state the stopped plan left behind."""
    torch.manual_seed(0)
    model = {"llama": _llama, "mixtral": _mixtral}[family]()
    ref = __import__("copy").deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths = []
    for train in (False, True):
        model.train(train)
        ref.train(train)
        for call in range(6):
            ids = torch.randint(1, VOCAB, (2, 10))
            mask = torch.ones_like(ids)
            if call >= 3:
                mask[1, 7:] = 0
            for p in [*model.parameters(), *ref.parameters()]:
                p.grad = None
            with torch.set_grad_enabled(train):
                out = sm(input_ids=ids, attention_mask=mask, use_cache=False).logits
                expected = ref(input_ids=ids, attention_mask=mask, use_cache=False).logits
                paths.append(last_path(sm))
                torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
                if train:
                    out.sum().backward()
                    expected.sum().backward()
            if train:
                for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)
    # (Under auto the first inference call may run as written, the second record.)
    first = paths.index("recorded")
    assert first <= 1 and paths[first + 1].startswith("plan:"), paths
    assert paths[5] == "as-written" and paths[-1] == "as-written", paths


def test_generate_without_a_cache_past_the_sliding_window_twice():
    """Without a cache every step is a new length; the mask builder returns ``None`` up
    to the window and a mask past it. The second ``generate`` records the lengths it
    comes back with, each with the structure that length returns."""
    torch.manual_seed(0)
    model = _mistral_sliding().eval()
    prompt = torch.randint(1, VOCAB, (2, 3))
    kwargs = dict(max_new_tokens=6, do_sample=False, use_cache=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(prompt, **kwargs)
        sm = ss.StreamScheduledModule(model)
        try:
            for _ in range(3):
                assert torch.equal(sm.attach().generate(prompt, **kwargs), expected)
        finally:
            sm.detach()


def test_transformers_config_return_dict_set_after_planning():
    """``model.config.return_dict = False`` after the plan was made: eager returns
    ``to_tuple()`` of its output, and so does the wrapper; set back, the ``ModelOutput``."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24
    )
    model = transformers.BertModel(cfg).eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    with torch.no_grad():
        for call, return_dict in enumerate([True, True, False, False, True, True]):
            model.config.return_dict = return_dict
            ids = torch.randint(1, VOCAB, (2, 7))
            actual, expected = sm(input_ids=ids), model(input_ids=ids)
            assert last_path(sm) == ("recorded" if call in (0, 2, 4) else "plan:serial"), (call, last_path(sm))
            assert type(actual) is type(expected), (call, type(actual).__name__, type(expected).__name__)
            got = list(actual.values()) if return_dict else list(actual)
            want = list(expected.values()) if return_dict else list(expected)
            for a, e in zip(got, want, strict=True):
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("family", sorted(DECODERS))
def test_return_dict_false_with_a_cache_returns_eagers_tuple(family, grad):
    """``return_dict=False`` and ``use_cache=True``: eager returns ``to_tuple()`` of an
    output whose ``None`` fields it leaves out, ``(logits, cache)``. The inner model's
    output holds the cache (an object: no structure a trace can be made for), and the
    trace's tuple held proxies for its ``None`` fields, ``(logits, cache, None, None)``;
    such a call runs in eager dispatch."""
    torch.manual_seed(0)
    model = DECODERS[family]().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    paths = []
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            ids = torch.randint(1, VOCAB, (2, 6))
            actual = sm(ids, return_dict=False, use_cache=True)
            expected = model(ids, return_dict=False, use_cache=True)
            paths.append(last_path(sm))
            assert type(actual) is type(expected) and len(actual) == len(expected), (paths, len(actual))
            assert [type(v) for v in actual] == [type(v) for v in expected], paths
            torch.testing.assert_close(actual[0], expected[0], rtol=1e-5, atol=1e-5)
    # Traced calls (GPT-2's output holds no None field it reads) or eager dispatch.
    assert all(p in ("recorded", "plan:serial", "eager-dispatch") for p in paths), paths


@pytest.mark.parametrize("executor", ["auto", "serial"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_decoding_loop_passing_its_dynamic_cache_on_every_call(family, executor):
    """A hand-written greedy loop over the wrapper itself (no ``generate``): the prompt,
    then one token a call with the ``DynamicCache`` the last call returned, and the
    prompt's length growing the cache every call. The cache is an object the trace would
    bake in: every call runs as written (the prompt's call, without a cache, under
    ``auto`` as a first call in inference) and its logits equal the eager loop's, which
    keeps its own cache; then a second prompt on a new cache, as a server starts a
    request."""
    torch.manual_seed(0)
    model = DECODERS[family]().eval()
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths = []
    with torch.no_grad():
        for prompt_len in (5, 7):
            prompt = torch.randint(1, VOCAB, (2, prompt_len))
            caches = [transformers.DynamicCache(), transformers.DynamicCache()]
            ids = [prompt, prompt]
            for _ in range(8):
                out = sm(input_ids=ids[0], past_key_values=caches[0], use_cache=True)
                paths.append(last_path(sm))
                expected = model(input_ids=ids[1], past_key_values=caches[1], use_cache=True)
                torch.testing.assert_close(out.logits, expected.logits, rtol=0, atol=0)
                assert out.past_key_values is caches[0] and expected.past_key_values is caches[1]
                token = out.logits[:, -1:].argmax(-1)
                ids = [token, expected.logits[:, -1:].argmax(-1)]
                assert torch.equal(ids[0], ids[1])
            assert caches[0].get_seq_length() == caches[1].get_seq_length() == prompt_len + 7
    assert set(paths) == {"as-written"}, paths


def test_tracing_logs_no_torch_warnings(caplog):
    """Tracing asks torch about every atom type of every node; on torch 2.14 the old name
    of that question logged a deprecation warning per call (hundreds of stderr lines per
    new call structure). Nothing at WARNING from torch while a model is traced and run."""
    import logging

    torch.manual_seed(0)
    model = _llama().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    with caplog.at_level(logging.WARNING, logger="torch"):
        for n in (6, 6, 9):
            ids = torch.randint(1, VOCAB, (2, n))
            with torch.no_grad():
                torch.testing.assert_close(sm(ids).logits, model(ids).logits)
    assert last_path(sm) == "recorded"  # the third call traced and recorded anew
    torch_records = [r for r in caplog.records if r.name.startswith("torch")]
    assert not torch_records, [r.getMessage() for r in torch_records][:3]
