"""Models torchalpa was not written for: transformers and torchvision architectures, and
plain PyTorch idioms.

Each case builds a model with random weights (no download) and the batch it is trained
on, called the way its own documentation calls it: HuggingFace models by keyword
(``model(input_ids=ids, labels=ids)``, ``model(pixel_values=x, labels=y)``) with the loss
computed by the model, plain modules positionally with a ``loss_fn``. HuggingFace configs
keep their defaults (``use_cache`` included) except sizes, shrunk to a few thousand
parameters, and randomness (dropout, stochastic depth, SpecAugment masks), switched off so
runs on several devices can be compared with one device exactly. torchvision classifiers
are built from torchvision's own classes (ResNet, MobileNet, EfficientNet, ConvNeXt, Swin,
MaxViT, ...) with small widths, dropout and stochastic depth off; torchvision's
segmentation models (FCN, DeepLabV3, LR-ASPP) by their public builders at 64 x 64.

``SUITE`` maps a case name to a ``SuiteCase``; ``tests/test_suite.py`` trains each on 4
gloo ranks next to one device, and ``torchalpa coverage --hf`` prints what each captures.
``known_failure`` says why a case is expected to fail today (the test marks it xfail).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from torchalpa.models.sizes import BATCH, SEQ, VOCAB, no_randomness

__all__ = ["SuiteCase", "SUITE", "FAST", "build_case"]



@dataclass(frozen=True)
class SuiteCase:
    """One model of the suite: ``make()`` -> (model, example_inputs, loss_fn)."""

    name: str
    family: str                     # decoder, encoder, encoder-decoder, vision, moe, idiom, audio, multimodal
    make: Callable[[], tuple[nn.Module, Any, Callable | None]]
    known_failure: str | None = None
    dtype: torch.dtype = torch.float32
    """Weights and floating inputs (``build_case`` casts them). float64 where float32
    rounding, amplified by the model itself, makes one device disagree with itself."""



def _hf(config_cls: str, model_cls: str, **fields):
    import transformers
    config = getattr(transformers, config_cls)(**fields)
    no_randomness(config)
    return getattr(transformers, model_cls)(config)


def _tokens(*shape) -> torch.Tensor:
    return torch.randint(3, VOCAB, shape)


def _causal_lm(config_cls: str, model_cls: str, **fields):
    """A decoder LM with its default config but small sizes, trained on its own labels."""
    def make():
        sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=64)
        model = _hf(config_cls, model_cls, **{**sizes, **fields})
        ids = _tokens(BATCH, SEQ)
        return model, {"input_ids": ids, "labels": ids}, None
    return make


def _swept(task: str, model_type: str, cls_name: str):
    """An architecture as the HF sweep (``benchmarks/hf_sweep.py``) builds it: the default
    config through the generic shrinker (``torchalpa/suite/hf_shrink.py``), its batch."""
    def make():
        from torchalpa.suite.hf_shrink import build_model, example_batch
        model = build_model(task, model_type, cls_name)
        return model, example_batch(task, model), None
    return make


def _encoder(config_cls: str, model_cls: str, **fields):
    """A text encoder with a sequence-classification head."""
    def make():
        sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                     num_labels=3)
        model = _hf(config_cls, model_cls, **{**sizes, **fields})
        ids = _tokens(BATCH, SEQ)
        return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                       "labels": torch.randint(3, (BATCH,))}, None
    return make


def _seq2seq(config_cls: str, model_cls: str, **fields):
    """An encoder-decoder trained on labels (the model shifts them into decoder inputs)."""
    def make():
        model = _hf(config_cls, model_cls, **fields)
        ids = _tokens(BATCH, SEQ)
        return model, {"input_ids": ids, "labels": _tokens(BATCH, SEQ)}, None
    return make


def _vision(config_cls: str, model_cls: str, *, image: int = 32, **fields):
    """An image classifier on (B, 3, H, W) pixels."""
    def make():
        model = _hf(config_cls, model_cls, num_labels=3, **fields)
        return model, {"pixel_values": torch.randn(BATCH, 3, image, image),
                       "labels": torch.randint(3, (BATCH,))}, None
    return make


_SEQ2SEQ_SIZES = dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                      encoder_attention_heads=4, decoder_attention_heads=4,
                      encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)


def _whisper():
    """Whisper on (B, mel bins, frames) features, trained on labels."""
    sizes = {k: v for k, v in _SEQ2SEQ_SIZES.items() if k != "max_position_embeddings"}
    model = _hf("WhisperConfig", "WhisperForConditionalGeneration", **sizes,
                num_mel_bins=8, max_source_positions=16, max_target_positions=64,
                decoder_start_token_id=1, pad_token_id=0)
    return model, {"input_features": torch.randn(BATCH, 8, 32),
                   "labels": _tokens(BATCH, SEQ)}, None


def _clip():
    """CLIP's text and vision towers under its contrastive loss (``return_loss=True``)."""
    import transformers
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4)
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, max_position_embeddings=64, **tower),
        vision_config=dict(image_size=32, patch_size=8, **tower), projection_dim=16)
    no_randomness(config)
    return transformers.CLIPModel(config), {
        "input_ids": _tokens(BATCH, SEQ), "pixel_values": torch.randn(BATCH, 3, 32, 32),
        "return_loss": True}, None


