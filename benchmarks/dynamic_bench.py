"""Call patterns real code has, eager vs wrapped: shapes that change every batch, decoding
that grows the input, objects passed on every call, a submodule swapped or a hook added
while wrapped.

    .venv/bin/python benchmarks/dynamic_bench.py [--rounds 5] [--only NAME] [--json FILE] [--clock cpu]

(the ``hf_*`` cases need transformers: run them with ``.venv-cuda/bin/python`` and
``STREAMSCHED_DISABLE_EXT=1 HF_HUB_OFFLINE=1``; they are skipped where it is missing).

Each case is a *workload*: a fixed sequence of calls (and, for the mutation cases, a
change made after a warm-up). The first pass of the wrapped model pays for tracing and
planning and is reported on its own (the ``*_first_pass`` cases time nothing else: each of
their wrapped passes runs on a wrapper made afresh before it); then eager and wrapped passes alternate, ``rounds``
of each, and the ratio eager/wrapped of their fastest passes is the case's figure (1.0 =
as fast as the model as written, above 1 faster). Outputs are compared with eager on every
call of one pass. One intra-op thread unless ``--threads`` says otherwise. ``--clock cpu``
times passes in CPU seconds of the calling thread instead of wall-clock seconds: on a
loaded machine the wall clock also counts the time other processes ran.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

import streamsched as ss

# ---------------------------------------------------------------------------- models


class TinyLM(nn.Module):
    """An embedding, two encoder layers and a head: a small language model."""

    def __init__(self, vocab: int = 100, d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True) for _ in range(2)
        )
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class Heads(nn.Module):
    """``n`` linear heads reading one tensor: one fused group."""

    def __init__(self, n: int = 64, d: int = 16):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(d, 4) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([h(x) for h in self.heads])


class Towers(nn.Module):
    """Four small MLP towers of different widths: branches the planner may run side by side."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(d, w), nn.GELU(), nn.Linear(w, d)) for w in (32, 48, 64, 96)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(t(x) for t in self.towers)


