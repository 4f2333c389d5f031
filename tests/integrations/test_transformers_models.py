"""Tiny transformers models on qkv against the same models on eager and sdpa.

Every family whose attention goes through transformers' AttentionInterface: logits, hidden
states and parameter gradients at the real (non-padding) positions, right and left padding,
greedy generation with the model's cache, output_attentions for every layer, cross-attention,
packed sequences, dropout, and what qkv refuses.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers

from qkv.integrations.transformers import recording
from tests.integrations import _tiny_models as tiny

NAME = tiny.NAME
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _run(model, ids, mask, **kw):
    return model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **kw)


def _grads(model, ids, mask, weights):
    """Gradients of every parameter for a loss over the real positions only."""
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
    (logits * weights * mask[..., None]).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_import_qkv_never_imports_transformers() -> None:
    code = (
        "import sys, qkv, qkv.integrations, qkv.masks, qkv.attention.functional, qkv.nn.multihead, qkv.models, qkv.inspect\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("family", tiny.DECODERS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_decoder_matches_eager_and_sdpa(family: str, side: str) -> None:
    models = tiny.trio(tiny.DECODERS[family]())
    ids, mask = tiny.padded_batch(11, (0, 4), side)
    real = mask.bool()
    out = {impl: _run(m, ids, mask) for impl, m in models.items()}
    weights = torch.randn_like(out["eager"].logits)
    grads = {impl: _grads(m, ids, mask, weights) for impl, m in models.items()}
    for peer in tiny.peers(models):
        torch.testing.assert_close(out[NAME].logits[real], out[peer].logits[real], **TOL)
        for ours, theirs in zip(out[NAME].hidden_states, out[peer].hidden_states, strict=True):
            torch.testing.assert_close(ours[real], theirs[real], **TOL)
        assert grads[NAME].keys() == grads[peer].keys() and len(grads[NAME]) > 5
        for name, grad in grads[NAME].items():
            torch.testing.assert_close(grad, grads[peer][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", tiny.DECODERS)
def test_greedy_generate_with_cache_equals_eager(family: str) -> None:
    """Left-padded prompts, a window shorter than prompt + new tokens (the sliding caches)."""
    models = tiny.trio(tiny.DECODERS[family]())
    ids, mask = tiny.padded_batch(7, (0, 3), "left")
    tokens = {
        impl: models[impl].generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        for impl in ("eager", NAME)
    }
    assert tokens[NAME].shape == (2, 15)
    assert torch.equal(tokens[NAME], tokens["eager"])


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_greedy_generate_with_a_static_cache_equals_eager(family: str) -> None:
    """A static cache: keys at fixed slots (kv_offset 0, kv_length = the cache size), the
    mask built once per step by generate and handed back to the model."""
    models = tiny.trio(tiny.DECODERS[family]())
    ids, mask = tiny.padded_batch(7, (0, 3), "left")
    tokens = {}
    for impl in ("eager", NAME):
        with recording() as calls:
            tokens[impl] = models[impl].generate(
                ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static"
            )
    assert torch.equal(tokens[NAME], tokens["eager"])
    assert calls and all(call.recognised for call in calls)


@pytest.mark.parametrize("family", tiny.DECODERS)
def test_output_attentions_equal_eager_for_every_layer(family: str, capfd: pytest.CaptureFixture[str]) -> None:
    models = tiny.trio(tiny.DECODERS[family]())
    ids, mask = tiny.padded_batch(9, (0, 3), "left")
    ours = models[NAME](input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    eager = models["eager"](input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(ours) == len(eager) == 2
    real = mask.bool()[:, None, :, None]  # (B, 1, T, 1): real query rows
    for layer, (a, b) in enumerate(zip(ours, eager, strict=True)):
        assert a.shape == b.shape == (2, 4, 9, 9), layer
        torch.testing.assert_close(a * real, b * real, **TOL)
        # the difference, documented: a left-padding query sees no real key; qkv gives it zero
        # weights (docs/design.md's empty-row rule), eager a uniform row over every key
        assert torch.equal(a[1, :, :3], torch.zeros_like(a[1, :, :3]))
        torch.testing.assert_close(b[1, :, :3], torch.full_like(b[1, :, :3], 1 / 9))
    assert "output_attentions" not in capfd.readouterr().err  # no fallback warning


def test_output_attentions_in_generate() -> None:
    models = tiny.trio(tiny.llama())
    ids, mask = tiny.padded_batch(6, (0, 0), "left")
    runs = {
        impl: models[impl].generate(
            ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_attentions=True,
            return_dict_in_generate=True, pad_token_id=0,
        )
        for impl in ("eager", NAME)
    }
    assert len(runs[NAME].attentions) == 3  # one tuple of layers per generated token
    for step_ours, step_eager in zip(runs[NAME].attentions, runs["eager"].attentions, strict=True):
        for a, b in zip(step_ours, step_eager, strict=True):
            torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("pads", [(0, 0), (0, 3)])
def test_bert_encoder_and_its_cross_attention_decoder(pads: tuple[int, int]) -> None:
    encoders = tiny.trio(tiny.bert(), auto=transformers.AutoModel)
    decoders = tiny.trio(tiny.bert(decoder=True))
    ids, mask = tiny.padded_batch(10, pads, "right")
    dec_ids, dec_mask = tiny.padded_batch(6, (1, 0), "right")
    real, dec_real = mask.bool(), dec_mask.bool()
    results = {}
    for impl in encoders:
        encoded = encoders[impl](input_ids=ids, attention_mask=mask, output_attentions=True)
        decoded = decoders[impl](
            input_ids=dec_ids, attention_mask=dec_mask, encoder_hidden_states=encoded.last_hidden_state,
            encoder_attention_mask=mask, output_attentions=True, output_hidden_states=True, use_cache=False,
        )
        results[impl] = (encoded, decoded)
    enc, dec = results[NAME]
    for peer in tiny.peers(encoders):
        peer_enc, peer_dec = results[peer]
        torch.testing.assert_close(enc.last_hidden_state[real], peer_enc.last_hidden_state[real], **TOL)
        torch.testing.assert_close(dec.logits[dec_real], peer_dec.logits[dec_real], **TOL)
    peer_enc, peer_dec = results["eager"]
    for a, b in zip(enc.attentions, peer_enc.attentions, strict=True):
        torch.testing.assert_close(a, b, **TOL)  # BERT padding queries still see the real keys
    assert len(dec.cross_attentions) == 2
    for a, b in zip(dec.cross_attentions, peer_dec.cross_attentions, strict=True):
        assert a.shape == (2, 4, 6, 10)
        torch.testing.assert_close(a, b, **TOL)


def test_t5_relative_bias_encoder_decoder_matches_eager_and_sdpa() -> None:
    """T5: a learned relative position bias added to the scores in every self-attention, a
    causal decoder, cross-attention over a padded source; forward, the bias table's gradient,
    every attention map and greedy generation."""
    models = tiny.trio(tiny.t5(), auto=transformers.AutoModelForSeq2SeqLM)
    ids, mask = tiny.padded_batch(9, (0, 3), "right")
    labels = torch.randint(3, tiny.VOCAB, (2, 5))
    out, grads = {}, {}
    for impl, model in models.items():
        model.zero_grad()
        out[impl] = model(input_ids=ids, attention_mask=mask, labels=labels, output_attentions=True)
        out[impl].loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert any("relative_attention_bias" in name for name in grads[NAME])
    for peer in tiny.peers(models):
        torch.testing.assert_close(out[NAME].logits, out[peer].logits, **TOL)
        for name, grad in grads[NAME].items():
            torch.testing.assert_close(grad, grads[peer][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    real_query = mask.bool()[:, None, :, None]  # encoder padding rows differ only in what they attend
    for kind in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        for a, b in zip(getattr(out[NAME], kind), getattr(out["eager"], kind), strict=True):
            keep = real_query if kind == "encoder_attentions" else 1
            torch.testing.assert_close(a * keep, b * keep, **TOL)
    tokens = {
        impl: models[impl].generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        for impl in ("eager", NAME)
    }
    assert torch.equal(tokens[NAME], tokens["eager"])


def test_packed_sequences_match_separate_sequences() -> None:
    """position_ids restarting at 0 mark packed sequences (no cache, no 2-D mask): each must
    see only itself, as if run alone."""
    model = tiny.build(tiny.llama(), NAME)
    first, second = torch.randint(3, tiny.VOCAB, (1, 5)), torch.randint(3, tiny.VOCAB, (1, 7))
    packed = torch.cat([first, second], dim=1)
    position_ids = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with recording() as calls:
        together = model(input_ids=packed, position_ids=position_ids, use_cache=False).logits
    assert all("documents" in call.explanation.mask for call in calls) or all(
        "packed sequences" in call.mask_source for call in calls
    )
    alone = torch.cat([model(input_ids=first).logits, model(input_ids=second).logits], dim=1)
    torch.testing.assert_close(together, alone, **TOL)


def test_structured_path_runs_for_sliding_window_layers() -> None:
    """At 320 tokens with window 16, Gemma 2's sliding layer runs on the CPU block engine with a
    sliding_window(15) mask, a small fraction of the score matrix, and its full layer there
    too with causal() (SDPA takes no softcap); both agree with eager, gradients included."""
    models = {impl: m for impl, m in tiny.trio(tiny.gemma2(window=16)).items() if impl != "sdpa"}
    ids, mask = tiny.padded_batch(320, (0, 0), "right")
    with recording() as calls:
        ours = models[NAME](input_ids=ids, attention_mask=mask).logits
    assert [c.layer_idx for c in calls] == [0, 1]
    sliding, full = calls
    assert sliding.explanation.path == "blocks" and sliding.recognised
    assert "sliding_window(left=15, right=0)" in sliding.explanation.reason
    assert sliding.explanation.visited_fraction < 0.2
    assert full.explanation.path == "blocks" and "causal()" in full.explanation.reason
    assert 0.5 <= full.explanation.visited_fraction < 0.9  # the causal triangle, tile-rounded
    assert "softcap" in sliding.explanation.scores and "softcap" in full.explanation.scores
    torch.testing.assert_close(ours, models["eager"](input_ids=ids, attention_mask=mask).logits, **TOL)
    weights = torch.randn_like(ours)
    grads = {impl: _grads(m, ids, mask, weights) for impl, m in models.items()}
    for name, grad in grads[NAME].items():
        torch.testing.assert_close(grad, grads["eager"][name], rtol=1e-3, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_dropout_in_training_keeps_the_mask() -> None:
    """Training mode with attention dropout: outputs vary with the dropout draw, and the causal
    mask still holds (a logit never depends on a later token)."""
    config = tiny.llama()
    config.attention_dropout = 0.5
    model = tiny.build(config, NAME).train()
    embeds = torch.randn(1, 8, 32, requires_grad=True)
    logits = model(inputs_embeds=embeds).logits  # (1, 8, V)
    assert not torch.allclose(logits, model(inputs_embeds=embeds).logits)
    logits[0, 3].sum().backward()
    assert embeds.grad[0, :4].abs().sum() > 0
    assert torch.equal(embeds.grad[0, 4:], torch.zeros_like(embeds.grad[0, 4:]))


def test_gemma2_softcap_matches_eager_and_matters() -> None:
    """Gemma 2's attn_logit_softcapping reaches qkv as softcap=: equal to eager, and unlike
    the same weights without the cap."""
    capped, plain = tiny.gemma2(softcap=1.0), tiny.gemma2(softcap=None)
    capped.initializer_range = plain.initializer_range = 0.3  # scores of a few units: the cap bites
    models = tiny.trio(capped)
    uncapped = tiny.build(plain, NAME, source=models["eager"])
    ids, mask = tiny.padded_batch(9, (0, 2), "left")
    real = mask.bool()
    with recording() as calls:
        ours = models[NAME](input_ids=ids, attention_mask=mask).logits
    assert all("softcap" in call.explanation.scores for call in calls)
    torch.testing.assert_close(ours[real], models["eager"](input_ids=ids, attention_mask=mask).logits[real], **TOL)
    assert (ours - uncapped(input_ids=ids, attention_mask=mask).logits)[real].abs().max() > 1e-3


def _gpt_oss_models(**config: int) -> dict[str, torch.nn.Module]:
    """eager and qkv gpt-oss with the same random weights; sinks drawn away from 0 (the model
    initializes them to N(0, initializer_range)) so that they matter."""
    models = tiny.trio(tiny.gpt_oss(**config))
    with torch.no_grad():
        for layer in models["eager"].model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-2.0, 3.0, layer.self_attn.sinks.numel()))
    for impl, model in models.items():
        if impl != "eager":
            model.load_state_dict(models["eager"].state_dict())
    return models


@pytest.mark.parametrize("side", ["right", "left"])
def test_gpt_oss_sinks_match_eager(side: str) -> None:
    """gpt-oss (sinks, a sliding-window layer then a full one, experts): logits, hidden states and
    every parameter's gradient, the sinks' included, equal eager's at the real positions."""
    models = _gpt_oss_models()
    ids, mask = tiny.padded_batch(11, (0, 3), side)
    real = mask.bool()
    with recording() as calls:
        ours = _run(models[NAME], ids, mask)
    assert [c.layer_idx for c in calls] == [0, 1] and all(c.recognised for c in calls)
    assert "sliding window" in calls[0].mask_source
    eager = _run(models["eager"], ids, mask)
    torch.testing.assert_close(ours.logits[real], eager.logits[real], **TOL)
    for a, b in zip(ours.hidden_states, eager.hidden_states, strict=True):
        torch.testing.assert_close(a[real], b[real], **TOL)
    weights = torch.randn_like(eager.logits)
    grads = {impl: _grads(models[impl], ids, mask, weights) for impl in ("eager", NAME)}
    assert grads[NAME].keys() == grads["eager"].keys()
    sink_grads = [name for name in grads[NAME] if name.endswith("sinks")]
    assert len(sink_grads) == 2 and all(bool(grads[NAME][name].abs().sum() > 0) for name in sink_grads)
    for name, grad in grads[NAME].items():
        torch.testing.assert_close(grad, grads["eager"][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    # the sinks matter: without them the logits differ
    with torch.no_grad():
        for layer in models[NAME].model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    assert (_run(models[NAME], ids, mask).logits - eager.logits)[real].abs().max() > 1e-3


def test_gpt_oss_greedy_generate_equals_eager() -> None:
    """Left-padded prompts, more tokens than the window (the sliding layer's cache rolls over)."""
    models = _gpt_oss_models(window=4)
    ids, mask = tiny.padded_batch(7, (0, 3), "left")
    tokens = {
        impl: models[impl].generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        for impl in ("eager", NAME)
    }
    assert tokens[NAME].shape == (2, 15) and torch.equal(tokens[NAME], tokens["eager"])


@pytest.mark.parametrize(
    ("kind", "tracking"),
    [("dynamic", "by hand"), ("static", "by hand"), ("dynamic", "automatic"), ("static", "automatic"), ("generate's own", "automatic")],
)
def test_a_tracked_cache_skips_the_cache_scan_and_generates_as_eager(
    kind: str, tracking: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """track_bounds, by hand or by the backend's hook: every decoding step's input checks scan
    the new query only (the keys and values come with their bounds), and greedy generation
    equals eager's with its own cache."""
    from qkv.attention import problem
    from qkv.integrations.transformers import track_bounds

    models = _gpt_oss_models(window=4)
    ids, mask = tiny.padded_batch(7, (0, 3), "left")
    eager = models["eager"].generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    config = models[NAME].config
    caches = {
        "dynamic": lambda: transformers.DynamicCache(config=config),
        "static": lambda: transformers.StaticCache(config=config, max_cache_len=16),
        "generate's own": lambda: None,
    }
    cache = caches[kind]()
    if tracking == "by hand" and cache is not None:
        cache = track_bounds(cache)
    scanned: list[tuple[int, ...]] = []
    original = problem._largest_magnitudes
    monkeypatch.setattr(problem, "_largest_magnitudes", lambda ts: scanned.extend(t.shape for t in ts) or original(ts))
    given = {} if cache is None else tiny.cache_argument(models[NAME], cache)
    ours = models[NAME].generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, **given)
    assert torch.equal(ours, eager)
    steps = [shape for shape in scanned if shape[-2] == 1 and shape[1] == 4]  # the query (B, H, 1, E) of a decoding step
    assert len(steps) == 2 * 5  # two layers, five steps after the prompt
    # queries (H = 4) only on every decoding step: no key or value (G = 2) is scanned there;
    # automatic tracking starts at the second forward: the prompt's keys and values are scanned
    # there, once per layer
    assert len([shape for shape in scanned if shape[1] == 2]) == (0 if tracking == "by hand" else 2 * 2)


def test_a_cache_wrapped_late_bounds_the_rows_it_held_before() -> None:
    """The first write a wrapper sees scans the whole layer: a large key written before the
    cache was wrapped is inside the bound."""
    from qkv.integrations.transformers import track_bounds
    from qkv.integrations.transformers._bounds import noted_bounds

    cache = transformers.DynamicCache()
    k = torch.zeros(1, 2, 3, 4)  # (B, G, S, E)
    k[0, 1, 2, 3] = -(2.0**100)  # exact in float32
    cache.update(k, torch.ones(1, 2, 3, 4), 0)
    track_bounds(cache)
    keys, values = cache.update(torch.full((1, 2, 1, 4), 2.0), torch.full((1, 2, 1, 4), -3.0), 0)
    bounds = noted_bounds(keys, values)
    assert bounds is not None and (bounds.k_max, bounds.v_max) == (2.0**100, 3.0)
    keys, values = cache.update(torch.full((1, 2, 1, 4), 9.0), torch.zeros(1, 2, 1, 4), 0)
    bounds = noted_bounds(keys, values)
    assert bounds is not None and (bounds.k_max, bounds.v_max) == (2.0**100, 3.0)  # the running max, not the new rows'


@pytest.mark.parametrize("kind", ["dynamic", "static", "growing"])
def test_a_cache_written_in_place_between_steps_is_scanned_again(kind: str) -> None:
    """Keys written by other means between two decoding steps (``cache.layers[i].keys[...] = x``)
    are not bounded by the running max of what ``update`` saw: the next step scans the layer.
    A NaN key gives its batch row NaN logits as on eager (the NaN rule), the other row equals
    eager's, and the bounds noted for a layer holding 1e30 are at least 1e30."""
    from qkv.integrations.transformers import growing_cache
    from qkv.integrations.transformers._bounds import noted_bounds

    torch.manual_seed(0)
    models = tiny.trio(tiny.llama())
    prompt = 1100  # keys >= 1,024: the decoding step runs the decode path
    ids = torch.randint(3, tiny.VOCAB, (2, prompt))
    logits = {}
    for impl in ("eager", NAME):
        config = models[impl].config
        if kind == "dynamic":
            cache = transformers.DynamicCache(config=config)
        elif kind == "static":
            cache = transformers.StaticCache(config=config, max_cache_len=prompt + 2)
        else:
            cache = growing_cache(config)
        with torch.no_grad():
            mask = torch.ones(2, prompt, dtype=torch.long)
            models[impl](input_ids=ids, attention_mask=mask, **tiny.cache_argument(models[impl], cache))
            mask = torch.ones(2, prompt + 1, dtype=torch.long)
            models[impl](input_ids=ids[:, :1], attention_mask=mask, **tiny.cache_argument(models[impl], cache))  # tracked from here on
            cache.layers[0].keys[0, :, 3, :] = float("nan")
            cache.layers[1].keys[1, :, 5, :] = 1e30
            mask = torch.ones(2, prompt + 2, dtype=torch.long)
            logits[impl] = models[impl](input_ids=ids[:, 1:2], attention_mask=mask, **tiny.cache_argument(models[impl], cache)).logits
    assert torch.isnan(logits["eager"][0]).all() and torch.isnan(logits[NAME][0]).all()
    torch.testing.assert_close(logits[NAME][1], logits["eager"][1], **TOL)
    layer = cache.layers[1]
    bounds = noted_bounds(layer.keys, layer.values)
    assert bounds is None or bounds.k_max >= 1e30


def test_the_hook_leaves_the_cache_alone_once_the_model_runs_on_another_implementation() -> None:
    models = _gpt_oss_models(window=4)
    ids, mask = tiny.padded_batch(7, (0, 3), "left")
    model = models[NAME]
    model(input_ids=ids, attention_mask=mask)  # installs the hooks
    ours, theirs = transformers.DynamicCache(config=model.config), transformers.DynamicCache(config=model.config)
    model(input_ids=ids, attention_mask=mask, **tiny.cache_argument(model, ours))
    assert getattr(ours, "_qkv_tracks_bounds", False)
    model.set_attn_implementation("eager")
    model(input_ids=ids, attention_mask=mask, **tiny.cache_argument(model, theirs))
    assert not getattr(theirs, "_qkv_tracks_bounds", False)


def test_track_bounds_refuses_what_is_not_a_cache() -> None:
    from qkv.integrations.transformers import track_bounds

    with pytest.raises(TypeError, match="track_bounds takes a transformers Cache"):
        track_bounds(object())


def test_gpt_oss_long_sequence_runs_the_block_engine_with_sinks() -> None:
    """At 320 tokens the sliding layer runs on the CPU block engine with the sinks folded into
    its lse, the full layer too (causal); logits and gradients equal eager's."""
    models = _gpt_oss_models(window=16)
    ids, mask = tiny.padded_batch(320, (0, 0), "right")
    with recording() as calls:
        ours = models[NAME](input_ids=ids, attention_mask=mask).logits
    assert [c.explanation.path for c in calls] == ["blocks", "blocks"]
    assert all("sink" in c.explanation.reason for c in calls)
    torch.testing.assert_close(ours, models["eager"](input_ids=ids, attention_mask=mask).logits, **TOL)
    weights = torch.randn_like(ours)
    grads = {impl: _grads(models[impl], ids, mask, weights) for impl in ("eager", NAME)}
    for name, grad in grads[NAME].items():
        torch.testing.assert_close(grad, grads["eager"][name], rtol=1e-3, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_register_refuses_transformers_own_names() -> None:
    from qkv.integrations.transformers import register

    assert register() == register("qkv") == NAME  # registering again is harmless
    for name in ("sdpa", "eager", "flash_attention_2"):
        with pytest.raises(ValueError, match="already an attention implementation"):
            register(name)
    with pytest.raises(ValueError, match="non-empty str"):
        register(" qkv")


def test_a_callers_4d_mask_is_used_as_given() -> None:
    models = tiny.trio(tiny.llama())
    ids = torch.randint(3, tiny.VOCAB, (1, 6))
    i, j = torch.arange(6)[:, None], torch.arange(6)[None]
    allowed = (j <= i) & (i - j != 1)  # causal, but never the previous token
    float_mask = torch.zeros(1, 1, 6, 6).masked_fill(~allowed, torch.finfo(torch.float32).min)
    ours = models[NAME](input_ids=ids, attention_mask=float_mask).logits
    torch.testing.assert_close(ours, models["eager"](input_ids=ids, attention_mask=float_mask).logits, **TOL)


def test_continuous_batching_still_refuses_a_registered_implementation() -> None:
    """What keeps qkv out of transformers' continuous batching (the package docstring names it):
    generate_batch accepts only paged|eager, sdpa and names containing "flash", and such a name
    is looked up as a FlashAttention kernel. When this test fails, transformers has opened the
    door: serve generate_batch on qkv.PagedKVCache's semantics."""
    from qkv.integrations.transformers import register

    model = tiny.trio(tiny.llama())[NAME]
    config = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1)
    with pytest.raises(ValueError, match="not supported for continuous batching"):
        model.generate_batch([[1, 2, 3]], generation_config=config)
    register("qkv_flash")
    with pytest.raises(ValueError, match="flash attention implementation at `qkv_flash`"):
        model.set_attn_implementation("qkv_flash")