def _wav2vec2():
    """Wav2Vec2's convolutional feature extractor and encoder, classifying raw audio."""
    model = _hf("Wav2Vec2Config", "Wav2Vec2ForSequenceClassification", hidden_size=32,
                num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                classifier_proj_size=16, num_labels=3)
    return model, {"input_values": torch.randn(BATCH, 400),
                   "labels": torch.randint(3, (BATCH,))}, None


# -- plain PyTorch idioms ------------------------------------------------------------------

class ConvBatchNorm(nn.Module):
    """Conv + BatchNorm2d (running statistics are buffer updates) + pooling."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8),
                                      nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):                                   # (B, 3, 8, 8)
        return self.head(self.features(x).flatten(1))       # (B, 5)


class Recurrent(nn.Module):
    """An embedding, a 2-layer recurrent layer and a per-step classifier."""

    def __init__(self, cell: type[nn.Module]):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.rnn = cell(16, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):                                 # (B, T)
        out, _ = self.rnn(self.embed(ids))                  # (B, T, 16)
        return self.head(out)                               # (B, T, V)


class CheckpointedMLP(nn.Module):
    """Residual blocks under ``torch.utils.checkpoint``: recomputed in backward."""

    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.embed = nn.Linear(16, 16)        # reentrant checkpoints need an input with grad
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(),
                                                  nn.Linear(32, 16)) for _ in range(2))
        self.norm = nn.LayerNorm(16)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.norm(x)


class MaskedAttention(nn.Module):
    """nn.TransformerEncoder with a causal mask and a padding mask."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 4)

    def forward(self, x, padding):                          # (B, T, 16), (B, T) bool
        T = x.shape[1]
        causal = torch.triu(torch.full((T, T), float("-inf")), diagonal=1)
        # is_causal=True: without it PyTorch compares the mask's values with a causal one
        h = self.encoder(x, mask=causal, src_key_padding_mask=padding, is_causal=True)
        return self.head(h.masked_fill(padding[..., None], 0.0).mean(1))


class _ScaledGeluFn(torch.autograd.Function):
    """x * sigmoid(1.702 x) with a hand-written backward: a user's custom autograd op."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(1.702 * x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(1.702 * x)
        return grad * (s + 1.702 * x * s * (1 - s))


class CustomFunctionMLP(nn.Module):
    """An MLP whose activation is a ``torch.autograd.Function`` subclass."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):                                   # (B, 16)
        return self.down(_ScaledGeluFn.apply(self.up(x)))   # (B, 16)


class TiedLM(nn.Module):
    """A language model whose output head is its embedding table (one parameter, two uses)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):                                 # (B, T)
        return self.head(torch.tanh(self.mix(self.embed(ids))))    # (B, T, V)


class ReusedBlock(nn.Module):
    """One block called twice in forward (its gradients are the sum of both calls)."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)

    def forward(self, x):                                   # (B, 16)
        return self.head(self.block(self.block(x)))         # (B, 4)