class Branchy(nn.Module):
    """A small branchy model (about 150 us a call on one CPU thread): four identical MLPs
    (one fused group) and two heterogeneous branches; an optional mask and flag."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, 8)) for _ in range(4))
        self.a = nn.Sequential(nn.Linear(d, 64), nn.Tanh(), nn.Linear(64, 8))
        self.b = nn.Sequential(nn.Linear(d, 24), nn.GELU(), nn.Linear(24, 8))

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None, flag: bool = False) -> torch.Tensor:
        outs = [m(x) for m in self.mlps] + [self.a(x), self.b(x)]
        if flag:
            outs = [o * 2 for o in outs]
        y = torch.stack(outs).sum(0)
        return y if mask is None else y.masked_fill(mask, 0.0)


class TwoBranches(nn.Module):
    """A tiny model (about 50 us a call): two small MLPs of different widths."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, 8))
        self.b = nn.Sequential(nn.Linear(d, 24), nn.Tanh(), nn.Linear(24, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


class Untraceable(Branchy):
    """Branchy with control flow on a tensor's value: its forward cannot be traced."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        outs = [m(x) for m in self.mlps] + [self.a(x), self.b(x)]
        if float(outs[0].sum()) > 1e9:
            return outs[1]
        return torch.stack(outs).sum(0)


class Annealed(Branchy):
    """Branchy scaled by a temperature the caller anneals (``model.tau = f(step)``)."""

    def __init__(self, d: int = 16):
        super().__init__(d)
        self.tau = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        outs = [m(x) for m in self.mlps] + [self.a(x), self.b(x)]
        return torch.stack(outs).sum(0) * self.tau


class Scaled(Branchy):
    """Branchy scaled by a plain number passed on every call (a timestep, a temperature,
    a guidance scale): the value is read into a tensor op."""

    def forward(self, x: torch.Tensor, t: float = 1.0) -> torch.Tensor:  # type: ignore[override]
        outs = [m(x) for m in self.mlps] + [self.a(x), self.b(x)]
        return torch.stack(outs).sum(0) * t


class Gated(Branchy):
    """Branchy whose plain number only selects which branch runs (control flow on it)."""

    def forward(self, x: torch.Tensor, t: float = 1.0) -> torch.Tensor:  # type: ignore[override]
        outs = [m(x) for m in self.mlps]
        outs.append(self.a(x) if t > 0.5 else self.b(x))
        return torch.stack(outs).sum(0)


class Cache:
    """A stand-in for transformers' ``DynamicCache``: an object holding tensors."""

    def __init__(self, size: int = 4):
        self.keys = [torch.randn(2, 8) for _ in range(size)]


class WithCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, past: Any = None) -> torch.Tensor:
        return self.a(x) + self.b(x)


# ------------------------------------------------------------------------------ cases


@dataclass
class Case:
    name: str
    what: str
    make: Callable[[], nn.Module]
    # calls(f) runs one pass of the workload through f (the model or the wrapper)
    # and returns the outputs to compare.
    calls: Callable[[Callable[..., Any]], list]
    # prepare(model, sm): a change made after the warm-up pass (a swap, a hook).
    prepare: Optional[Callable[[nn.Module, Any], None]] = None
    options: Optional[dict] = None
    # Each wrapped pass on a wrapper made afresh (outside the timed pass): the figure is
    # the pattern's first pass, what a program that runs it once sees.
    fresh: bool = False


def _lengths_cycle() -> Case:
    lengths = list(range(8, 8 + 24 * 2, 2))
    ids = [torch.randint(0, 100, (4, n)) for n in lengths]
    return Case(
        "lm_24_lengths",
        "TinyLM, 24 sequence lengths cycled (more than plan_cache_size)",
        TinyLM,
        lambda f: [f(i) for i in ids],
    )


def _greedy_decode() -> Case:
    prompts = [torch.randint(0, 100, (1, 5)) for _ in range(3)]

    def calls(f: Callable[..., Any]) -> list:
        outs = []
        for p in prompts:
            ids = p
            for _ in range(40):
                logits = f(ids)
                ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
            outs.append(ids)
        return outs

    return Case("greedy_decode", "TinyLM greedy decoding, no cache (input grows), 3 prompts x 40 tokens", TinyLM, calls)


def _greedy_decode_first_pass() -> Case:
    case = _greedy_decode()
    case.name, case.what, case.fresh = "greedy_decode_first_pass", "greedy_decode on a fresh wrapper every pass", True
    return case


def _fresh_object() -> Case:
    xs = [torch.randn(2, 8) for _ in range(50)]
    return Case(
        "object_per_call",
        "a fresh non-tensor object (a cache stand-in) on every call",
        WithCache,
        lambda f: [f(x, past=Cache()) for x in xs],
    )


def _swap_member() -> Case:
    xs = [torch.randn(8, 16) for _ in range(200)]

    def prepare(model: nn.Module, sm: Any) -> None:
        model.heads[3] = nn.Linear(16, 4)

    return Case(
        "swap_member",
        "64 fused heads, one replaced by a new Linear after warm-up",
        Heads,
        lambda f: [f(x) for x in xs],
        prepare,
    )


def _hook_added_removed() -> Case:
    xs = [torch.randn(8, 32) for _ in range(200)]

    def prepare(model: nn.Module, sm: Any) -> None:
        handle = model.towers[1].register_forward_hook(lambda m, i, o: None)
        sm(xs[0])
        handle.remove()

    return Case(
        "hook_removed",
        "Towers, a forward hook registered, one call, removed",
        Towers,
        lambda f: [f(x) for x in xs],
        prepare,
    )


def _new_shape() -> Case:
    xs = [torch.randn(8, 32) for _ in range(5)] + [torch.randn(24, 32) for _ in range(60)]
    return Case(
        "new_shape", "Towers planned at batch 8, then 60 calls at batch 24", Towers, lambda f: [f(x) for x in xs]
    )


def _last_batch() -> Case:
    xs = ([torch.randn(32, 32) for _ in range(9)] + [torch.randn(7, 32)]) * 5
    return Case(
        "last_batch_smaller",
        "Towers, 9 batches of 32 and a last one of 7, 5 epochs",
        Towers,
        lambda f: [f(x) for x in xs],
    )


def _fused_varying_batch() -> Case:
    sizes = [1 + (7 * i) % 40 for i in range(120)]
    xs = [torch.randn(b, 16) for b in sizes]
    return Case(
        "heads_varying_batch",
        "64 fused heads, batch size varying every call (40 sizes)",
        Heads,
        lambda f: [f(x) for x in xs],
    )


# Call patterns of a small model (eager 50-250 us a call), where the wrapper's own work on
# each call shows: each case is 240 calls.


def _branchy_calls(
    make_args: Callable[[int], tuple], state: Callable[[int], Any] = lambda i: contextlib.nullcontext()
) -> Callable[[Callable[..., Any]], list]:
    calls = [make_args(i) for i in range(240)]

    def run(f: Callable[..., Any]) -> list:
        outs = []
        for i, (args, kwargs) in enumerate(calls):
            with state(i):
                outs.append(f(*args, **kwargs))
        return outs

    return run


def _per_pass_calls(make_args: Callable[[int, int], tuple]) -> Callable[[Callable[..., Any]], list]:
    """Like ``_branchy_calls``, with ``make_args(pass, i)``: the ``pass``-th pass of each
    callable (the eager model's and the wrapper's) gets the same values, so their outputs
    compare, and each pass of one gets values its earlier passes did not have (a value new
    on every call stays new across the interleaved rounds)."""
    xs = [torch.randn(8, 16) for _ in range(240)]
    passes: dict[int, int] = {}

    def run(f: Callable[..., Any]) -> list:
        n = passes.get(id(f), 0)
        passes[id(f)] = n + 1
        outs = []
        for i, x in enumerate(xs):
            args, kwargs = make_args(n, i)
            outs.append(f(x, *args, **kwargs))
        return outs

    return run


def _new_value(n: int, i: int) -> float:
    """A float no earlier call had (a temperature drawn at random, a noise level)."""
    return random.Random(n * 1000 + i).uniform(0.5, 1.5)


def _varying_cases() -> list[Case]:
    """A plain number passed on every call, new on (nearly) every call or cycling through a
    few values: each under the default executor and ``serial``."""
    levels = (0.25, 0.5, 1.0, 2.0)
    patterns = [
        (
            "float_new",
            "Scaled (Branchy * t), a float argument new on every call",
            Scaled,
            lambda n, i: ((_new_value(n, i),), {}),
        ),
        (
            "float_kwarg_new",
            "Scaled, a float keyword (t=...) new on every call",
            Scaled,
            lambda n, i: ((), {"t": _new_value(n, i)}),
        ),
        (
            "timestep_countdown",
            "Scaled, an int timestep counting down a 1000-step schedule, run after run",
            Scaled,
            lambda n, i: ((999 - (n * 240 + i) % 1000,), {}),
        ),
        (
            "float_4_levels",
            "Scaled, a float cycling through 4 values (noise levels)",
            Scaled,
            lambda n, i: ((levels[i % 4],), {}),
        ),
        (
            "float_20_levels",
            "Scaled, a float cycling through 20 values (more than the plans kept: each baked into its trace)",
            Scaled,
            lambda n, i: ((0.25 + 0.125 * (i % 20),), {}),
        ),
        (
            "float_gates_branch",
            "Gated (the float only selects a branch), new on every call",
            Gated,
            lambda n, i: ((_new_value(n, i),), {}),
        ),
    ]
    cases = []
    for executor in ("auto", "serial"):
        for name, what, make, args in patterns:
            suffix, options = ("", None) if executor == "auto" else ("_serial", {"executor": "serial"})
            cases.append(
                Case(
                    f"small_{name}{suffix}",
                    f"{what}; executor={executor}",
                    make,
                    _per_pass_calls(args),
                    options=options,
                )
            )
    return cases


def _small_cases() -> list[Case]:
    sizes = [1, 3, 5, 8, 12, 16, 24, 32]
    masks = [torch.rand(8, 8) > 0.5 for _ in range(240)]

    @contextlib.contextmanager
    def autocast(i: int) -> Iterator[None]:
        # With gradients (run_case runs passes under no_grad): a training-style forward.
        with torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(i % 2)):
            yield

    xs = [torch.randn(8, 16) for _ in range(240)]

    def annealed(f: Callable[..., Any]) -> list:
        model = getattr(f, "module", f)  # the wrapper's model is the one it calls
        outs = []
        for i, x in enumerate(xs):
            model.tau = 1.0 / (1 + i)  # a new value on every call: each one re-traced before
            outs.append(f(x))
        return outs

    def mode_set_again(f: Callable[..., Any]) -> list:
        # ``model.eval()`` at the top of every step, the model already in eval mode.
        outs = []
        for x in xs:
            f.eval()
            outs.append(f(x))
        return outs

    def moved_again(f: Callable[..., Any]) -> list:
        # ``model.to(device)`` at the top of every step, the model already there.
        outs = []
        for x in xs:
            f.to(x.device)
            outs.append(f(x))
        return outs

    return [
        Case("small_tau_annealed", "Annealed (Branchy), model.tau set anew before every call", Annealed, annealed),
        Case("small_eval_every_call", "Branchy in eval mode, .eval() before every call", Branchy, mode_set_again),
        Case("small_to_every_call", "Branchy on the CPU, .to('cpu') called before every call", Branchy, moved_again),
        Case(
            "small_decode_growing",
            "Branchy, the input grown by one row every call (1 to 240 rows)",
            Branchy,
            _branchy_calls(lambda i: ((torch.randn(1 + i, 16),), {})),
        ),
        Case(
            "small_autocast_toggled",
            "Branchy with gradients, CPU autocast (bf16) on every other call",
            Branchy,
            _branchy_calls(lambda i: ((torch.randn(8, 16),), {}), autocast),
        ),
        Case(
            "small_batch_8_sizes",
            "Branchy, the batch size one of 8 every call",
            Branchy,
            _branchy_calls(lambda i: ((torch.randn(sizes[(i * 5) % 8], 16),), {})),
        ),
        Case(
            "small_mask_or_none",
            "Branchy, an optional mask passed every other call",
            Branchy,
            _branchy_calls(lambda i: ((torch.randn(8, 16),), {"mask": masks[i]} if i % 2 else {})),
        ),
        Case(
            "small_flag_toggled",
            "Branchy, a bool keyword toggled every call",
            Branchy,
            _branchy_calls(lambda i: ((torch.randn(8, 16),), {"flag": bool(i % 2)})),
        ),
        Case(
            "small_grad_modes",
            "Branchy, no_grad and enable_grad alternating",
            Branchy,
            _branchy_calls(
                lambda i: ((torch.randn(8, 16),), {}), lambda i: torch.no_grad() if i % 2 else torch.enable_grad()
            ),
        ),
        Case(
            "tiny_decode_growing",
            "TwoBranches (about 50 us), the input grown by one row every call",
            TwoBranches,
            _branchy_calls(lambda i: ((torch.randn(1 + i, 16),), {})),
        ),
        Case(
            "small_decode_growing_first_pass",
            "small_decode_growing on a fresh wrapper every pass: its first pass, tracing and trials included",
            Branchy,
            _branchy_calls(lambda i: ((torch.randn(1 + i, 16),), {})),
            fresh=True,
        ),
        Case(
            "tiny_decode_growing_first_pass",
            "tiny_decode_growing on a fresh wrapper every pass: its first pass",
            TwoBranches,
            _branchy_calls(lambda i: ((torch.randn(1 + i, 16),), {})),
            fresh=True,
        ),
        Case(
            "small_batch_random",
            "Branchy, a batch size drawn at random (1 to 64) every call",
            Branchy,
            _branchy_calls(lambda i: ((torch.randn(random.Random(i).randint(1, 64), 16),), {})),
        ),
        Case(
            "tiny_decode_child_hook",
            "tiny_decode_growing, a forward hook registered on a child after the warm-up",
            TwoBranches,
            _branchy_calls(lambda i: ((torch.randn(1 + i, 16),), {})),
            prepare=lambda model, sm: model.a[2].register_forward_hook(lambda m, i, out: out + 1),
        ),
        Case(
            "tiny_decode_child_swapped",
            "tiny_decode_growing, a child replaced after the warm-up",
            TwoBranches,
            _branchy_calls(lambda i: ((torch.randn(1 + i, 16),), {})),
            prepare=lambda model, sm: setattr(model.b, "2", nn.Linear(24, 8)),
        ),
        Case(
            "small_untraceable",
            "Branchy with an untraceable forward (control flow on a value)",
            Untraceable,
            _branchy_calls(lambda i: ((torch.randn(8, 16),), {})),
        ),
        *_varying_cases(),
    ]


