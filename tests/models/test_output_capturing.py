"""transformers' output capturing (``output_hidden_states``, ``output_attentions``)
switched from call to call on one wrapper, as evaluation code does: every call returns
eager's tensors, all of them. The hooks transformers installs on the first collecting
call stay on the model; later calls that collect other outputs must still see them fire."""

from __future__ import annotations

import copy

import pytest
import torch

import streamsched as ss
from streamsched.testing import last_path

from .checks import leaves

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _switch() -> torch.nn.Module:
    cfg = transformers.SwitchTransformersConfig(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1,
        num_heads=4,
        num_experts=4,
        decoder_start_token_id=0,
        router_jitter_noise=0.0,
        dropout_rate=0.0,
    )
    return transformers.SwitchTransformersModel(cfg)


def _bert() -> torch.nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertModel(cfg)


BUILDERS = {"switch": _switch, "bert": _bert}
SEQUENCE = [
    {"output_hidden_states": True},
    {"output_attentions": True},
    {"output_attentions": True},
    {},
    {},
    {"output_hidden_states": True, "output_attentions": True},
    {"output_hidden_states": True},
    {},
    # Tuples (transformers' to_tuple() leaves out the fields that are None): an opaque
    # encoder's ModelOutput has None fields the trace must see as None.
    {"return_dict": False},
    {"return_dict": False},
    {"return_dict": False, "output_hidden_states": True},
]


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_outputs_collected_call_by_call_equal_eagers(family):
    torch.manual_seed(0)
    model = BUILDERS[family]().eval()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    paths = []
    with torch.no_grad():
        for i, extra in enumerate(SEQUENCE):
            mask = torch.ones(2, 12, dtype=torch.long)
            mask[1, 9:] = 0  # padding
            kwargs = {"input_ids": torch.randint(3, VOCAB, (2, 12)), "attention_mask": mask, **extra}
            if family == "switch":
                kwargs.update(decoder_input_ids=torch.randint(3, VOCAB, (2, 6)), use_cache=False)
            out, expected = sm(**kwargs), ref(**kwargs)
            paths.append(last_path(sm))
            structure = [(p, type(t).__name__) for p, t in leaves(out)]
            assert structure == [(p, type(t).__name__) for p, t in leaves(expected)], f"call {i} {extra} ({paths[-1]})"
            got = [(p, t) for p, t in leaves(out) if isinstance(t, torch.Tensor)]
            want = [(p, t) for p, t in leaves(expected) if isinstance(t, torch.Tensor)]
            assert [p for p, _ in got] == [p for p, _ in want], f"call {i} {extra} ({paths[-1]})"
            for (p, a), (_, b) in zip(got, want):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, p=p, i=i: f"call {i}, {p}: {m}")
    assert any(p.startswith("plan") for p in paths), paths