class BufferScaled(nn.Module):
    """Buffers read in forward: a persistent per-feature scale and a non-persistent
    positional table, neither trained."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))
        self.register_buffer("positions", torch.randn(SEQ, 16), persistent=False)
        self.proj = nn.Linear(16, 4)

    def forward(self, x):                                   # (B, T, 16)
        return self.proj((x + self.positions) * self.scale).mean(1)    # (B, 4)


class WeightNormed(nn.Module):
    """A layer under ``nn.utils.parametrizations.weight_norm`` (its weight recomputed from
    two parameters, ``original0`` and ``original1``, on every read)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.utils.parametrizations.weight_norm(nn.Linear(16, 32))
        self.head = nn.Linear(32, 4)

    def forward(self, x):                                   # (B, 16)
        return self.head(torch.relu(self.norm(x)))          # (B, 4)


class AttentionWeights(nn.Module):
    """``nn.MultiheadAttention`` called with its defaults (``need_weights=True``), both
    outputs used."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16 + SEQ, 4)

    def forward(self, x):                                   # (B, T, 16)
        out, weights = self.attn(x, x, x)                   # (B, T, 16), (B, T, T)
        return self.head(torch.cat([out, weights], -1).mean(1))    # (B, 4)


class FrozenEmbedding(nn.Module):
    """A frozen (``requires_grad=False``) embedding table under a trained head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16, padding_idx=0)
        self.embed.weight.requires_grad_(False)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):                                 # (B, T)
        return self.head(self.embed(ids))                   # (B, T, V)


class Conv3dGroupNorm(nn.Module):
    """A video block: Conv3d, GroupNorm, pooling over time and space."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):                                   # (B, 3, T, H, W)
        return self.head(torch.relu(self.norm(self.conv(x))).mean((2, 3, 4)))   # (B, 4)


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _idiom(build: Callable[[], nn.Module], batch: Callable[[], tuple], loss_fn):
    def make():
        return build(), batch(), loss_fn
    return make


def _checkpointed(make_lm):
    """An HF model after ``gradient_checkpointing_enable()`` (as Trainer's
    ``gradient_checkpointing=True`` calls it)."""
    def make():
        model, batch, loss_fn = make_lm()
        model.gradient_checkpointing_enable()
        return model, batch, loss_fn
    return make


def _padding():
    pad = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    pad[:, -2:] = True
    return pad


# -- torchvision classifiers ---------------------------------------------------------------

def _torchvision():
    """``torchvision.models``, also beside the CPU build of torch.

    PyPI's torchvision wheel is built against torch's CUDA build: beside the CPU build its
    C extension (detection ops: nms, roi_align, ...) does not load, and ``import
    torchvision`` then fails registering fake kernels for ``torchvision::nms`` / ``qnms``,
    which that extension would have defined -- and so does every ``import transformers``
    that finds torchvision installed. ``make env`` therefore puts torchvision in
    ``.venv/torchvision``, off the path, and this function imports it from there: the
    classifiers are pure Python and call none of the extension's ops, so the two schemas
    are declared first (never run). An importable torchvision (a matching build) is used
    as it is.
    """
    import importlib
    import sys
    try:        # by name: torchvision is optional, and off the type checker's path
        return _import_declaring_extension_ops(importlib)
    except ModuleNotFoundError:
        import os
        beside = os.path.join(sys.prefix, "torchvision")
        if not os.path.isdir(os.path.join(beside, "torchvision")):
            raise ModuleNotFoundError(
                "the torchvision cases need torchvision: pip install torchvision (a build "
                "matching this torch), or `make env`, which puts it in .venv/torchvision"
            ) from None
        sys.path.append(beside)
    return _import_declaring_extension_ops(importlib)


def _import_declaring_extension_ops(importlib):
    """``import torchvision.models``; if that fails for want of the extension's ops, declare
    them and import again."""
    import sys
    global _TORCHVISION_OPS
    try:
        return importlib.import_module("torchvision.models")
    except RuntimeError as e:
        if "torchvision::nms" not in str(e) or _TORCHVISION_OPS is not None:
            raise
    for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
        del sys.modules[name]
    _TORCHVISION_OPS = torch.library.Library("torchvision", "DEF")
    for schema in ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                   "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"):
        _TORCHVISION_OPS.define(schema)
    return importlib.import_module("torchvision.models")


_TORCHVISION_OPS = None
IMAGE_CLASSES = 5
_WIDE = torch.float64
"""The CNNs below batch-normalize 1x1 maps of 4 images (32x32 inputs, BATCH 4): a
channel's variance over 4 values can be tiny, and dividing by it amplifies float32's
rounding. Summing the 4 images' statistics in another order (per rank, then across
ranks) then moves the first gradients by up to 1e-2 relative, and one device in float32
itself ends 10% away from float64 after 3 steps (MnasNet). Without batch norm, a ReLU
input within rounding of 0 (SqueezeNet) passes a gradient on one side and not on the
other, and AdamW then moves that entry by ``lr`` on one side only. In float64 the 4-rank
runs equal one device to 1e-9 or closer: the same arithmetic, which is what the suite
checks."""


def _classifier(build: Callable[[Any], nn.Module], image: int = 32):
    """A torchvision classifier built by ``build(torchvision.models)`` with small widths,
    randomness (dropout, stochastic depth) off, trained with cross entropy on (B, 3, H, W)."""
    def make():
        model = build(_torchvision())
        return (model, (torch.randn(BATCH, 3, image, image),
                        torch.randint(IMAGE_CLASSES, (BATCH,))), F.cross_entropy)
    return make


def _segmenter(build: Callable[[Any], nn.Module], image: int = 64):
    """A torchvision segmentation model by its public builder (random weights, no auxiliary
    head), trained with per-pixel cross entropy on its ``out`` logits, upsampled bilinearly
    to the (B, 3, H, W) input by the model itself. The builders take no dropout argument:
    the heads' ``nn.Dropout`` are set to ``p=0`` (randomness off, as for every case)."""
    def make():
        model = build(_torchvision())
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        return (model, (torch.randn(BATCH, 3, image, image),
                        torch.randint(IMAGE_CLASSES, (BATCH, image, image))),
                _segmentation_loss)
    return make