CASES = [
    _lengths_cycle,
    _greedy_decode,
    _greedy_decode_first_pass,
    _fresh_object,
    _swap_member,
    _hook_added_removed,
    _new_shape,
    _last_batch,
    _fused_varying_batch,
]


def _hf_cases() -> list[Case]:
    """transformers models from configs (random weights, nothing downloaded)."""
    try:
        import transformers
    except ImportError:
        return []
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    def bert() -> nn.Module:
        cfg = BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
        )
        return BertModel(cfg).eval()

    bert_ids = [torch.randint(0, 100, (2, n)) for n in range(6, 26, 2)]

    def generate_case(name: str, make: Callable[[], nn.Module], use_cache: bool) -> Case:
        prompt = torch.randint(0, 100, (1, 6))

        def calls(f: Callable[..., Any]) -> list:
            model = f.__self__ if hasattr(f, "__self__") else f
            return [model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=use_cache, pad_token_id=0)]

        return Case(name, f"{make.__name__} generate(), 12 new tokens, use_cache={use_cache}", make, calls)

    def gpt2() -> nn.Module:
        return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4)).eval()

    def gpt2_8_layers() -> nn.Module:
        # Layers so small that the wrappers nesting their MLPs cost a step more than the
        # MLPs' plans save: what the outermost wrapper's trial of nesting is for.
        return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=8, n_head=4)).eval()

    def llama() -> nn.Module:
        cfg = LlamaConfig(
            vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
        )
        return LlamaForCausalLM(cfg).eval()

    def cache_loop_case(name: str, make: Callable[[], nn.Module]) -> Case:
        prompts = [torch.randint(0, 100, (1, 6)) for _ in range(3)]

        def calls(f: Callable[..., Any]) -> list:
            # A hand-written greedy loop over the callable itself: the prompt, then one
            # token a call with the DynamicCache the last call returned.
            outs = []
            for ids in prompts:
                cache = transformers.DynamicCache()
                for _ in range(12):
                    out = f(input_ids=ids, past_key_values=cache, use_cache=True)
                    ids = out.logits[:, -1:].argmax(-1)
                    outs.append(ids)
            return outs

        return Case(name, f"{make.__name__}: a greedy loop passing its DynamicCache every call, 3 x 12", make, calls)

    def qwen2() -> nn.Module:
        cfg = transformers.Qwen2Config(
            vocab_size=100,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
        return transformers.Qwen2ForCausalLM(cfg).eval()

    def mixed_calls(f: Callable[..., Any]) -> list:
        # Three batch shapes in turn, a padding mask on every other triple, gradients with a
        # backward on every other pair, and a new length every fifth call: the call
        # structures (mask or not, grad or not) and sizes a fine-tuning and evaluation
        # loop mixes.
        draw = random.Random(0)
        outs = []
        for p in f.parameters():
            p.grad = None
        for i in range(60):
            b, t = ((2, 16), (4, 24), (1, 40))[i % 3]
            if i % 5 == 4:
                t = draw.randint(8, 60)
            ids = torch.randint(3, 100, (b, t), generator=torch.Generator().manual_seed(i))
            kwargs = {}
            if (i // 3) % 2:
                mask = torch.ones(b, t, dtype=torch.long)
                mask[:, : t // 4] = 0
                kwargs["attention_mask"] = mask
            with torch.set_grad_enabled((i // 2) % 2 == 1):
                logits = f(ids, **kwargs).logits
                if logits.requires_grad:
                    logits.sum().backward()
            outs.append(logits.detach())
        return outs

    def bart() -> nn.Module:
        cfg = transformers.BartConfig(
            vocab_size=100,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
        )
        return transformers.BartForConditionalGeneration(cfg).eval()

    def bert_classifier() -> nn.Module:
        cfg = BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
        )
        return transformers.BertForSequenceClassification(cfg).eval()

    def mixed_cases(name: str, make: Callable[[], nn.Module], what: str) -> list[Case]:
        what = f"{what}: 3 shapes, masks, grad with backward, a new length every 5th call; 60 calls"
        return [
            Case(name, what, make, mixed_calls),
            Case(f"{name}_first_pass", f"{what}, on a fresh wrapper every pass", make, mixed_calls, fresh=True),
        ]

    return [
        *mixed_cases("hf_qwen2_mixed", qwen2, "Qwen2 (2 layers)"),
        *mixed_cases("hf_bart_mixed", bart, "BART (2 + 2 layers)"),
        *mixed_cases("hf_bert_classifier_mixed", bert_classifier, "BertForSequenceClassification (2 layers)"),
        cache_loop_case("hf_gpt2_dynamic_cache_loop", gpt2),
        cache_loop_case("hf_gpt2_8_layers_dynamic_cache_loop", gpt2_8_layers),
        cache_loop_case("hf_llama_dynamic_cache_loop", llama),
        Case(
            "hf_bert_10_lengths",
            "BERT, 10 sequence lengths",
            bert,
            lambda f: [f(i).last_hidden_state for i in bert_ids],
        ),
        generate_case("hf_gpt2_generate_cache", gpt2, True),
        generate_case("hf_gpt2_generate_nocache", gpt2, False),
        generate_case("hf_llama_generate_cache", llama, True),
        generate_case("hf_llama_generate_nocache", llama, False),
    ]


# ------------------------------------------------------------------------------ timing


def _max_error(a: list, b: list) -> float:
    err = 0.0
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            if x.dtype.is_floating_point:
                err = max(err, (x - y).abs().max().item() if x.numel() else 0.0)
            else:
                err = max(err, float((x != y).sum().item()))
    return err


def run_case(case: Case, rounds: int, clock: Callable[[], float] = time.perf_counter) -> dict:
    torch.manual_seed(0)
    model = case.make().eval()
    sm = ss.StreamScheduledModule(model, **(case.options or {}))
    is_generate = case.name.endswith(("_cache", "_nocache"))
    if is_generate:
        # model.generate calls the model's own forward: attach routes it through sm.
        sm.attach()
        eager_fn: Callable[..., Any] = _Detached(model, sm)
        wrapped_fn: Callable[..., Any] = model
    else:
        eager_fn, wrapped_fn = model, sm
    with torch.no_grad():
        start = clock()
        first = case.calls(wrapped_fn)
        first_s = clock() - start
        if case.prepare is not None:
            case.prepare(model, sm)
        start = clock()
        eager_first = case.calls(eager_fn)
        eager_first_s = clock() - start
        error = _max_error(first, eager_first) if case.prepare is None else 0.0
        eager_s, wrapped_s = [], []
        for _ in range(rounds):
            start = clock()
            ref = case.calls(eager_fn)
            eager_s.append(clock() - start)
            if case.fresh:
                sm = ss.StreamScheduledModule(model, **(case.options or {}))
                wrapped_fn = sm
            start = clock()
            out = case.calls(wrapped_fn)
            wrapped_s.append(clock() - start)
            error = max(error, _max_error(out, ref))
    plan = sm.plan
    return {
        "case": case.name,
        "what": case.what,
        "eager_over_wrapped": min(eager_s) / min(wrapped_s),
        "eager_over_wrapped_median": statistics.median(eager_s) / statistics.median(wrapped_s),
        "first_pass_s": first_s,
        "eager_pass_s": min(eager_s),
        "eager_first_pass_s": eager_first_s,
        "wrapped_pass_s": min(wrapped_s),
        "max_error": error,
        "plans": len(sm.plans),
        "last_plan": (plan.executor + ": " + plan.reason) if plan is not None else None,
    }


class _Detached:
    """Calls the model's methods with its forward as written (the eager side of a
    ``generate`` case, while the wrapper is attached to the same model)."""

    def __init__(self, model: nn.Module, sm: Any):
        self.model, self.sm = model, sm

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        with self.sm.detached():
            return self.model.generate(*args, **kwargs)

    @property
    def __self__(self) -> Any:
        return self


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", default=None, help="run the cases whose name contains this")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time passes in wall-clock seconds, or in CPU seconds of the calling thread (steadier on a loaded "
        "machine: with one intra-op thread that is the pass's work)",
    )
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    cases = [make() for make in CASES] + _small_cases() + _hf_cases()
    if args.only:
        cases = [c for c in cases if args.only in c.name]
    results = []
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} interleaved rounds, {args.clock} clock; "
        "eager/wrapped of the fastest pass"
    )
    print(
        f"{'case':28} {'eager/wrapped':>13} {'(median)':>9} {'first pass':>11} {'eager pass':>11} "
        f"{'max err':>8} {'plans':>5}"
    )
    for case in cases:
        r = run_case(case, args.rounds, time.thread_time if args.clock == "cpu" else time.perf_counter)
        results.append(r)
        print(
            f"{r['case']:28} {r['eager_over_wrapped']:13.2f} {r['eager_over_wrapped_median']:9.2f} "
            f"{r['first_pass_s'] * 1e3:9.1f}ms {r['eager_pass_s'] * 1e3:9.1f}ms {r['max_error']:8.1e} {r['plans']:5d}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "torch": torch.__version__,
                    "threads": args.threads,
                    "rounds": args.rounds,
                    "clock": args.clock,
                    "results": results,
                },
                fh,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
