"""The broad tier of the model suite: many more real models than ``zoo.py``'s, each run
through one lockstep cycle (``test_broad_models.py``) instead of six separate checks.

torchvision classification, segmentation, video and detection models, a wide sweep of
timm families, and Hugging Face transformers of every common shape (encoders,
decoders, encoder-decoders, vision, speech, CLIP). Random weights from configurations,
nothing downloaded. Every random layer (dropout, stochastic depth, SpecAugment masks) is
set to rate 0 after building (``derandomize``), so training steps can be compared; a
forward that draws random numbers itself (ViTMAE's masking noise, PhiMoE's sampled
routing in training) draws the same ones in both models, as each call starts the eager
model and the wrapper from the same seed (``checks.Lockstep``).

``modes`` says what a model is checked in: ``"full"`` (eval, training with gradients
and state, eval again) or ``"eval"`` (models whose training forward needs targets, as
detection models do).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from benchmarks.zoo.real import Inputs, hf_model, images, timm_model, tokens, torchvision_model

from .zoo import _DECODER, VOCAB, ModelSpec

_RATE_ATTRIBUTES = ("p", "drop_prob", "drop_rate", "dropout", "attention_dropout", "dropout_p", "layerdrop")


def derandomize(model: nn.Module) -> nn.Module:
    """Every dropout-like rate of ``model`` set to 0 (module attributes and the
    transformers config's ``*dropout*``/``*drop_prob*``/mask probabilities)."""
    for m in model.modules():
        for name in _RATE_ATTRIBUTES:
            value = getattr(m, name, None)
            if isinstance(value, float) and not isinstance(value, bool) and value > 0:
                setattr(m, name, 0.0)
        # A rate a module copied from its config under another name (GPTBigCode's
        # attention keeps ``attn_pdrop`` and passes it to scaled_dot_product_attention).
        for name, value in list(vars(m).items()):
            if "drop" in name and isinstance(value, float) and value > 0:
                setattr(m, name, 0.0)
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            for key, value in list(vars(config).items()):
                random_key = "drop" in key or key.startswith("mask_") and key.endswith("_prob")
                if random_key and isinstance(value, float) and value > 0:
                    setattr(config, key, 0.0)
    return model


def _spec(name: str, family: str, build: Callable[[], nn.Module], inputs: Callable[[int], Inputs], note: str = ""):
    return ModelSpec(name, family, lambda: derandomize(build()), inputs, note)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def video(batch: int, frames: int, size: int) -> Callable[[int], Inputs]:
    def make(seed: int) -> Inputs:
        return (torch.randn(batch, 3, frames, size, size, generator=_g(seed)),), {}

    return make


def image_list(count: int, size: int) -> Callable[[int], Inputs]:
    """A list of images, as torchvision's detection models take them."""

    def make(seed: int) -> Inputs:
        g = _g(seed)
        return ([torch.rand(3, size, size + 8 * i, generator=g) for i in range(count)],), {}

    return make


def image_pair(batch: int, size: int, **kwargs: Any) -> Callable[[int], Inputs]:
    def make(seed: int) -> Inputs:
        g = _g(seed)
        pair = (torch.randn(batch, 3, size, size, generator=g), torch.randn(batch, 3, size, size, generator=g))
        return pair, dict(kwargs)

    return make


def pixels(batch: int, size: int, channels: int = 3) -> Callable[[int], Inputs]:
    def make(seed: int) -> Inputs:
        return (), {"pixel_values": torch.randn(batch, channels, size, size, generator=_g(seed))}

    return make


def seq2seq(batch: int, length: int, vocab: int) -> Callable[[int], Inputs]:
    """Encoder ids with padding, and decoder ids."""

    def make(seed: int) -> Inputs:
        g = _g(seed)
        ids = torch.randint(3, vocab, (batch, length), generator=g)
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[1, length - 3 :] = 0
        dec = torch.randint(3, vocab, (batch, length // 2), generator=g)
        return (), {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec, "use_cache": False}

    return make


def clip_inputs(batch: int, length: int, vocab: int, size: int) -> Callable[[int], Inputs]:
    def make(seed: int) -> Inputs:
        g = _g(seed)
        ids = torch.randint(0, vocab, (batch, length), generator=g)
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[1, length - 3 :] = 0
        pixel_values = torch.randn(batch, 3, size, size, generator=g)
        return (), {"input_ids": ids, "attention_mask": mask, "pixel_values": pixel_values}

    return make


def audio(batch: int, samples: int) -> Callable[[int], Inputs]:
    def make(seed: int) -> Inputs:
        return (), {"input_values": torch.randn(batch, samples, generator=_g(seed))}

    return make


def mel(batch: int, bins: int, frames: int, decoder: int, vocab: int) -> Callable[[int], Inputs]:
    def make(seed: int) -> Inputs:
        g = _g(seed)
        return (), {
            "input_features": torch.randn(batch, bins, frames, generator=g),
            "decoder_input_ids": torch.randint(3, vocab, (batch, decoder), generator=g),
            "use_cache": False,
        }

    return make


# --- torchvision ------------------------------------------------------------------------


def _tv(name: str, inputs: Callable[[int], Inputs] | None = None, note: str = "", **kwargs: Any) -> ModelSpec:
    return _spec(f"tv_{name}", "torchvision", torchvision_model(name, **kwargs), inputs or images(2, 64), note)


def _tv_class(name: str, cls: str, inputs: Callable[[int], Inputs], note: str = "", **kwargs: Any) -> ModelSpec:
    def build() -> nn.Module:
        import torchvision

        module_path, _, attr = cls.rpartition(".")
        owner = torchvision.models
        for part in module_path.split(".") if module_path else []:
            owner = getattr(owner, part)
        return getattr(owner, attr)(**kwargs)

    return _spec(f"tv_{name}", "torchvision", build, inputs, note)


def _tv_detection(name: str, size: int = 96, **kwargs: Any) -> ModelSpec:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models.detection, name)(weights=None, weights_backbone=None, **kwargs)

    return _spec(f"tv_{name}", "torchvision-eval", build, image_list(2, size), "eval only (training needs targets)")


TORCHVISION: list[ModelSpec] = [
    _tv("resnet18", num_classes=10),
    _tv("resnext50_32x4d", num_classes=10),
    _tv("squeezenet1_1", num_classes=10),
    _tv("googlenet", num_classes=10, init_weights=True, note="aux logits: a namedtuple in training"),
    _tv("inception_v3", images(2, 107), num_classes=10, init_weights=True, aux_logits=False),
    _tv("densenet121", num_classes=10),
    _tv("mobilenet_v2", num_classes=10),
    _tv("mobilenet_v3_small", num_classes=10),
    _tv("shufflenet_v2_x0_5", num_classes=10),
    _tv("efficientnet_b0", num_classes=10),
    _tv("mnasnet0_5", num_classes=10),
    _tv("regnet_y_400mf", num_classes=10),
    _tv("convnext_tiny", num_classes=10),
    _tv("swin_t", num_classes=10),
    _tv("alexnet", images(2, 64), num_classes=10),
    _tv("vgg11_bn", images(2, 32), num_classes=10),
    _tv_class(
        "vit_tiny",
        "VisionTransformer",
        images(2, 32),
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=10,
    ),
    _tv_class(
        "deeplabv3_mobilenet_v3_large",
        "segmentation.deeplabv3_mobilenet_v3_large",
        images(2, 64),
        note="ASPP branches; OrderedDict with aux output",
        weights=None,
        weights_backbone=None,
        num_classes=5,
        aux_loss=True,
    ),
    _tv_class(
        "lraspp_mobilenet_v3_large",
        "segmentation.lraspp_mobilenet_v3_large",
        images(2, 64),
        weights=None,
        weights_backbone=None,
        num_classes=5,
    ),
    _tv_class("r3d_18", "video.r3d_18", video(1, 4, 32), weights=None, num_classes=5),
    _tv_class("mc3_18", "video.mc3_18", video(1, 4, 32), weights=None, num_classes=5),
    _tv_class(
        "swin3d_t",
        "video.swin3d_t",
        video(1, 2, 32),
        note="a wrapped function adapts the window lists it is given, in place",
        weights=None,
        num_classes=5,
    ),
    _tv_class(
        "raft_small",
        "optical_flow.raft_small",
        image_pair(1, 128, num_flow_updates=2),
        note="iterative refinement; a list of flows",
        weights=None,
    ),
    _tv_detection("fasterrcnn_mobilenet_v3_large_320_fpn", num_classes=5, min_size=96, max_size=128),
    _tv_detection("ssdlite320_mobilenet_v3_large", num_classes=5),
    _tv_detection("retinanet_resnet50_fpn", num_classes=5, min_size=96, max_size=128),
]


# --- timm --------------------------------------------------------------------------------


def _timm(name: str, size: int = 64, note: str = "", **kwargs: Any) -> ModelSpec:
    return _spec(name, "timm", timm_model(name, num_classes=10, **kwargs), images(2, size), note)


TIMM: list[ModelSpec] = [
    _timm("gernet_s"),
    _timm("selecsls42b"),
    _timm("dla34"),
    _timm("ghostnet_100"),
    _timm("ghostnetv2_100"),
    _timm("rexnet_100"),
    _timm("nf_resnet26"),
    _timm("regnety_002"),
    _timm("levit_128s", size=64, img_size=64, note="attention biases cached in eval"),
    _timm("efficientformer_l1", size=224),
    _timm("efficientformerv2_s0", size=64, img_size=64),
    _timm("deit_tiny_distilled_patch16_224", img_size=64, note="two heads: a tuple in training"),
    _timm("crossvit_tiny_240", size=240, note="two branches of patch sizes"),
    _timm("pit_ti_224", img_size=64),
    _timm("mobilevit_xxs"),
    _timm("edgenext_xx_small"),
    _timm("poolformer_s12"),
    _timm("convit_tiny", img_size=64),
    _timm("coat_lite_tiny", img_size=64),
    _timm("gcvit_xxtiny", img_size=64),
    _timm("fastvit_t8"),
    _timm("repvit_m1"),
    _timm("hgnetv2_b0"),
    _timm("inception_next_tiny"),
    _timm("mixer_s16_224", img_size=64),
    _timm("resmlp_12_224", img_size=64),
    _timm("convnext_atto"),
    _timm("convnextv2_atto"),
    _timm("efficientvit_b0"),
    _timm("mobilenetv3_small_100"),
    _timm("mobilenetv4_conv_small"),
    _timm("lcnet_050"),
    _timm("resnest14d", note="split attention"),
    _timm("cs3darknet_focus_s"),
    _timm("ese_vovnet19b_dw"),
    _timm("tresnet_m"),
    _timm("xcit_nano_12_p16_224", img_size=64),
    _timm("visformer_tiny", size=224),
    _timm("eva02_tiny_patch14_224", img_size=56, size=56),
    _timm("davit_tiny"),
    _timm("focalnet_tiny_srf"),
    _timm("starnet_s1"),
    _timm("ecaresnet26t"),
    _timm("gcresnext26ts"),
    _timm("seresnext26d_32x4d"),
    _timm("resnetv2_50x1_bit"),
    _timm("regnetz_b16"),
    _timm("halonet26t", size=256),
    _timm("lambda_resnet26t", size=128, img_size=128),
    _timm("sebotnet33ts_256", size=256, img_size=256),
    _timm("xception41"),
    _timm("inception_resnet_v2", size=75),
    _timm("dpn68b"),
    _timm("hrnet_w18_small_v2"),
    _timm("beit_base_patch16_224", img_size=64, depth=2, note="relative position bias, 2 blocks"),
    _timm("cait_xxs24_224", img_size=64),
    _timm("tnt_s_patch16_224", img_size=64),
    _timm("maxvit_pico_rw_256", size=64, img_size=64),
    _timm("coatnet_pico_rw_224", size=64, img_size=64),
    _timm("hiera_tiny_224", size=224),
    _timm("mambaout_femto"),
    _timm("rdnet_tiny"),
    _timm("dla60x_c"),
    _timm("repghostnet_050"),
    _spec(
        "resnet18_features_hook",
        "timm",
        timm_model("resnet18", features_only=True, feature_cls="hook", out_indices=(1, 3)),
        images(2, 64),
        "features collected by forward hooks into a defaultdict, read and cleared by the forward",
    ),
]


# --- transformers -------------------------------------------------------------------------

# The main zoo's VOCAB and decoder config (_DECODER); _SMALL for encoders.
_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_SEQ2SEQ = dict(
    vocab_size=VOCAB,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=37,
    decoder_ffn_dim=37,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    decoder_start_token_id=2,
)
_ENCODER = dict(_SMALL, max_position_embeddings=80)
# Segformer's hierarchical encoder (GLPN's too), two stages.
_MIX_TRANSFORMER = dict(
    num_encoder_blocks=2,
    depths=[1, 1],
    sr_ratios=[2, 1],
    hidden_sizes=[8, 16],
    num_attention_heads=[1, 2],
    patch_sizes=[7, 3],
    strides=[4, 2],
    decoder_hidden_size=16,
)
_GQA = dict(_SMALL, num_key_value_heads=2)
_GPT = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)


def _hf(name: str, config: str, model: str, inputs: Callable[[int], Inputs], note: str = "", **kwargs: Any):
    return _spec(f"hf_{name}", "transformers", hf_model(config, model, **kwargs), inputs, note)


def _clip() -> nn.Module:
    import transformers

    text = dict(_SMALL, max_position_embeddings=32)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    config = transformers.CLIPConfig(
        text_config=text, vision_config=dict(vision, image_size=32, patch_size=8), projection_dim=16
    )
    return transformers.CLIPModel(config)


def with_kwargs(inputs: Callable[[int], Inputs], **extra: Any) -> Callable[[int], Inputs]:
    """``inputs`` with more keyword arguments (``output_hidden_states=True``, say)."""

    def make(seed: int) -> Inputs:
        args, kwargs = inputs(seed)
        return args, {**kwargs, **extra}

    return make


_TOKENS = tokens(2, 16, VOCAB)
_DECODER_TOKENS = tokens(2, 16, VOCAB, use_cache=False)

TRANSFORMERS: list[ModelSpec] = [
    _hf("roberta", "RobertaConfig", "RobertaModel", _TOKENS, **_ENCODER),
    _hf(
        "distilbert",
        "DistilBertConfig",
        "DistilBertModel",
        _TOKENS,
        vocab_size=VOCAB,
        dim=32,
        n_layers=2,
        n_heads=4,
        hidden_dim=37,
        max_position_embeddings=64,
    ),
    _hf(
        "albert",
        "AlbertConfig",
        "AlbertModel",
        _TOKENS,
        note="one layer's weights shared by every layer",
        **dict(_SMALL, embedding_size=16, num_hidden_layers=3),
    ),
    _hf("electra", "ElectraConfig", "ElectraForPreTraining", _TOKENS, **dict(_SMALL, embedding_size=16)),
    _hf(
        "deberta_v2",
        "DebertaV2Config",
        "DebertaV2Model",
        _TOKENS,
        **dict(_SMALL, relative_attention=True, pos_att_type=["c2p", "p2c"], max_relative_positions=16),
    ),
    _hf(
        "mobilebert",
        "MobileBertConfig",
        "MobileBertModel",
        _TOKENS,
        **dict(_SMALL, embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16, num_feedforward_networks=2),
    ),
    _hf(
        "t5",
        "T5Config",
        "T5Model",
        seq2seq(2, 16, VOCAB),
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
    ),
    _hf("bart", "BartConfig", "BartModel", seq2seq(2, 16, VOCAB), **_SEQ2SEQ),
    _hf("marian", "MarianConfig", "MarianMTModel", seq2seq(2, 16, VOCAB), **_SEQ2SEQ),
    _hf(
        "opt",
        "OPTConfig",
        "OPTForCausalLM",
        _DECODER_TOKENS,
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=37,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
    ),
    _hf(
        "bloom",
        "BloomConfig",
        "BloomForCausalLM",
        _DECODER_TOKENS,
        vocab_size=VOCAB,
        hidden_size=32,
        n_layer=2,
        n_head=4,
    ),
    _hf(
        "gpt_neo",
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        _DECODER_TOKENS,
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=8,
        max_position_embeddings=64,
    ),
    _hf("phi", "PhiConfig", "PhiForCausalLM", _DECODER_TOKENS, **_DECODER),
    _hf("mistral", "MistralConfig", "MistralForCausalLM", _DECODER_TOKENS, **dict(_DECODER, sliding_window=8)),
    _hf("gemma2", "Gemma2Config", "Gemma2ForCausalLM", _DECODER_TOKENS, **dict(_DECODER, head_dim=8)),
    _hf("qwen3", "Qwen3Config", "Qwen3ForCausalLM", _DECODER_TOKENS, **dict(_DECODER, head_dim=8)),
    _hf("falcon", "FalconConfig", "FalconForCausalLM", _DECODER_TOKENS, **_DECODER),
    _hf("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", _DECODER_TOKENS, **_DECODER),
    _hf(
        "vit",
        "ViTConfig",
        "ViTForImageClassification",
        pixels(2, 32),
        **dict(_SMALL, image_size=32, patch_size=8, num_labels=5),
    ),
    _hf(
        "swin",
        "SwinConfig",
        "SwinModel",
        pixels(2, 32),
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
    ),
    _hf(
        "convnext",
        "ConvNextConfig",
        "ConvNextForImageClassification",
        pixels(2, 32),
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_stages=2,
        out_features=["stage2"],
        num_labels=5,
    ),
    _hf(
        "segformer",
        "SegformerConfig",
        "SegformerForSemanticSegmentation",
        pixels(2, 32),
        num_labels=3,
        **_MIX_TRANSFORMER,
    ),
    _hf(
        "wav2vec2",
        "Wav2Vec2Config",
        "Wav2Vec2Model",
        audio(2, 800),
        **dict(
            _SMALL, conv_dim=(16,) * 7, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, mask_time_prob=0.0
        ),
    ),
    _hf(
        "whisper",
        "WhisperConfig",
        "WhisperModel",
        mel(2, 16, 32, 6, VOCAB),
        **dict(_SEQ2SEQ, num_mel_bins=16, max_source_positions=16, max_target_positions=32, decoder_start_token_id=2),
    ),
    _spec("hf_clip", "transformers", _clip, clip_inputs(2, 12, VOCAB, 32), "text and vision towers"),
    # Its image preprocessor flattens with numpy on the input's shape (np.prod), which a
    # trace cannot record: that module runs as written, the rest is traced.
    _hf(
        "perceiver",
        "PerceiverConfig",
        "PerceiverForImageClassificationLearned",
        pixels(2, 32),
        note="numpy on a traced shape: its preprocessor runs as written",
        num_latents=8,
        d_latents=32,
        d_model=32,
        num_blocks=1,
        num_self_attends_per_block=2,
        num_self_attention_heads=4,
        num_cross_attention_heads=1,
        image_size=32,
        num_labels=5,
    ),
    # Output capturing (forward hooks transformers installs on the first such call).
    _hf(
        "llama_hidden_states",
        "LlamaConfig",
        "LlamaForCausalLM",
        with_kwargs(_DECODER_TOKENS, output_hidden_states=True),
        **_DECODER,
    ),
    _hf(
        "bert_hidden_states_attentions",
        "BertConfig",
        "BertModel",
        with_kwargs(_TOKENS, output_hidden_states=True, output_attentions=True),
        **_SMALL,
    ),
    # Its blocks (opaque) return tuples: the output-capturing hooks fired on a block's
    # proxy must take its first item, not the whole tuple.
    _hf(
        "switch_hidden_states",
        "SwitchTransformersConfig",
        "SwitchTransformersModel",
        with_kwargs(seq2seq(2, 16, VOCAB), output_hidden_states=True),
        note="MoE encoder-decoder; tuple-returning blocks under output capturing",
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
    ),
    # Its relative attention runs opaque and returns (h, None); the layer's
    # `if output_g is not None:` must see the None (it traced the other branch).
    _hf(
        "xlnet",
        "XLNetConfig",
        "XLNetModel",
        _TOKENS,
        note="an opaque call returning None in a tuple",
        vocab_size=VOCAB,
        d_model=32,
        n_layer=2,
        n_head=4,
        d_inner=37,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
]

TRANSFORMERS += [
    _hf("mpnet", "MPNetConfig", "MPNetModel", _TOKENS, **_SMALL),
    _hf("convbert", "ConvBertConfig", "ConvBertModel", _TOKENS, note="span-based dynamic convolution", **_SMALL),
    _hf("roformer", "RoFormerConfig", "RoFormerModel", _TOKENS, **_SMALL),
    _hf(
        "yoso",
        "YosoConfig",
        "YosoModel",
        _TOKENS,
        note="an autograd Function with its own (approximate) backward",
        **_ENCODER,
    ),
    _hf(
        "ctrl",
        "CTRLConfig",
        "CTRLLMHeadModel",
        _DECODER_TOKENS,
        note="its forward assigns a buffer to itself every call",
        dff=37,
        **_GPT,
    ),
    _hf(
        "recurrent_gemma",
        "RecurrentGemmaConfig",
        "RecurrentGemmaForCausalLM",
        _DECODER_TOKENS,
        note="a linear recurrence scanned step by step; its forward keeps the last state as an attribute",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        lru_width=32,
        attention_window_size=8,
        conv1d_width=4,
        logits_soft_cap=30.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    _hf(
        "cohere2",
        "Cohere2Config",
        "Cohere2ForCausalLM",
        _DECODER_TOKENS,
        note="sliding-window and global layers",
        **dict(_DECODER, sliding_window=8),
    ),
    _hf(
        "swinv2",
        "Swinv2Config",
        "Swinv2ForImageClassification",
        pixels(2, 32),
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
        num_labels=5,
    ),
    _hf(
        "upernet_convnext",
        "UperNetConfig",
        "UperNetForSemanticSegmentation",
        pixels(2, 64),
        note="pyramid pooling branches over a ConvNeXt backbone",
        backbone_config=dict(
            model_type="convnext",
            hidden_sizes=[8, 16, 24, 32],
            depths=[1, 1, 1, 1],
            out_features=["stage1", "stage2", "stage3", "stage4"],
        ),
        hidden_size=16,
        auxiliary_in_channels=24,
        auxiliary_channels=8,
        num_labels=3,
    ),
]


def with_languages(inputs: Callable[[int], Inputs], languages: int = 2) -> Callable[[int], Inputs]:
    """``inputs`` with X-MOD's ``lang_ids`` (one language per row), by seed in turn: rows
    of different languages (each adapter reads as many rows), then every row in one
    language (the other adapters read none)."""

    def make(seed: int) -> Inputs:
        args, kwargs = inputs(seed)
        batch = kwargs["input_ids"].shape[0]
        turn = seed % (languages + 1)
        rows = [r % languages if turn == 1 else min(turn, languages - 1) for r in range(batch)]
        return args, {**kwargs, "lang_ids": torch.tensor(rows)}

    return make


TRANSFORMERS += [
    _hf(
        "xmod",
        "XmodConfig",
        "XmodModel",
        with_languages(_TOKENS),
        note="a language adapter per layer, chosen per row by lang_ids (data-dependent routing)",
        **dict(_ENCODER, languages=["en_XX", "de_DE"], default_language="en_XX"),
    ),
    _hf(
        "ibert_quant",
        "IBertConfig",
        "IBertModel",
        _TOKENS,
        note="integer-only quantisation: autograd Functions (straight-through rounding), "
        "activation ranges kept in buffers updated in training",
        **dict(_ENCODER, quant_mode=True),
    ),
    _hf(
        "deepseek_v2",
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        _DECODER_TOKENS,
        note="latent attention (low-rank q and kv); group-limited top-k routed and shared experts",
        **dict(
            _DECODER,
            num_key_value_heads=4,
            moe_intermediate_size=16,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            v_head_dim=8,
            qk_nope_head_dim=8,
            n_group=2,
            topk_group=1,
            topk_method="group_limited_greedy",
        ),
    ),
    _hf(
        "zamba2",
        "Zamba2Config",
        "Zamba2ForCausalLM",
        _DECODER_TOKENS,
        note="Mamba2 layers and one shared attention block reused with per-layer LoRA adapters",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_head_dim=16,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_headdim=16,
        mamba_ngroups=1,
        n_mamba_heads=4,
        chunk_size=8,
        num_mem_blocks=1,
        use_mem_rope=True,
        use_shared_attention_adapter=True,
        adapter_rank=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
]


def seq2seq_labels(batch: int, length: int, vocab: int) -> Callable[[int], Inputs]:
    """Encoder ids with padding and decoder ``labels`` (the model shifts them into its
    decoder inputs), some set to -100 (ignored by the loss), where by the seed."""

    def make(seed: int) -> Inputs:
        g = _g(seed)
        ids = torch.randint(3, vocab, (batch, length), generator=g)
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[1, length - 3 :] = 0
        labels = torch.randint(3, vocab, (batch, length // 2), generator=g)
        labels[seed % batch, seed % (length // 2) :] = -100
        return (), {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return make


def layout_tokens(batch: int, length: int, vocab: int) -> Callable[[int], Inputs]:
    """LayoutLM's inputs: ids with padding and a box (x0, y0, x1, y1) per token."""

    def make(seed: int) -> Inputs:
        args, kwargs = tokens(batch, length, vocab)(seed)
        g = _g(seed + 1000)
        corner = torch.randint(0, 500, (batch, length, 2), generator=g)
        size = torch.randint(1, 400, (batch, length, 2), generator=g)
        return args, {**kwargs, "bbox": torch.cat([corner, corner + size], -1)}

    return make


def image_text(batch: int, length: int, vocab: int, size: int, image_tokens: int = 0) -> Callable[[int], Inputs]:
    """Ids and images; with ``image_tokens``, that many ids after the first two are the
    image token (the vocabulary's last), as a LLaVA prompt holds them."""

    def make(seed: int) -> Inputs:
        g = _g(seed)
        ids = torch.randint(3, vocab - 2, (batch, length), generator=g)
        ids[:, 2 : 2 + image_tokens] = vocab - 1
        kwargs = {"input_ids": ids, "pixel_values": torch.randn(batch, 3, size, size, generator=g)}
        if image_tokens:
            kwargs.update(attention_mask=torch.ones_like(ids), use_cache=False)
        return (), kwargs

    return make


def _blip() -> nn.Module:
    import transformers

    text = dict(_SMALL, max_position_embeddings=32)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    config = transformers.BlipConfig(
        text_config=text, vision_config=dict(vision, image_size=32, patch_size=8), projection_dim=16
    )
    return transformers.BlipModel(config)


def _llava() -> nn.Module:
    import transformers

    vision = dict(
        model_type="clip_vision_model",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        image_size=32,
        patch_size=8,
        projection_dim=16,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=dict(model_type="llama", **_DECODER),
        image_token_index=VOCAB - 1,
        vision_feature_layer=-1,
    )
    return transformers.LlavaForConditionalGeneration(config)


_T5_SMALL = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, decoder_start_token_id=0)

TRANSFORMERS += [
    # Their loss modules are built in the forward (loss_fct = CrossEntropyLoss()).
    _hf(
        "t5_labels",
        "T5Config",
        "T5ForConditionalGeneration",
        seq2seq_labels(2, 16, VOCAB),
        note="labels shifted into decoder inputs in place; a loss module built in the forward",
        **_T5_SMALL,
    ),
    _hf(
        "bart_labels",
        "BartConfig",
        "BartForConditionalGeneration",
        seq2seq_labels(2, 16, VOCAB),
        note="labels shifted into decoder inputs; a loss module built in the forward",
        **_SEQ2SEQ,
    ),
    _hf(
        "qwen2_moe",
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        _DECODER_TOKENS,
        note="top-k routed experts (data-dependent) and a gated shared expert",
        **dict(
            _DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16
        ),
    ),
    _hf(
        "mamba2",
        "Mamba2Config",
        "Mamba2ForCausalLM",
        tokens(2, 16, VOCAB, padded=False, use_cache=False),
        note="chunked state-space scan in plain torch",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_heads=4,
        head_dim=16,
        state_size=8,
        expand=2,
        n_groups=1,
        chunk_size=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    _hf(
        "layoutlm", "LayoutLMConfig", "LayoutLMModel", layout_tokens(2, 12, VOCAB), note="2-D box embeddings", **_SMALL
    ),
    _spec("hf_blip", "transformers", _blip, image_text(2, 10, VOCAB, 32), "text and vision towers"),
    _spec(
        "hf_llava",
        "transformers",
        _llava,
        image_text(2, 26, VOCAB, 32, image_tokens=16),
        "image features scattered into the token embeddings at the image tokens",
    ),
]

# More families, each built from a small config: encoders (convolutional, Fourier,
# funnel-pooled, character-level, protein), decoders (multi-query attention, partial rotary,
# parallel attention and MLP), encoder-decoders with sinusoidal or windowed attention.
TRANSFORMERS += [
    _hf(
        "squeezebert",
        "SqueezeBertConfig",
        "SqueezeBertModel",
        _TOKENS,
        note="grouped 1x1 convolutions in place of linear layers",
        **dict(
            _ENCODER,
            embedding_size=32,
            q_groups=2,
            k_groups=2,
            v_groups=2,
            post_attention_groups=1,
            intermediate_groups=1,
            output_groups=1,
        ),
    ),
    _hf(
        "gpt_bigcode",
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        _DECODER_TOKENS,
        note="multi-query attention; its dropout rate held as a float attribute",
        **_GPT,
    ),
    _hf("funnel", "FunnelConfig", "FunnelModel", _TOKENS, vocab_size=VOCAB, block_sizes=[1, 1], d_model=32, n_head=4),
    _hf("fnet", "FNetConfig", "FNetModel", _TOKENS, note="Fourier transforms for attention", **_ENCODER),
    _hf("esm", "EsmConfig", "EsmModel", _TOKENS, **dict(_ENCODER, pad_token_id=1)),
    _hf("data2vec_text", "Data2VecTextConfig", "Data2VecTextModel", _TOKENS, **_ENCODER),
    _hf(
        "canine",
        "CanineConfig",
        "CanineModel",
        _TOKENS,
        note="characters hashed, downsampled and upsampled",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        downsampling_rate=2,
        num_hash_buckets=64,
        num_hash_functions=2,
    ),
    _hf("biogpt", "BioGptConfig", "BioGptForCausalLM", _DECODER_TOKENS, **_SMALL),
    _hf("codegen", "CodeGenConfig", "CodeGenForCausalLM", _DECODER_TOKENS, rotary_dim=4, **_GPT),
    _hf(
        "gptj",
        "GPTJConfig",
        "GPTJForCausalLM",
        _DECODER_TOKENS,
        note="attention and MLP in parallel",
        rotary_dim=4,
        **_GPT,
    ),
    _hf(
        "xglm",
        "XGLMConfig",
        "XGLMForCausalLM",
        _DECODER_TOKENS,
        vocab_size=VOCAB,
        d_model=32,
        num_layers=2,
        attention_heads=4,
        ffn_dim=37,
        max_position_embeddings=64,
    ),
    _hf("olmo", "OlmoConfig", "OlmoForCausalLM", _DECODER_TOKENS, **_GQA),
    _hf("stablelm", "StableLmConfig", "StableLmForCausalLM", _DECODER_TOKENS, **_GQA),
    _hf("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", _DECODER_TOKENS, **_GQA),
    _hf("granite", "GraniteConfig", "GraniteForCausalLM", _DECODER_TOKENS, **_GQA),
    _hf("phi3", "Phi3Config", "Phi3ForCausalLM", _DECODER_TOKENS, **_GQA),
    _hf("pegasus", "PegasusConfig", "PegasusModel", seq2seq(2, 16, VOCAB), **_SEQ2SEQ),
    _hf(
        "led",
        "LEDConfig",
        "LEDModel",
        seq2seq(2, 16, VOCAB),
        note="windowed (Longformer) encoder attention",
        **dict(
            _SEQ2SEQ,
            max_encoder_position_embeddings=64,
            max_decoder_position_embeddings=64,
            attention_window=[4, 4],
        ),
    ),
]


# --- more families: attention variants, state-space and recurrent decoders, more
# mixtures of experts, speech, depth, time series, models that draw random numbers in
# their forward (ViTMAE's masking noise; PhiMoE's sampled routing in training) -----------


def series(batch: int, context: int, prediction: int, features: int = 1) -> Callable[[int], Inputs]:
    """A time-series transformer's past and future values, time features and mask."""

    def make(seed: int) -> Inputs:
        g = _g(seed)
        return (), {
            "past_values": torch.randn(batch, context, generator=g),
            "past_time_features": torch.randn(batch, context, features, generator=g),
            "past_observed_mask": torch.ones(batch, context),
            "future_values": torch.randn(batch, prediction, generator=g),
            "future_time_features": torch.randn(batch, prediction, features, generator=g),
        }

    return make


def channels_series(batch: int, length: int, channels: int) -> Callable[[int], Inputs]:
    def make(seed: int) -> Inputs:
        return (), {"past_values": torch.randn(batch, length, channels, generator=_g(seed))}

    return make


def spectrogram(batch: int, frames: int, bins: int) -> Callable[[int], Inputs]:
    def make(seed: int) -> Inputs:
        return (torch.randn(batch, frames, bins, generator=_g(seed)),), {}

    return make


def waveform(batch: int, samples: int) -> Callable[[int], Inputs]:
    """``[batch, 1, samples]`` audio, positional (EnCodec)."""

    def make(seed: int) -> Inputs:
        return (torch.randn(batch, 1, samples, generator=_g(seed)),), {}

    return make


def text_and_image(batch: int, length: int, vocab: int, size: int) -> Callable[[int], Inputs]:
    def make(seed: int) -> Inputs:
        g = _g(seed)
        return (), {
            "input_ids": torch.randint(0, vocab, (batch, length), generator=g),
            "pixel_values": torch.randn(batch, 3, size, size, generator=g),
        }

    return make


def speech_to_text(batch: int, samples: int, decoder: int, vocab: int) -> Callable[[int], Inputs]:
    def make(seed: int) -> Inputs:
        g = _g(seed)
        return (), {
            "input_values": torch.randn(batch, samples, generator=g),
            "decoder_input_ids": torch.randint(3, vocab, (batch, decoder), generator=g),
        }

    return make


_CONV_FEATURES = dict(
    conv_dim=(16, 16),
    conv_stride=(5, 4),
    conv_kernel=(10, 4),
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=2,
)
_CONV_AUDIO = dict(_SMALL, **_CONV_FEATURES)
_T5_SMALL = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, decoder_start_token_id=0)
_SMALL_PIXELS = dict(_SMALL, image_size=32, patch_size=8)

TORCHVISION += [
    _tv("efficientnet_v2_s", num_classes=10),
    _tv("regnet_x_400mf", num_classes=10),
    _tv("swin_v2_t", num_classes=10),
    _tv_class(
        "fcn_resnet50",
        "segmentation.fcn_resnet50",
        images(1, 32),
        note="OrderedDict with aux output",
        weights=None,
        weights_backbone=None,
        num_classes=3,
        aux_loss=True,
    ),
]

TIMM += [
    _timm("mobileone_s0"),
    _timm("tinynet_e"),
    _timm("fbnetv3_b"),
    _timm("hardcorenas_a"),
    _timm("spnasnet_100"),
    _timm("darknet17"),
    _timm("legacy_seresnet18"),
    _timm("botnet26t_256", img_size=64),
    _timm("volo_d1_224", img_size=64, note="outlook attention"),
    _timm("twins_svt_small", img_size=64),
    _timm("pvt_v2_b0"),
    _timm("sequencer2d_s", note="bidirectional LSTMs over rows and columns"),
    _timm("gmlp_ti16_224", img_size=64),
    _timm("vit_relpos_small_patch16_224", img_size=64),
    _timm("flexivit_small", img_size=64),
    _timm("deit3_small_patch16_224", img_size=64),
    _timm("swinv2_cr_tiny_ns_224", img_size=64),
    _timm("nest_tiny_jx", img_size=64),
    _timm("tiny_vit_5m_224", size=224),
    _timm("mobilevitv2_050"),
    _timm("nextvit_small", size=32),
    _timm("resnetrs50"),
    _timm("res2next50"),
    _timm("vovnet39a"),
    _timm("regnetx_002"),
    _timm("mvitv2_tiny", img_size=64),
    _timm("nf_regnet_b0"),
    _timm("tf_efficientnet_b0", note="TensorFlow 'same' padding"),
    _timm("convmixer_768_32", size=32),
    _timm("vit_small_patch16_rope_224", img_size=64),
]

TRANSFORMERS += [
    _hf("longformer", "LongformerConfig", "LongformerModel", _TOKENS, **dict(_SMALL, attention_window=4)),
    _hf("big_bird", "BigBirdConfig", "BigBirdModel", _TOKENS, **dict(_SMALL, attention_type="original_full")),
    _hf("xlm_roberta", "XLMRobertaConfig", "XLMRobertaModel", _TOKENS, **_ENCODER),
    _hf("megatron_bert", "MegatronBertConfig", "MegatronBertModel", _TOKENS, **_SMALL),
    _hf(
        "rembert",
        "RemBertConfig",
        "RemBertModel",
        _TOKENS,
        **dict(_SMALL, input_embedding_size=16, output_embedding_size=16),
    ),
    _hf("ernie", "ErnieConfig", "ErnieModel", _TOKENS, **_SMALL),
    _hf("mra", "MraConfig", "MraModel", _TOKENS, **_ENCODER),
    _hf("luke", "LukeConfig", "LukeModel", _TOKENS, **dict(_SMALL, entity_vocab_size=16, entity_emb_size=16)),
    _hf(
        "xlm",
        "XLMConfig",
        "XLMModel",
        _TOKENS,
        vocab_size=VOCAB,
        emb_dim=32,
        n_layers=2,
        n_heads=4,
        max_position_embeddings=64,
    ),
    _hf(
        "flaubert",
        "FlaubertConfig",
        "FlaubertModel",
        _TOKENS,
        vocab_size=VOCAB,
        emb_dim=32,
        n_layers=2,
        n_heads=4,
        max_position_embeddings=64,
        layerdrop=0.0,
    ),
    _hf("dinov2", "Dinov2Config", "Dinov2Model", pixels(2, 32), **_SMALL_PIXELS),
    _hf(
        "vit_mae",
        "ViTMAEConfig",
        "ViTMAEModel",
        pixels(2, 32),
        note="random masking noise drawn in every forward",
        **dict(_SMALL_PIXELS, mask_ratio=0.0),
    ),
    _hf(
        "vit_mae_pretraining",
        "ViTMAEConfig",
        "ViTMAEForPreTraining",
        pixels(2, 32),
        note="half the patches masked at random, a decoder, the loss",
        **dict(
            _SMALL_PIXELS,
            mask_ratio=0.5,
            decoder_hidden_size=16,
            decoder_num_hidden_layers=1,
            decoder_num_attention_heads=2,
            decoder_intermediate_size=20,
        ),
    ),
    _hf("beit", "BeitConfig", "BeitModel", pixels(2, 32), **dict(_SMALL_PIXELS, use_relative_position_bias=True)),
    _hf("data2vec_vision", "Data2VecVisionConfig", "Data2VecVisionModel", pixels(2, 32), **_SMALL_PIXELS),
    _hf(
        "deit",
        "DeiTConfig",
        "DeiTForImageClassificationWithTeacher",
        pixels(2, 32),
        **dict(_SMALL_PIXELS, num_labels=4),
    ),
    _hf(
        "mobilevit",
        "MobileViTConfig",
        "MobileViTModel",
        pixels(2, 64),
        image_size=64,
        hidden_sizes=[16, 24, 32],
        neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32],
    ),
    _hf(
        "levit",
        "LevitConfig",
        "LevitModel",
        pixels(2, 64),
        image_size=64,
        hidden_sizes=[16, 24, 32],
        num_attention_heads=[1, 2, 2],
        depths=[1, 1, 1],
        key_dim=[8, 8, 8],
    ),
    _hf(
        "poolformer", "PoolFormerConfig", "PoolFormerModel", pixels(2, 32), hidden_sizes=[8, 16, 24, 32], depths=[1] * 4
    ),
    _hf(
        "convnextv2",
        "ConvNextV2Config",
        "ConvNextV2Model",
        pixels(2, 32),
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_stages=2,
    ),
    _hf("resnet", "ResNetConfig", "ResNetModel", pixels(2, 32), hidden_sizes=[8, 16], depths=[1, 1], embedding_size=8),
    _hf(
        "regnet",
        "RegNetConfig",
        "RegNetModel",
        pixels(2, 32),
        hidden_sizes=[8, 16],
        depths=[1, 1],
        embedding_size=8,
        groups_width=4,
    ),
    _hf(
        "bit",
        "BitConfig",
        "BitModel",
        pixels(2, 32),
        note="weight-standardised convolutions, group norm",
        hidden_sizes=[16, 32],
        depths=[1, 1],
        embedding_size=16,
        num_groups=4,
    ),
    _hf("mobilenet_v2", "MobileNetV2Config", "MobileNetV2Model", pixels(2, 32), image_size=32, depth_multiplier=0.25),
    _hf(
        "focalnet",
        "FocalNetConfig",
        "FocalNetModel",
        pixels(2, 32),
        image_size=32,
        embed_dim=16,
        depths=[1, 1],
        focal_levels=[2, 2],
        focal_windows=[3, 3],
    ),
    _hf(
        "pvt_v2",
        "PvtV2Config",
        "PvtV2Model",
        pixels(2, 32),
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_encoder_blocks=2,
        num_attention_heads=[1, 2],
        sr_ratios=[2, 1],
        patch_sizes=[7, 3],
        strides=[4, 2],
        mlp_ratios=[2, 2],
    ),
    _hf(
        "siglip_vision",
        "SiglipVisionConfig",
        "SiglipVisionModel",
        pixels(2, 32),
        **dict(_SMALL_PIXELS, vocab_size=None),
    ),
    _hf(
        "owlvit_vision",
        "OwlViTVisionConfig",
        "OwlViTVisionModel",
        pixels(2, 32),
        **dict(_SMALL_PIXELS, vocab_size=None),
    ),
    _hf(
        "groupvit_vision",
        "GroupViTVisionConfig",
        "GroupViTVisionModel",
        pixels(2, 32),
        note="grouping tokens, hard assignment with a straight-through gradient",
        hidden_size=32,
        depths=[1, 1, 1],
        num_group_tokens=[8, 4, 0],
        num_output_groups=[8, 4, 4],
        num_attention_heads=4,
        intermediate_size=37,
        image_size=32,
        patch_size=8,
    ),
    _hf("vilt", "ViltConfig", "ViltModel", text_and_image(2, 8, VOCAB, 32), **dict(_SMALL_PIXELS, max_image_length=-1)),
    _hf(
        "dpt",
        "DPTConfig",
        "DPTForDepthEstimation",
        pixels(2, 32),
        **dict(
            _SMALL_PIXELS,
            backbone_out_indices=[0, 1],
            neck_hidden_sizes=[8, 16],
            fusion_hidden_size=16,
            reassemble_factors=[2, 1],
        ),
    ),
    _hf(
        "glpn",
        "GLPNConfig",
        "GLPNForDepthEstimation",
        pixels(2, 32),
        **_MIX_TRANSFORMER,
    ),
    _hf("hubert", "HubertConfig", "HubertModel", audio(2, 1600), **_CONV_AUDIO),
    _hf(
        "wavlm",
        "WavLMConfig",
        "WavLMModel",
        audio(2, 1600),
        **dict(_CONV_AUDIO, num_buckets=16, max_bucket_distance=32),
    ),
    _hf("sew", "SEWConfig", "SEWModel", audio(2, 1600), **dict(_CONV_AUDIO, squeeze_factor=2)),
    _hf(
        "data2vec_audio",
        "Data2VecAudioConfig",
        "Data2VecAudioModel",
        audio(2, 1600),
        **dict(_CONV_AUDIO, num_conv_pos_embeddings=5),
    ),
    _hf(
        "speecht5",
        "SpeechT5Config",
        "SpeechT5ForSpeechToText",
        speech_to_text(2, 3200, 6, VOCAB),
        vocab_size=VOCAB,
        hidden_size=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        mask_time_prob=0.0,
        max_speech_positions=512,
        max_text_positions=64,
        speech_decoder_prenet_units=16,
        **_CONV_FEATURES,
    ),
    _hf(
        "encodec",
        "EncodecConfig",
        "EncodecModel",
        waveform(1, 1600),
        note="convolutional codec with an LSTM and a residual vector quantiser",
        hidden_size=32,
        num_filters=4,
        upsampling_ratios=[4, 2],
        codebook_size=16,
        codebook_dim=32,
        num_lstm_layers=1,
    ),
    _hf(
        "ast",
        "ASTConfig",
        "ASTModel",
        spectrogram(2, 64, 16),
        **dict(_SMALL, max_length=64, num_mel_bins=16, patch_size=8),
    ),
    _hf("mt5", "MT5Config", "MT5Model", seq2seq(2, 16, VOCAB), **_T5_SMALL),
    _hf(
        "longt5",
        "LongT5Config",
        "LongT5Model",
        seq2seq(2, 16, VOCAB),
        note="transient-global attention",
        **dict(_T5_SMALL, local_radius=4, encoder_attention_type="transient-global", global_block_size=4),
    ),
    _hf("umt5", "UMT5Config", "UMT5Model", seq2seq(2, 16, VOCAB), **_T5_SMALL),
    _hf("mbart", "MBartConfig", "MBartModel", seq2seq(2, 16, VOCAB), **_SEQ2SEQ),
    _hf("blenderbot", "BlenderbotConfig", "BlenderbotModel", seq2seq(2, 16, VOCAB), **_SEQ2SEQ),
    _hf("m2m100", "M2M100Config", "M2M100Model", seq2seq(2, 16, VOCAB), **_SEQ2SEQ),
    _hf("plbart", "PLBartConfig", "PLBartModel", seq2seq(2, 16, VOCAB), **_SEQ2SEQ),
    _hf(
        "fsmt",
        "FSMTConfig",
        "FSMTModel",
        seq2seq(2, 16, VOCAB),
        langs=["en", "de"],
        src_vocab_size=VOCAB,
        tgt_vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        max_position_embeddings=64,
        decoder_start_token_id=2,
    ),
    _hf(
        "pegasus_x",
        "PegasusXConfig",
        "PegasusXModel",
        seq2seq(2, 16, VOCAB),
        note="staggered local blocks and global tokens",
        **dict(_SEQ2SEQ, num_global_tokens=4, block_size=8, stagger_local_blocks=True),
    ),
    _hf(
        "bigbird_pegasus",
        "BigBirdPegasusConfig",
        "BigBirdPegasusModel",
        seq2seq(2, 16, VOCAB),
        **dict(_SEQ2SEQ, attention_type="original_full"),
    ),
    _hf(
        "prophetnet",
        "ProphetNetConfig",
        "ProphetNetModel",
        seq2seq(2, 16, VOCAB),
        note="n-gram self-attention in the decoder",
        vocab_size=VOCAB,
        hidden_size=32,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        num_encoder_layers=2,
        num_decoder_layers=2,
        num_encoder_attention_heads=4,
        num_decoder_attention_heads=4,
        ngram=2,
        num_buckets=8,
        relative_max_distance=16,
        max_position_embeddings=64,
        decoder_start_token_id=0,
    ),
    _hf(
        "nllb_moe",
        "NllbMoeConfig",
        "NllbMoeModel",
        seq2seq(2, 16, VOCAB),
        note="top-2 experts with a capacity",
        **dict(_SEQ2SEQ, num_experts=4, expert_capacity=8, encoder_sparse_step=1, decoder_sparse_step=1),
    ),
    _hf("gemma", "GemmaConfig", "GemmaForCausalLM", _DECODER_TOKENS, **dict(_DECODER, head_dim=8)),
    _hf(
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        _DECODER_TOKENS,
        **dict(_DECODER, head_dim=8, sliding_window=8),
    ),
    _hf("olmo2", "Olmo2Config", "Olmo2ForCausalLM", _DECODER_TOKENS, **_DECODER),
    _hf(
        "olmoe",
        "OlmoeConfig",
        "OlmoeForCausalLM",
        _DECODER_TOKENS,
        **dict(_DECODER, num_experts=4, num_experts_per_tok=2),
    ),
    _hf(
        "granitemoe",
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        _DECODER_TOKENS,
        **dict(_DECODER, num_local_experts=4, num_experts_per_tok=2),
    ),
    _hf(
        "phimoe",
        "PhimoeConfig",
        "PhimoeForCausalLM",
        _DECODER_TOKENS,
        note="routing sampled at random in training (sparsemixer)",
        **dict(_DECODER, num_local_experts=4, num_experts_per_tok=2),
    ),
    _hf(
        "qwen3_moe",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        _DECODER_TOKENS,
        **dict(_DECODER, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    ),
    _hf(
        "gpt_oss",
        "GptOssConfig",
        "GptOssForCausalLM",
        _DECODER_TOKENS,
        note="attention sinks, alternating sliding windows, experts",
        **dict(_DECODER, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    ),
    _hf("nemotron", "NemotronConfig", "NemotronForCausalLM", _DECODER_TOKENS, **dict(_DECODER, head_dim=8)),
    _hf("glm4", "Glm4Config", "Glm4ForCausalLM", _DECODER_TOKENS, **dict(_DECODER, head_dim=8)),
    _hf("helium", "HeliumConfig", "HeliumForCausalLM", _DECODER_TOKENS, **dict(_DECODER, head_dim=8)),
    _hf("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", _DECODER_TOKENS, **_DECODER),
    _hf("persimmon", "PersimmonConfig", "PersimmonForCausalLM", _DECODER_TOKENS, **_DECODER),
    _hf(
        "lfm2", "Lfm2Config", "Lfm2ForCausalLM", _DECODER_TOKENS, note="short convolutions beside attention", **_DECODER
    ),
    _hf("doge", "DogeConfig", "DogeForCausalLM", _DECODER_TOKENS, **_DECODER),
    _hf(
        "mpt",
        "MptConfig",
        "MptForCausalLM",
        _DECODER_TOKENS,
        note="ALiBi",
        vocab_size=VOCAB,
        d_model=32,
        n_heads=4,
        n_layers=2,
        max_seq_len=64,
    ),
    _hf(
        "dbrx",
        "DbrxConfig",
        "DbrxForCausalLM",
        _DECODER_TOKENS,
        vocab_size=VOCAB,
        d_model=32,
        n_heads=4,
        n_layers=2,
        max_seq_len=64,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
    ),
    _hf(
        "mamba",
        "MambaConfig",
        "MambaForCausalLM",
        _DECODER_TOKENS,
        note="selective scan in PyTorch",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        state_size=4,
    ),
    _hf(
        "falcon_mamba",
        "FalconMambaConfig",
        "FalconMambaForCausalLM",
        _DECODER_TOKENS,
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        state_size=4,
    ),
    _hf(
        "rwkv",
        "RwkvConfig",
        "RwkvForCausalLM",
        _DECODER_TOKENS,
        note="recurrent time mixing",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        attention_hidden_size=32,
        intermediate_size=64,
        context_length=64,
    ),
    _hf(
        "jamba",
        "JambaConfig",
        "JambaForCausalLM",
        _DECODER_TOKENS,
        note="attention and Mamba layers, experts every other layer",
        **dict(
            _DECODER,
            num_experts=2,
            num_experts_per_tok=1,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=4,
            mamba_dt_rank=4,
        ),
    ),
    _hf(
        "patchtst",
        "PatchTSTConfig",
        "PatchTSTModel",
        channels_series(2, 32, 3),
        num_input_channels=3,
        context_length=32,
        patch_length=8,
        patch_stride=8,
        d_model=16,
        num_attention_heads=2,
        num_hidden_layers=2,
        ffn_dim=32,
    ),
    _hf(
        "time_series_transformer",
        "TimeSeriesTransformerConfig",
        "TimeSeriesTransformerModel",
        series(2, 13, 4),
        note="lagged features, scaling, an encoder-decoder",
        prediction_length=4,
        context_length=10,
        lags_sequence=[1, 2, 3],
        num_time_features=1,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=16,
        decoder_ffn_dim=16,
    ),
]

SPECS: list[ModelSpec] = TORCHVISION + TIMM + TRANSFORMERS
BY_NAME = {s.name: s for s in SPECS}