def _segmentation_loss(outputs: dict, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs["out"], target)


def _tv_resnet(m):
    return m.resnet.ResNet(m.resnet.BasicBlock, [1, 1, 1, 1], num_classes=IMAGE_CLASSES)


def _tv_resnext(m):
    return m.resnet.ResNet(m.resnet.Bottleneck, [1, 1, 1, 1], groups=4, width_per_group=4,
                           num_classes=IMAGE_CLASSES)


def _tv_convnext(m):
    config = m.convnext.CNBlockConfig
    return m.convnext.ConvNeXt([config(16, 32, 1), config(32, None, 1)],
                               stochastic_depth_prob=0.0, num_classes=IMAGE_CLASSES)


def _tv_efficientnet(m):
    conv = m.efficientnet.MBConvConfig
    return m.efficientnet.EfficientNet(
        [conv(1, 3, 1, 16, 8, 1), conv(4, 3, 2, 8, 16, 2), conv(4, 5, 2, 16, 24, 1)],
        dropout=0.0, stochastic_depth_prob=0.0, num_classes=IMAGE_CLASSES, last_channel=64)


def _tv_regnet(m):
    params = m.regnet.BlockParams.from_init_params(depth=3, w_0=16, w_a=8.0, w_m=2.0,
                                                   group_width=8, se_ratio=0.25)
    return m.regnet.RegNet(params, num_classes=IMAGE_CLASSES, stem_width=8)


def _tv_vit(m):
    return m.vision_transformer.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=32, mlp_dim=64,
        num_classes=IMAGE_CLASSES)


def _tv_swin(m):
    return m.swin_transformer.SwinTransformer(
        patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
        stochastic_depth_prob=0.0, num_classes=IMAGE_CLASSES)


def _tv_swin_v2(m):
    swin = m.swin_transformer
    return swin.SwinTransformer(
        patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
        stochastic_depth_prob=0.0, num_classes=IMAGE_CLASSES,
        block=swin.SwinTransformerBlockV2, downsample_layer=swin.PatchMergingV2)


def _tv_maxvit(m):
    return m.maxvit.MaxVit(input_size=(32, 32), stem_channels=8, partition_size=2,
                           block_channels=[16, 32], block_layers=[1, 1], head_dim=8,
                           stochastic_depth_prob=0.0, num_classes=IMAGE_CLASSES)


_TORCHVISION_CASES = [
    SuiteCase("tv_resnet", "torchvision", _classifier(_tv_resnet), dtype=_WIDE),
    SuiteCase("tv_resnext", "torchvision", _classifier(_tv_resnext), dtype=_WIDE),
    SuiteCase("tv_mobilenet_v2", "torchvision", _classifier(
        lambda m: m.mobilenet_v2(width_mult=0.25, dropout=0.0, num_classes=IMAGE_CLASSES)),
        dtype=_WIDE),
    SuiteCase("tv_mobilenet_v3", "torchvision", _classifier(
        lambda m: m.mobilenet_v3_small(width_mult=0.25, dropout=0.0,
                                       num_classes=IMAGE_CLASSES)), dtype=_WIDE),
    SuiteCase("tv_efficientnet", "torchvision", _classifier(_tv_efficientnet), dtype=_WIDE),
    SuiteCase("tv_mnasnet", "torchvision", _classifier(
        lambda m: m.mnasnet0_5(dropout=0.0, num_classes=IMAGE_CLASSES)), dtype=_WIDE),
    SuiteCase("tv_shufflenet", "torchvision", _classifier(
        lambda m: m.shufflenetv2.ShuffleNetV2([1, 1, 1], [8, 16, 32, 64, 128],
                                              num_classes=IMAGE_CLASSES)),
        dtype=_WIDE),
    SuiteCase("tv_squeezenet", "torchvision", _classifier(
        lambda m: m.squeezenet1_1(dropout=0.0, num_classes=IMAGE_CLASSES)), dtype=_WIDE),
    SuiteCase("tv_densenet", "torchvision", _classifier(
        lambda m: m.densenet.DenseNet(growth_rate=8, block_config=(2, 2),
                                      num_init_features=16, num_classes=IMAGE_CLASSES))),
    SuiteCase("tv_regnet", "torchvision", _classifier(_tv_regnet)),
    SuiteCase("tv_convnext", "torchvision", _classifier(_tv_convnext)),
    SuiteCase("tv_googlenet", "torchvision", _classifier(
        lambda m: m.googlenet(aux_logits=False, init_weights=False, dropout=0.0,
                              num_classes=IMAGE_CLASSES), image=64),
        dtype=_WIDE),
    SuiteCase("tv_vit", "torchvision", _classifier(_tv_vit)),
    SuiteCase("tv_swin", "torchvision", _classifier(_tv_swin)),
    SuiteCase("tv_swin_v2", "torchvision", _classifier(_tv_swin_v2)),
    SuiteCase("tv_maxvit", "torchvision", _classifier(_tv_maxvit)),
    # segmentation: bilinear upsampling of the logits to the input size; float64 for the
    # same reason as the CNNs above (batch norm over 4 pooled 1x1 maps in LR-ASPP's and
    # DeepLabV3's heads)
    SuiteCase("tv_lraspp", "torchvision", _segmenter(
        lambda m: m.segmentation.lraspp_mobilenet_v3_large(
            weights=None, weights_backbone=None, num_classes=IMAGE_CLASSES)), dtype=_WIDE),
    SuiteCase("tv_deeplabv3", "torchvision", _segmenter(
        lambda m: m.segmentation.deeplabv3_mobilenet_v3_large(
            weights=None, weights_backbone=None, num_classes=IMAGE_CLASSES, aux_loss=False)),
        dtype=_WIDE),
    SuiteCase("tv_fcn", "torchvision", _segmenter(
        lambda m: m.segmentation.fcn_resnet50(
            weights=None, weights_backbone=None, num_classes=IMAGE_CLASSES, aux_loss=False)),
        dtype=_WIDE),
]


_CASES = [
    # decoder LMs, default configs (use_cache=True) with small sizes
    SuiteCase("gpt2", "decoder", _causal_lm(
        "GPT2Config", "GPT2LMHeadModel", n_embd=32, n_layer=2, n_head=4, n_positions=64,
        bos_token_id=0, eos_token_id=0)),
    SuiteCase("llama", "decoder", _causal_lm("LlamaConfig", "LlamaForCausalLM")),
    SuiteCase("mistral", "decoder", _causal_lm("MistralConfig", "MistralForCausalLM")),
    SuiteCase("qwen2", "decoder", _causal_lm("Qwen2Config", "Qwen2ForCausalLM")),
    SuiteCase("qwen3", "decoder", _causal_lm("Qwen3Config", "Qwen3ForCausalLM", head_dim=8)),
    SuiteCase("phi", "decoder", _causal_lm("PhiConfig", "PhiForCausalLM")),
    SuiteCase("phi3", "decoder", _causal_lm("Phi3Config", "Phi3ForCausalLM",
                                            pad_token_id=0)),
    SuiteCase("gemma", "decoder", _causal_lm("GemmaConfig", "GemmaForCausalLM", head_dim=8)),
    SuiteCase("gemma2", "decoder", _causal_lm("Gemma2Config", "Gemma2ForCausalLM",
                                              head_dim=8)),
    SuiteCase("gpt_neox", "decoder", _causal_lm("GPTNeoXConfig", "GPTNeoXForCausalLM")),
    SuiteCase("opt", "decoder", _causal_lm(
        "OPTConfig", "OPTForCausalLM", ffn_dim=64, word_embed_proj_dim=32,
        pad_token_id=1)),
    SuiteCase("falcon", "decoder", _causal_lm("FalconConfig", "FalconForCausalLM")),
    SuiteCase("bloom", "decoder", _causal_lm("BloomConfig", "BloomForCausalLM", n_head=4,
                                             n_layer=2)),
    SuiteCase("gptj", "decoder", _causal_lm("GPTJConfig", "GPTJForCausalLM", n_embd=32,
                                            n_layer=2, n_head=4, rotary_dim=4,
                                            n_positions=64)),
    SuiteCase("stablelm", "decoder", _causal_lm("StableLmConfig", "StableLmForCausalLM")),
    SuiteCase("olmo2", "decoder", _causal_lm("Olmo2Config", "Olmo2ForCausalLM")),
    SuiteCase("granite", "decoder", _causal_lm("GraniteConfig", "GraniteForCausalLM")),
    # found by the HF sweep, built by its shrinker: gated delta-rule attention (a
    # triangular solve, a strided copy buffer) and YOSO's hashed attention (acos)
    SuiteCase("qwen3_next", "decoder", _swept("causal", "qwen3_next", "Qwen3NextForCausalLM")),
    SuiteCase("yoso", "encoder", _swept("masked", "yoso", "YosoForMaskedLM")),
    # complex numbers: Llama 4's rotary embedding (view_as_complex, a complex product,
    # view_as_real) and FNet's Fourier token mixing (fftn)
    SuiteCase("llama4_text", "decoder", _swept("causal", "llama4_text", "Llama4ForCausalLM")),
    SuiteCase("fnet", "encoder", _swept("masked", "fnet", "FNetForMaskedLM")),
    # group norm (PoolFormer, BiT), bilinear upsampling (MobileViT, PVT), Tensor.unfold (Inkling2)
    SuiteCase("poolformer", "vision", _swept("imgcls", "poolformer",
                                             "PoolFormerForImageClassification")),
    SuiteCase("bit", "vision", _swept("imgcls", "bit", "BitForImageClassification")),
    SuiteCase("mobilevit", "vision", _swept("imgcls", "mobilevit",
                                            "MobileViTForImageClassification"), dtype=_WIDE),
    SuiteCase("pvt", "vision", _swept("imgcls", "pvt", "PvtForImageClassification")),
    SuiteCase("inkling2_text", "decoder", _swept("causal", "inkling2_text",
                                                 "Inkling2ForCausalLM")),
    # mixture of experts
    SuiteCase("mixtral", "moe", _causal_lm("MixtralConfig", "MixtralForCausalLM",
                                           num_local_experts=4, num_experts_per_tok=2)),
    SuiteCase("qwen2_moe", "moe", _causal_lm(
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    SuiteCase("olmoe", "moe", _causal_lm("OlmoeConfig", "OlmoeForCausalLM", num_experts=4,
                                         num_experts_per_tok=2)),
    # encoders
    SuiteCase("bert", "encoder", _encoder("BertConfig", "BertForSequenceClassification")),
    SuiteCase("roberta", "encoder", _encoder("RobertaConfig",
                                             "RobertaForSequenceClassification",
                                             pad_token_id=1)),
    SuiteCase("distilbert", "encoder", _encoder(
        "DistilBertConfig", "DistilBertForSequenceClassification", dim=32, hidden_dim=64,
        n_layers=2, n_heads=4)),
    SuiteCase("albert", "encoder", _encoder("AlbertConfig", "AlbertForSequenceClassification",
                                            embedding_size=16)),
    SuiteCase("electra", "encoder", _encoder("ElectraConfig",
                                             "ElectraForSequenceClassification",
                                             embedding_size=16)),
    # problem_type set: otherwise its loss picks labels >= 0 with nonzero() (value-dependent)
    SuiteCase("deberta_v2", "encoder", _encoder("DebertaV2Config",
                                                "DebertaV2ForSequenceClassification",
                                                problem_type="single_label_classification")),
    # encoder-decoders
    SuiteCase("bart", "encoder-decoder", _seq2seq(
        "BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB, d_model=32,
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64)),
    SuiteCase("t5", "encoder-decoder", _seq2seq(
        "T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=32, d_kv=8,
        d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0)),     # as T5's released configs set them
    # vision
    SuiteCase("vit", "vision", _vision(
        "ViTConfig", "ViTForImageClassification", image_size=32, patch_size=8, hidden_size=32,
        num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)),
    SuiteCase("convnext", "vision", _vision(
        "ConvNextConfig", "ConvNextForImageClassification", hidden_sizes=[8, 16],
        depths=[1, 1], num_stages=2)),
    SuiteCase("resnet", "vision", _vision(
        "ResNetConfig", "ResNetForImageClassification", embedding_size=8,
        hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")),
    SuiteCase("swin", "vision", _vision(
        "SwinConfig", "SwinForImageClassification", image_size=32, patch_size=4,
        embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4)),
    # plain PyTorch idioms
    SuiteCase("batchnorm_cnn", "idiom", _idiom(
        ConvBatchNorm, lambda: (torch.randn(BATCH, 3, 8, 8), torch.randint(5, (BATCH,))),
        F.cross_entropy)),
    SuiteCase("lstm", "idiom", _idiom(lambda: Recurrent(nn.LSTM),
                                      lambda: (_tokens(BATCH, SEQ), _tokens(BATCH, SEQ)),
                                      _lm_loss)),
    SuiteCase("gru", "idiom", _idiom(lambda: Recurrent(nn.GRU),
                                     lambda: (_tokens(BATCH, SEQ), _tokens(BATCH, SEQ)),
                                     _lm_loss)),
    SuiteCase("rnn", "idiom", _idiom(lambda: Recurrent(nn.RNN),
                                     lambda: (_tokens(BATCH, SEQ), _tokens(BATCH, SEQ)),
                                     _lm_loss)),
    SuiteCase("checkpoint", "idiom", _idiom(
        lambda: CheckpointedMLP(use_reentrant=False),
        lambda: (torch.randn(BATCH, 16), torch.randn(BATCH, 16)), F.mse_loss)),
    SuiteCase("checkpoint_reentrant", "idiom", _idiom(
        lambda: CheckpointedMLP(use_reentrant=True),
        lambda: (torch.randn(BATCH, 16), torch.randn(BATCH, 16)),
        F.mse_loss)),
    SuiteCase("hf_gradient_checkpointing", "idiom", _checkpointed(
        _causal_lm("LlamaConfig", "LlamaForCausalLM"))),
    SuiteCase("masked_attention", "idiom", _idiom(
        MaskedAttention, lambda: (torch.randn(BATCH, SEQ, 16), _padding(),
                                  torch.randint(4, (BATCH,))),
        F.cross_entropy)),
    # probed on the new user's tour (r22): architectures and idioms the cases above miss
    SuiteCase("gpt_bigcode", "decoder", _causal_lm(
        "GPTBigCodeConfig", "GPTBigCodeForCausalLM", n_embd=32, n_layer=2, n_head=4,
        n_positions=64)),                                   # multi-query attention
    SuiteCase("codegen", "decoder", _causal_lm(
        "CodeGenConfig", "CodeGenForCausalLM", n_embd=32, n_layer=2, n_head=4,
        n_positions=64, rotary_dim=4)),
    SuiteCase("mpt", "decoder", _causal_lm("MptConfig", "MptForCausalLM", d_model=32,
                                           n_layers=2, n_heads=4, max_seq_len=64)),  # ALiBi
    SuiteCase("xglm", "decoder", _causal_lm(
        "XGLMConfig", "XGLMForCausalLM", d_model=32, num_layers=2, attention_heads=4,
        ffn_dim=64)),                                       # sinusoidal positions
    SuiteCase("mbart", "encoder-decoder", _seq2seq(
        "MBartConfig", "MBartForConditionalGeneration", **_SEQ2SEQ_SIZES)),
    SuiteCase("pegasus", "encoder-decoder", _seq2seq(
        "PegasusConfig", "PegasusForConditionalGeneration", **_SEQ2SEQ_SIZES)),
    SuiteCase("whisper", "encoder-decoder", _whisper),      # conv1d over mel features
    SuiteCase("mobilebert", "encoder", _encoder(
        "MobileBertConfig", "MobileBertForSequenceClassification", embedding_size=16,
        intra_bottleneck_size=16, true_hidden_size=16)),
    SuiteCase("deit", "vision", _vision(
        "DeiTConfig", "DeiTForImageClassification", image_size=32, patch_size=8,
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)),
    SuiteCase("dinov2", "vision", _vision(
        "Dinov2Config", "Dinov2ForImageClassification", image_size=32, patch_size=8,
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2)),
    SuiteCase("segformer", "vision", _vision(
        "SegformerConfig", "SegformerForImageClassification", num_encoder_blocks=2,
        depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], num_attention_heads=[1, 2],
        patch_sizes=[7, 3], strides=[4, 2], decoder_hidden_size=16)),
    SuiteCase("clip", "multimodal", _clip),                 # contrastive loss, two towers
    SuiteCase("wav2vec2", "audio", _wav2vec2),
    SuiteCase("custom_function", "idiom", _idiom(
        CustomFunctionMLP, lambda: (torch.randn(BATCH, 16), torch.randn(BATCH, 16)),
        F.mse_loss)),
    SuiteCase("tied_weights", "idiom", _idiom(
        TiedLM, lambda: (_tokens(BATCH, SEQ), _tokens(BATCH, SEQ)), _lm_loss)),
    SuiteCase("reused_module", "idiom", _idiom(
        ReusedBlock, lambda: (torch.randn(BATCH, 16), torch.randint(4, (BATCH,))),
        F.cross_entropy)),
    SuiteCase("buffers", "idiom", _idiom(
        BufferScaled, lambda: (torch.randn(BATCH, SEQ, 16), torch.randint(4, (BATCH,))),
        F.cross_entropy)),
    SuiteCase("weight_norm", "idiom", _idiom(
        WeightNormed, lambda: (torch.randn(BATCH, 16), torch.randint(4, (BATCH,))),
        F.cross_entropy)),
    SuiteCase("attention_weights", "idiom", _idiom(
        AttentionWeights, lambda: (torch.randn(BATCH, SEQ, 16), torch.randint(4, (BATCH,))),
        F.cross_entropy)),
    SuiteCase("frozen_embedding", "idiom", _idiom(
        FrozenEmbedding, lambda: (_tokens(BATCH, SEQ), _tokens(BATCH, SEQ)), _lm_loss)),
    SuiteCase("conv3d", "idiom", _idiom(
        Conv3dGroupNorm, lambda: (torch.randn(BATCH, 3, 4, 8, 8), torch.randint(4, (BATCH,))),
        F.cross_entropy)),
]

SUITE: dict[str, SuiteCase] = {c.name: c for c in _CASES + _TORCHVISION_CASES}
# a few quick ones for `make test`: one decoder with a default config, one idiom each
# kind, one torchvision CNN
FAST = ("llama", "bert", "rnn", "checkpoint", "tv_resnet")


def build_case(name: str, seed: int = 0):
    """(model, example_inputs, loss_fn) of case ``name``, weights and batch from ``seed``."""
    if name not in SUITE:
        raise ValueError(f"unknown suite case {name!r}; choose from {sorted(SUITE)}")
    torch.manual_seed(seed)
    case = SUITE[name]
    model, batch, loss_fn = case.make()
    if case.dtype != torch.float32:
        model = model.to(case.dtype)
        cast = lambda t: t.to(case.dtype) if t.is_floating_point() else t  # noqa: E731
        batch = ({k: cast(v) for k, v in batch.items()} if isinstance(batch, dict)
                 else tuple(cast(t) for t in batch))
    return model, batch, loss_fn
