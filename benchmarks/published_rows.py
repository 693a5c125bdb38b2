"""The published training runs ``published.py`` re-estimates: model, plan, hardware, and
what was measured, with the source of every figure.

Figures marked [D] are derived from the published ones (an iteration time from a TFLOP/s
figure, with the source's own FLOP count); [?] marks what the source does not state and
the row assumes. FLOP conventions (a multiply-add is 2 FLOPs):

- Megatron-LM, Narayanan et al. 2021, Eq. (3): ``96 B s l h^2 (1 + s/6h + V/16lh)`` per
  iteration, full recomputation counted (Alpa's ``compute_gpt_tflops`` with
  ``checkpoint_activations=True`` and BigScience's logged TFLOPs are the same formula);
- GPT-NeoX (the 20B run's own logging, ``megatron/logging.py`` ``get_flops`` at the
  20B release, EleutherAI/gpt-neox c560814b): ``B s (6 P + 60 s h l)`` per iteration,
  ``P`` the model's parameter count (no recomputation counted);
- torchtitan: tokens/s per GPU (no FLOP count needed: iteration time = local batch x seq
  / tokens per second per GPU).

The loss as each source ran it (the zoo config's ``loss``, ``torchalpa/models/losses.py``):
llm-foundry's MPT rows use flash-attn's fused cross-entropy (``ComposerMPTCausalLM``'s
default ``loss_fn='fused_crossentropy'``: bf16 logits read, a float32 log-sum-exp per
token kept), priced as ``loss="fused"`` with the logits left in bf16 (autocast casts
``F.cross_entropy`` to float32, not flash-attn's kernel); llm.c's ``fused_classifier``
kernel likewise reads the bf16 logits once and writes their gradient over them, keeping
no float32 log-probabilities (its rows and modded-nanogpt's llm.c run: ``loss="fused"``,
bf16 logits), and TinyLlama ran flash-attn's loss as MPT did. Every other source computes
log-softmax and NLL over float32 logits: torchtitan and nanogpt-speedrun
``F.cross_entropy(logits.float())``, Megatron-LM, BLOOM and BigScience's
``vocab_parallel_cross_entropy`` (which keeps the float32 softmax), Alpa's JAX
log-softmax; those rows keep ``loss="eager"``.

What the trainer computed beside the step (``trainer_metrics``, priced by
``trainer_work``): llm-foundry's runs went through Composer, which updates the model's two
training metrics (a float32 cross-entropy over the logits each) after every micro-batch;
every other source's loop computes the loss alone (torchtitan, the nanogpt speedrun,
Megatron-LM and Megatron-DeepSpeed log the loss they already have; Alpa's benchmark times
its train step), so only the MPT rows carry them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torchalpa

__all__ = ["PublishedRow", "ROWS", "TUNED", "HELD_OUT", "FLOP_COUNTS", "megatron_eq3_flops",
           "gpt_neox_flops"]


def megatron_eq3_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one iteration, Narayanan et al. 2021 Eq. (3) (recomputation counted)."""
    h, s, l = hidden, seq, layers
    return 96 * batch * s * l * h * h * (1 + s / (6 * h) + vocab / (16 * l * h))


def gpt_neox_flops(batch: int, seq: int, layers: int, hidden: int, params: int) -> float:
    """FLOPs of one iteration as GPT-NeoX logged them at the 20B release (``get_flops``:
    ``6 P`` per token for the parameters, ``60 s h l`` for attention)."""
    return batch * seq * (6 * params + 60 * seq * hidden * layers)


FLOP_COUNTS = ("megatron-eq3", "gpt-neox")
"""The FLOP counts a published TFLOP/s figure may be stated in (``PublishedRow.flop_count``)."""


@dataclass(frozen=True, kw_only=True)
class PublishedRow:
    """One measured run and the plan it used."""

    key: str
    label: str
    source: str
    """Where the figures come from (paper table, repository file at a commit)."""
    short_source: str
    family: str
    """Zoo family: 'gpt' (GPT-2/3: learned positions, GeLU, tied embedding) or 'llama'."""
    config: dict
    seq: int
    global_batch: int
    micro_batch: int
    """Sequences per micro-batch per data-parallel replica."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    machine: str
    """``Cluster.preset`` name of the nodes."""
    num_nodes: int
    devices_per_node: int = 8
    precision: str = "bf16"
    """'fp16' / 'bf16' (fp32 master weights, the forward in that dtype) or 'fp32'."""
    float32_logits: bool = True
    """Whether the head's logits are cast to float32 for the loss (False: they stay in the
    compute dtype, as under FSDP's PURE mixed precision)."""
    remat: str = "none"
    """'full' (every block recomputed in backward), 'selective' (the compute-heavy ops'
    results kept, the rest recomputed: torchtitan's op policy) or 'none'."""
    zero: str = "none"
    """'none', 'zero1' (optimizer states sharded over dp, gradients all-reduced whole, each
    updated parameter gathered once per step: DeepSpeed's ZeRO-1, ``Zero1Parallel``),
    'zero2' (parameters, gradients, optimizer states sharded over dp, each parameter
    gathered once per step: ZeRO-2, Alpa's reduce-scatter) or 'fsdp' (gathered again in
    backward: FSDP / ZeRO-3)."""
    plain_tp: bool = False
    """Whether the run's tensor parallelism was Megatron's plain one (no sequence
    parallelism: norms whole on every tp rank, each row-parallel product all-reduced), as
    Megatron-LM until 2022 and Megatron-DeepSpeed ran it: pinned with
    ``AutoShardingOption(plain_tensor_parallel=True)``. False: the ILP lays them out."""
    fused: bool = True
    """Whether the framework fuses elementwise chains (Megatron's fused kernels, XLA,
    torch.compile): priced with ``elementwise="fused"``."""
    schedule: str = "1f1b"
    stage_blocks: tuple[int, ...] = ()
    """Transformer blocks per pipeline stage, when the source gives an uneven split."""
    step_s: float | None = None
    """Published seconds per iteration."""
    tflops_per_gpu: float | None = None
    """Published TFLOP/s per GPU under ``flop_count`` (used when ``step_s`` is None)."""
    flop_count: str = "megatron-eq3"
    """The FLOP count ``tflops_per_gpu`` is stated in (``FLOP_COUNTS``): Megatron's Eq. (3)
    or GPT-NeoX's logged count (``gpt_neox_flops``, which needs ``flop_params``)."""
    flop_params: int | None = None
    """The parameter count the source's FLOP count multiplies (GPT-NeoX's ``6 P``)."""
    tokens_per_gpu_s: float | None = None
    """Published tokens/s per GPU (used when both above are None)."""
    memory_gib: float | None = None
    """Published peak memory per device, GiB."""
    memory_comparable: bool = True
    """Whether ``memory_gib`` is a peak the estimate prices (False: e.g. an allocator's
    reserved pool with buffers of a compiler the model does not see)."""
    trainer_metrics: tuple[str, ...] = ()
    """Training metrics the run's trainer updated on every micro-batch beside forward,
    backward and the optimizer (Composer's ``LanguageCrossEntropy``, ...: names of
    ``trainer_work.TRAINER_METRICS``), priced as their ops (``trainer_work``); () for a
    trainer that computes only the loss."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Assumptions [?] and what the model leaves out."""

    def __post_init__(self):
        import torchalpa.models as zoo
        from torchalpa.core.gpu_specs import node_preset
        try:
            node_preset(self.machine)
        except ValueError as e:
            raise ValueError(f"row {self.key}: {e}") from None
        if self.family not in zoo.FAMILIES:
            raise ValueError(f"row {self.key}: the zoo has no family {self.family!r}; it has "
                             f"{', '.join(sorted(zoo.FAMILIES))}")
        for name, allowed in (("remat", ("none", "selective", "full")),
                              ("zero", ("none", "zero1", "zero2", "fsdp")),
                              ("precision", ("fp16", "bf16", "fp32"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"row {self.key}: {name}={getattr(self, name)!r}; one of "
                                 f"{', '.join(allowed)}")
        self._check_trainer_metrics()
        if self.flop_count not in FLOP_COUNTS:
            raise ValueError(f"row {self.key}: flop_count={self.flop_count!r}; one of "
                             f"{', '.join(FLOP_COUNTS)}")
        if self.flop_count == "gpt-neox" and not self.flop_params:
            raise ValueError(f"row {self.key}: the gpt-neox FLOP count needs flop_params")
        if self.tp * self.pp * self.dp != self.num_nodes * self.devices_per_node:
            raise ValueError(f"{self.key}: tp x pp x dp = {self.tp * self.pp * self.dp} but "
                             f"{self.num_nodes} x {self.devices_per_node} devices")
        if self.global_batch % (self.micro_batch * self.dp):
            raise ValueError(f"{self.key}: global batch {self.global_batch} is not a whole "
                             f"number of micro-batches of {self.micro_batch} x dp {self.dp}")

    def _check_trainer_metrics(self) -> None:
        from trainer_work import check_trainer_metrics
        try:
            check_trainer_metrics(self.trainer_metrics)
        except ValueError as e:
            raise ValueError(f"row {self.key}: {e}") from None
        if self.trainer_metrics and (self.tp > 1 or self.pp > 1):
            raise ValueError(f"row {self.key}: trainer metrics are priced on data-parallel "
                             f"rows only (tp {self.tp}, pp {self.pp})")

    def cluster(self) -> torchalpa.Cluster:
        return torchalpa.Cluster.preset(self.machine, self.num_nodes, self.devices_per_node)

    def published_step_s(self) -> float:
        """Seconds per iteration: published, or derived from the published rate."""
        if self.step_s is not None:
            return self.step_s
        if self.tflops_per_gpu is not None:
            return self.iteration_flops() / (self.tflops_per_gpu * 1e12 * self.num_nodes
                                             * self.devices_per_node)
        assert self.tokens_per_gpu_s is not None, f"{self.key} has no published figure"
        tokens = self.global_batch * self.seq / (self.num_nodes * self.devices_per_node)
        return tokens / self.tokens_per_gpu_s

    def iteration_flops(self) -> float:
        """FLOPs of one iteration under the count the source states its rate in."""
        c = self.config
        if self.flop_count == "gpt-neox":
            assert self.flop_params is not None
            return gpt_neox_flops(self.global_batch, self.seq, c["num_layers"], c["hidden"],
                                  self.flop_params)
        return megatron_eq3_flops(self.global_batch, self.seq, c["num_layers"], c["hidden"],
                                  c["vocab_size"])

    def published_text(self) -> str:
        if self.step_s is not None:
            return f"{self.step_s:g} s/iter"
        if self.tflops_per_gpu is not None:
            count = "Eq.3" if self.flop_count == "megatron-eq3" else self.flop_count
            return f"{self.tflops_per_gpu:g} TFLOP/s/GPU {count} -> s/iter [D]"
        return f"{self.tokens_per_gpu_s:g} tokens/s/GPU -> s/iter [D]"

    def plan_text(self) -> str:
        micro = self.global_batch // (self.micro_batch * self.dp)
        return (f"{self.machine} {self.num_nodes}x{self.devices_per_node}: tp{self.tp} "
                f"pp{self.pp} dp{self.dp}, {micro} micro-batches of {self.micro_batch}"
                f"/replica, {self.precision}, remat {self.remat}, zero {self.zero}, "
                f"{'fused' if self.fused else 'eager'} elementwise, {self.schedule}"
                + (f"; {'; '.join(self.notes)}" if self.notes else ""))


def _gpt(hidden: int, layers: int, heads: int, seq: int, vocab: int = 51200,
         attention: str = "eager", dropout: float = 0.0) -> dict:
    """A zoo GPT config. ``attention``: "eager" (scores kept: what Megatron-LM, Alpa and
    BLOOM's Megatron-DeepSpeed ran, fused softmax but no fused attention kernel) or
    "sdpa" (a flash kernel: MPT). ``dropout``: the run's hidden and attention dropout
    (Megatron-LM's defaults, ``--hidden-dropout`` and ``--attention-dropout``, are 0.1)."""
    return dict(vocab_size=vocab, max_seq_len=seq, num_layers=layers, num_heads=heads,
                hidden=hidden, dropout=dropout, attention=attention)


def _llama3(size: str, seq: int = 8192) -> dict:
    shapes = {"8b": (32, 4096, 32, 14336), "70b": (80, 8192, 64, 28672)}
    layers, hidden, heads, ffn = shapes[size]
    return dict(vocab_size=128256, max_seq_len=seq, num_layers=layers, hidden=hidden,
                num_heads=heads, num_kv_heads=8, intermediate=ffn, rope_theta=500000.0)


def _llama2(size: str, seq: int = 4096) -> dict:
    """Llama 2 as torchtitan's ``llama2`` configs build it: 13B multi-head, 70B with 8 kv
    heads; the FFN width from ``multiple_of`` (256 / 4096) and 70B's multiplier 1.3;
    the 32000-token sentencepiece vocabulary, rope theta 10000."""
    shapes = {"13b": (40, 5120, 40, 40, 13824), "70b": (80, 8192, 64, 8, 28672)}
    layers, hidden, heads, kv, ffn = shapes[size]
    return dict(vocab_size=32000, max_seq_len=seq, num_layers=layers, hidden=hidden,
                num_heads=heads, num_kv_heads=kv, intermediate=ffn, rope_theta=10000.0)


ALPA = ("alpa-projects/alpa benchmark/alpa/README.md at e59ec4ed (2022-10-17, 'Expected "
        "output on AWS p3.16'; the 2022-04-24 version: 2.425 s, GPipe-style stages)")
SC21 = "Narayanan et al., SC'21 (arXiv 2104.04473) Table 1"
MEG20 = ("NVIDIA/Megatron-LM README of 2020-09 (images/tables.tex, commit 5281919420), "
         "single-node tensor-parallel table")
KORT = "Korthikanti et al. 2022 (arXiv 2205.05198) Table 5, full recompute [T]"
BLOOM = ("bigscience-workshop/bigscience train/tr11-176B-ml/README.md (commit 00327f8c), "
         "iteration 85376")
TT_H100 = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit "
           "9dec370), Table 1/3, bf16, no compile")
TT_A100 = "pytorch/torchtitan docs/performance.md (commit f38766edb, 2024-04-24)"
TT_LLAMA2 = ("pytorch/torchtitan docs/performance.md (commit 04133643), 'Llama 2 performance "
             "numbers': FSDP2 on 64 A100 80GB, WPS per GPU, local batch 1-2, seq 4096 (the "
             "Llama 2 default the page names)")

ROMERO = ("tyler-romero/nanogpt-speedrun logs/4c627c0d-029c-4f8a-bd18-40f99b43b22e.txt "
          "(commit b3c32f89, 2025-01-16; the run 'Initial baseline' of "
          "https://tylerromero.com/posts/nanogpt-speedrun-worklog, 220.7k tokens/s): "
          "step_avg 1191.34 ms over steps 11-24576, validation excluded; 'peak memory "
          "consumption: 18885 MiB' (torch.cuda.max_memory_allocated)")
FOUNDRY = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 061f2c7c), "
           "MPT tables: throughput (T/s/GPU), micro-batch, grad accumulation, FULL_SHARD, "
           "activation checkpointing; model sizes from scripts/train/yamls/pretrain/mpt-*.yaml")
_MPT_SHAPES = {"125m": (768, 12, 12), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
               "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40),
               "30b": (7168, 56, 48), "70b": (8192, 64, 80)}
_MPT_NOTES = ("MPT: GPT with no biases, tied embedding, learned positions (NumParams match "
              "the zoo GPT's within 0.05%), vocabulary 50368",
              "FlashAttention (triton) in MPT, SDPA here",
              "FSDP mixed precision: DEFAULT gathers bf16 copies of fp32 parameters and "
              "reduces in fp32, PURE keeps bf16 parameters: both priced as fp32 parameters "
              "gathered and reduced in fp32 [not expressible yet]",
              "loss: flash-attn's fused cross-entropy (llm-foundry's default "
              "'fused_crossentropy'), torchalpa::cross_entropy here: the bf16 logits and a "
              "float32 log-sum-exp per token kept, no float32 log-probabilities")


COMPOSER_METRICS = ("LanguageCrossEntropy", "LanguagePerplexity")
"""``ComposerMPTCausalLM``'s training metrics (llm-foundry llmfoundry/models/mpt/
modeling_mpt.py at 061f2c7c lines 697-699: on unless the model config sets
``use_train_metrics: false``, which neither the pretrain yamls nor the benchmarking
scripts set; ``ComposerMosaicGPT`` of the April 2023 tables, examples/llm/src/models/
mosaic_gpt/mosaic_gpt.py at 9fa3ceb9 lines 480-483, had the same two, with no switch),
which Composer updates after every micro-batch's backward (``trainer_work``)."""


def _mpt(key, size, gpus, machine, micro, accum, tokens, remat="none", pure=False,
         seq=2048, notes: tuple[str, ...] = ()) -> PublishedRow:
    hidden, heads, layers = _MPT_SHAPES[size]
    nodes = gpus // 8
    return PublishedRow(
        key=key, label=f"MPT-{size.upper()} FSDP on {gpus} {machine}, seq {seq}" +
        (", activation checkpointing" if remat != "none" else ""), source=FOUNDRY,
        short_source="llm-foundry", family="gpt",
        config=dict(_gpt(hidden, layers, heads, seq, vocab=50368, attention="sdpa"),
                    bias=False, loss="fused"), seq=seq,
        global_batch=micro * accum * gpus, micro_batch=micro, dp=gpus, machine=machine,
        num_nodes=nodes, precision="bf16", remat=remat, zero="fsdp", fused=False,
        tokens_per_gpu_s=tokens, float32_logits=False, trainer_metrics=COMPOSER_METRICS,
        notes=_MPT_NOTES + (("mixed precision PURE: parameters in bf16 "
                             "not expressible yet",) if pure else ()) + notes)


_MEG = dict(family="gpt", machine="dgx-a100", precision="fp16", remat="full", fused=True,
            plain_tp=True)
MEGATRON_DROPOUT = 0.1
"""Megatron-LM's default ``--hidden-dropout`` and ``--attention-dropout``: its GPT scripts
of 2020-2022 and the papers' runs set neither."""
_SC21_NOTES = ("micro-batch 1 [?]", "interleaved 1F1B in the paper, plain 1F1B here")


def _sc21(key, params, heads, hidden, layers, tp, pp, gpus, batch, tflops) -> PublishedRow:
    return PublishedRow(key=key, label=f"Megatron-LM GPT {params} on {gpus} A100",
                        source=SC21, short_source="Megatron SC'21",
                        config=_gpt(hidden, layers, heads, 2048, dropout=MEGATRON_DROPOUT),
                        seq=2048, global_batch=batch, micro_batch=1, tp=tp, pp=pp,
                        dp=gpus // (tp * pp), num_nodes=gpus // 8, tflops_per_gpu=tflops,
                        notes=_SC21_NOTES if pp > 1 else _SC21_NOTES[:1], **_MEG)


def _meg20(key, gpu, hidden, heads, layers, tp, batch, ms) -> PublishedRow:
    machine = {"v100": "dgx-2", "a100": "a100-40"}[gpu]
    return PublishedRow(key=key, label=f"Megatron-LM GPT-2 h{hidden} l{layers}, tp{tp} on "
                                       f"{gpu.upper()}",
                        source=MEG20, short_source="Megatron-LM 2020",
                        config=_gpt(hidden, layers, heads, 1024, dropout=MEGATRON_DROPOUT),
                        seq=1024, global_batch=batch,
                        micro_batch=batch, tp=tp, num_nodes=1, devices_per_node=tp,
                        step_s=ms / 1e3, machine=machine, family="gpt", precision="fp16",
                        remat="full", fused=True, plain_tp=True,
                        notes=("fp16, full recompute: the TFLOP/s match Eq. 3 [D]",
                               "DGX-A100 of 2020: 40 GB [?]") if gpu == "a100" else
                        ("fp16, full recompute: the TFLOP/s match Eq. 3 [D]",))


TUNED: tuple[PublishedRow, ...] = (
    PublishedRow(
        key="alpa-2.6b", label="Alpa GPT-2.6B sanity check, dp2 x op2 x pp2 on p3.16xlarge",
        source=ALPA, short_source="Alpa README", family="gpt", config=_gpt(2560, 32, 32, 1024),
        seq=1024, global_batch=32, micro_batch=4, tp=2, pp=2, dp=2, machine="p3.16xlarge",
        num_nodes=1, precision="fp16", remat="full", zero="zero2", fused=True,
        schedule="1f1b", step_s=2.464, memory_gib=8.745,
        notes=("37.01 TFLOP/s/GPU with recompute = Eq. 3 / 2.464 s / 8",
               "reduce-scatter on: ZeRO-2-like over dp")),
    _sc21("megatron21-1.7b", "1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    _sc21("megatron21-3.6b", "3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    _sc21("megatron21-7.5b", "7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    _sc21("megatron21-18b", "18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _sc21("megatron21-39b", "39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _sc21("megatron21-76b", "76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _sc21("megatron21-146b", "145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _meg20("megatron20-v100-1b", "v100", 1920, 15, 24, 1, 8, 1121),
    _meg20("megatron20-v100-2b", "v100", 2304, 18, 30, 2, 8, 1093),
    _meg20("megatron20-v100-4b", "v100", 3072, 24, 36, 4, 8, 1238),
    _meg20("megatron20-v100-8b", "v100", 4096, 32, 42, 8, 8, 1407),
    _meg20("megatron20-a100-1b", "a100", 1920, 15, 24, 1, 16, 1076),
    _meg20("megatron20-a100-2b", "a100", 2304, 18, 30, 2, 16, 1026),
    _meg20("megatron20-a100-4b", "a100", 3072, 24, 36, 4, 16, 1162),
    _meg20("megatron20-a100-8b", "a100", 4096, 32, 42, 8, 16, 1343),
    PublishedRow(
        key="korthikanti-22b", label="GPT-22B, tp8 on 8 A100, full recompute", source=KORT,
        short_source="Korthikanti 2022",
        config=_gpt(6144, 48, 64, 2048, dropout=MEGATRON_DROPOUT), seq=2048,
        global_batch=4, micro_batch=4, tp=8, num_nodes=1, step_s=1.42, **_MEG),
    PublishedRow(
        key="korthikanti-175b", label="GPT-3 175B, tp8 x pp8 on 64 A100, full recompute",
        source=KORT, short_source="Korthikanti 2022",
        config=_gpt(12288, 96, 96, 2048, dropout=MEGATRON_DROPOUT),
        seq=2048, global_batch=64, micro_batch=1, tp=8, pp=8, num_nodes=8, step_s=18.13,
        notes=("interleaved 1F1B (3 chunks) in the paper, plain 1F1B here",), **_MEG),
    PublishedRow(
        key="bloom-176b", label="BLOOM-176B, tp4 x pp12 x dp8 on 384 A100", source=BLOOM,
        short_source="BLOOM logbook", family="gpt",
        config=_gpt(14336, 70, 112, 2048, vocab=250880), seq=2048, global_batch=2048,
        micro_batch=2, tp=4, pp=12, dp=8, machine="jean-zay-a100", num_nodes=48,
        precision="bf16", remat="full", zero="zero1", fused=True, plain_tp=True,
        stage_blocks=(5,) + (6,) * 10 + (5,), step_s=104.70,
        notes=("149.77 TFLOP/s/GPU = Eq. 3 with V=250880 / 104.70 s",
               "ALiBi in BLOOM, learned positions here",
               "ZeRO-1: between steps a rank keeps its shard of the parameters too")),
    PublishedRow(
        key="torchtitan-8b-h100x8", label="Llama 3.1 8B, FSDP on 8 H100 (96 GB, 500 W)",
        source=TT_H100, short_source="torchtitan", family="llama", config=_llama3("8b"),
        seq=8192, global_batch=16, micro_batch=2, dp=8, machine="grand-teton-h100",
        num_nodes=1, precision="bf16", remat="selective", zero="fsdp", fused=False,
        tokens_per_gpu_s=5762, memory_gib=82.4,
        notes=("seq 8192 from the default config [?]",
               "selective op AC: torchtitan saves every other matmul's result, here every "
               "one is kept", "500 W: peak between SXM and NVL (gpu_specs)")),
    PublishedRow(
        key="torchtitan-8b-h100x128", label="Llama 3.1 8B, FSDP on 128 H100 (96 GB, 500 W)",
        source=TT_H100, short_source="torchtitan", family="llama", config=_llama3("8b"),
        seq=8192, global_batch=256, micro_batch=2, dp=128, machine="grand-teton-h100",
        num_nodes=16, precision="bf16", remat="selective", zero="fsdp", fused=False,
        tokens_per_gpu_s=5605, memory_gib=67.0,
        notes=("seq 8192 from the default config [?]",
               "selective op AC: torchtitan saves every other matmul's result, here every "
               "one is kept", "500 W: peak between SXM and NVL (gpu_specs)")),
    PublishedRow(
        key="torchtitan-8b-a100x64", label="Llama 3 8B, FSDP on 64 A100 80GB",
        source=TT_A100, short_source="torchtitan", family="llama", config=_llama3("8b"),
        seq=8192, global_batch=64, micro_batch=1, dp=64, machine="dgx-a100", num_nodes=8,
        precision="bf16", remat="selective", zero="fsdp", fused=False, tokens_per_gpu_s=2973,
        notes=("selective op AC: torchtitan saves every other matmul's result, here every "
               "one is kept",
               "A100 nodes' network not stated: DGX A100 [?]")),
    PublishedRow(
        key="torchtitan-70b-a100x64", label="Llama 3 70B, FSDP on 64 A100 80GB, full AC",
        source=TT_A100, short_source="torchtitan", family="llama", config=_llama3("70b"),
        seq=8192, global_batch=64, micro_batch=1, dp=64, machine="dgx-a100", num_nodes=8,
        precision="bf16", remat="full", zero="fsdp", fused=False, tokens_per_gpu_s=331,
        notes=("A100 nodes' network not stated: DGX A100 [?]",)),
    # llm-foundry's MPT benchmarks: FSDP (FULL_SHARD) at 55-64% MFU on A100s, no
    # checkpointing at seq 2048 (the A100 80GB and H100 tables), and 128 A100 40GB
    _mpt("mpt-1b-a100x8", "1b", 8, "dgx-a100", 14, 4, 20513),
    _mpt("mpt-3b-a100x8", "3b", 8, "dgx-a100", 10, 2, 10811),
    _mpt("mpt-7b-a100x8", "7b", 8, "dgx-a100", 6, 2, 4641),
    _mpt("mpt-13b-a100x8", "13b", 8, "dgx-a100", 2, 3, 2262),
    _mpt("mpt-7b-h100x8", "7b", 8, "h100", 6, 1, 10643),
    _mpt("mpt-13b-h100x64", "13b", 64, "h100", 2, 1, 4800),
    _mpt("mpt-3b-a100-40x128", "3b", 128, "a100-40", 6, 1, 9538, pure=True),
    _mpt("mpt-7b-a100-40x128", "7b", 128, "a100-40", 18, 1, 3623, remat="full", pure=True),
    # a 2-GPU PCIe workstation: llm.c's PyTorch GPT-2 trainer (Keller Jordan's fork), DDP
    PublishedRow(
        key="romero-gpt2-124m-4090x2", label="GPT-2 124M, DDP on 2 RTX 4090 (PCIe), seq 1024",
        source=ROMERO, short_source="nanogpt-speedrun", family="gpt",
        config=dict(_gpt(768, 12, 12, 1024, vocab=50304, attention="sdpa"), bias=False),
        seq=1024, global_batch=256, micro_batch=32, dp=2, machine="rtx4090", num_nodes=1,
        devices_per_node=2, precision="bf16", remat="none", zero="none", fused=True,
        step_s=1.19134, memory_gib=18885 / 1024,
        notes=("B=32 T=1024, 2 GPUs, 4 accumulation steps, 262144 tokens a step (the log)",
               "torch.compile, bf16 autocast over fp32 weights, AdamW, flash SDPA",
               "RMSNorm without weights in the run, the zoo GPT's LayerNorm here; "
               "residual branch scaled by 1/sqrt(24) (one elementwise op) not modeled",
               "DDP without no_sync: the run all-reduces the gradients after each of the "
               "4 micro-batches, priced once a step here [not expressible]",
               "RTX 4090 has no GPU peer-to-peer: NCCL goes through host memory; the "
               "preset prices PCIe 4 between the two")),
)
"""The rows the cost model was developed against (sessions 1-12)."""

BLOOM_TR1 = ("bigscience-workshop/bigscience train/tr1-13B-base/chronicles.md (commit "
             "0f19d3f2), 'Round3 ... NNODES=64' (GBS 1024, 64 nodes of 4 V100 32GB, '23-26 "
             "secs / iteration ... very unsteady') and the log lines at iterations "
             "29020-29090: 22.1-22.3 s (22306.6 ms at 29020); TP 2, PP 4, MBS 1 (the "
             "chronicles), 40 layers, hidden 5120, 32 heads, FFN 20480, seq 2048, fp16, "
             "ZeRO-1, activation checkpointing (train/tr1-13B-base/README.md, commit 053adafe)")
_TT_LLAMA2_NOTES = ("seq 4096: the Llama 2 default the source names [?]",
                    "A100 nodes' network not stated: DGX A100 [?]")


def _tt_llama2(size: str, remat: str, tokens: float, notes: tuple[str, ...] = ()
               ) -> PublishedRow:
    """torchtitan's Llama 2 row of ``size`` (multi-head attention, seq 4096): FSDP on 8
    DGX A100 nodes, global batch 128 of 2 per GPU, bf16, with ``remat``; ``tokens`` the
    published tokens/s per GPU."""
    ac = {"none": "no AC", "selective": "selective op AC", "full": "full AC"}[remat]
    key = f"torchtitan-llama2-{size}" + ("-sel" if remat == "selective" else "") + "-a100x64"
    return PublishedRow(
        key=key, label=f"Llama 2 {size.upper()}, FSDP on 64 A100 80GB, {ac}",
        source=TT_LLAMA2, short_source="torchtitan", family="llama", config=_llama2(size),
        seq=4096, global_batch=128, micro_batch=2, dp=64, machine="dgx-a100", num_nodes=8,
        precision="bf16", remat=remat, zero="fsdp", fused=False, tokens_per_gpu_s=tokens,
        notes=_TT_LLAMA2_NOTES + notes)


LLMC = ("karpathy/llm.c scripts/run_gpt2_124M.sh and run_gpt2_350M.sh (commit a0d5dbb, "
        "2024-05-30), run_gpt2_774M.sh (42dff87, 2024-06-12), run_gpt2_1558M.sh (c6efd90, "
        "2024-07-02): each script's header states the step time on its node ('~300ms/iter', "
        "'~820ms/iter', '~1.7s/iter' on 8X A100 80GB SXM; '2.80s/iter' on 8X H100 80GB SXM), "
        "its flags the batch: -b (sequences per GPU per micro-step) -t 1024 -d (tokens a "
        "step) -r 0 (no recompute) -z 1 (ZeRO-1), built with USE_CUDNN=1")
MODDED_LLMC = ("KellerJordan/modded-nanogpt records/track_1_short/2024-10-13_llmc/README.md "
               "(commit f411b3d3): llm.c as of 2024-10-13 on 8x H100 HBM3 'according to "
               "the instructions' of llm.c discussion #481, 'The mean per-step time was "
               "140ms', 10.26B tokens in 19560 steps (main.log): 2^19 tokens a step")
_LLMC_SHAPES = {"124m": (768, 12, 12), "350m": (1024, 24, 16), "774m": (1280, 36, 20),
                "1558m": (1600, 48, 25)}
"""llm.c's GPT-2 depths (``-e "d12"`` ...): hidden, layers, heads (train_gpt2.cu)."""
_LLMC_NOTES = ("llm.c: GPT-2 (learned positions, tied embedding, biases, GeLU) in C/CUDA, "
               "vocabulary padded to 50304; bf16 with fp32 master weights; cuDNN flash "
               "attention (SDPA here); hand-fused kernels (priced fused)",
               "loss: llm.c's fused_classifier over bf16 logits (torchalpa::cross_entropy "
               "here)",
               "llm.c's ZeRO-1 reduce-scatters the gradients and all-gathers the updated "
               "parameters once a step: ZeRO-2's traffic (zero2 here); it keeps the whole "
               "gradient buffer, which zero2 shards [not expressible]")
NEOX = ("Black et al. 2022, GPT-NeoX-20B (arXiv 2204.06745) sections 2.3 and 3: 96 "
        "A100-SXM4-40GB in 12 Supermicro AS-4124GO-NART servers, four ConnectX-6 HCAs a "
        "server, tensor parallel 2 x pipeline parallel 4, ZeRO, fp16, '117 teraFLOPS per "
        "GPU' (the paper's text as quoted by summaries of it: its PDF is not in the search "
        "corpora); EleutherAI/gpt-neox configs/20B.yml at the 20B release (c560814b, "
        "2022-02-10): 44 layers, hidden 6144, 64 heads, seq 2048, micro-batch 4 x 32 "
        "accumulation steps, ZeRO stage 1, activation checkpointing every layer, fp16")


TINYLLAMA = ("jzhang38/TinyLlama README.md (commit 8148930, 2024-02-03), 'Training Details' "
             "and 'Blazingly Fast': 16 A100-40G GPUs, 2 million tokens (2048 x 1024) a step, "
             "'a throughput of 24k tokens per second per A100-40G GPU ... 56% model flops "
             "utilization without activation checkpointing', 'a per-gpu batch size of 16k "
             "tokens'; pretrain/tinyllama.py (the same commit): FSDPStrategy(auto_wrap_policy="
             "{Block}, activation_checkpointing_policy=None), micro_batch_size 8, flash-attn's "
             "FusedCrossEntropyLoss; lit_gpt/config.py 'tiny_LLaMA_1b': 22 layers, hidden "
             "2048, 32 heads, 4 query groups, SwiGLU 5632, vocabulary 32000, FusedRMSNorm")


def _llmc(key: str, size: str, machine: str, micro: int, step_s: float, *, source: str = LLMC,
          short: str = "llm.c", tokens: int = 2 ** 19, notes: tuple[str, ...] = ()
          ) -> PublishedRow:
    """llm.c's GPT-2 ``size`` on one node of 8 ``machine`` GPUs: ``micro`` sequences of 1024
    per GPU per micro-step, ``tokens`` a step, ``step_s`` the published seconds a step."""
    hidden, layers, heads = _LLMC_SHAPES[size]
    return PublishedRow(
        key=key, label=f"GPT-2 {size.upper()} (llm.c), ZeRO-1 on 8 {machine}, seq 1024",
        source=source, short_source=short, family="gpt",
        config=dict(_gpt(hidden, layers, heads, 1024, vocab=50304, attention="sdpa"),
                    loss="fused"),
        seq=1024, global_batch=tokens // 1024, micro_batch=micro, dp=8, machine=machine,
        num_nodes=1, precision="bf16", remat="none", zero="zero2", fused=True,
        float32_logits=False, step_s=step_s, notes=_LLMC_NOTES + notes)


HELD_OUT: tuple[PublishedRow, ...] = (
    # llm-foundry's tables at sizes, sequence lengths and checkpointing the tuned rows
    # lack (30B and 70B with activation checkpointing, 125M and 760M, 8k and 32k tokens)
    _mpt("mpt-30b-h100x8", "30b", 8, "h100", 3, 21, 2002, remat="full"),
    _mpt("mpt-70b-a100x64", "70b", 64, "dgx-a100", 8, 4, 410, remat="full", pure=True),
    _mpt("mpt-13b-a100-40x8", "13b", 8, "a100-40", 4, 16, 1668, remat="full", pure=True),
    # the same two models on twice the GPUs (a third of the states per device): the
    # tables show them 13-20% faster per GPU than on 8
    _mpt("mpt-30b-h100x16", "30b", 16, "h100", 10, 3, 2263, remat="full"),
    _mpt("mpt-13b-a100-40x16", "13b", 16, "a100-40", 10, 1, 1993, remat="full", pure=True),
    _mpt("mpt-7b-a100x8-seq8k", "7b", 8, "dgx-a100", 8, 2, 3206, remat="full", seq=8192),
    _mpt("mpt-1b-a100x8-seq32k", "1b", 8, "dgx-a100", 1, 4, 6275, seq=32768),
    _mpt("mpt-760m-h100x8", "760m", 8, "h100", 24, 2, 63147),
    _mpt("mpt-125m-a100x8", "125m", 8, "dgx-a100", 32, 2, 141737),
    # torchtitan's Llama 2 rows: multi-head attention, seq 4096, no / selective / full AC
    _tt_llama2("13b", "none", 2162),
    _tt_llama2("13b", "selective", 1904, notes=(
        "selective op AC: torchtitan saves every other matmul's result, here every one is "
        "kept",)),
    _tt_llama2("70b", "full", 353),
    # a V100 pipeline under ZeRO-1: BigScience's first 13B run (Megatron-DeepSpeed, 2021)
    PublishedRow(
        key="bigscience-tr1-13b-v100x256",
        label="GPT 13B, tp2 x pp4 x dp32 on 256 V100 32GB (Jean Zay)", source=BLOOM_TR1,
        short_source="BigScience tr1",
        config=_gpt(5120, 40, 32, 2048, vocab=50432, dropout=MEGATRON_DROPOUT), seq=2048,
        global_batch=1024, micro_batch=1, tp=2, pp=4, dp=32, machine="jean-zay-v100",
        num_nodes=64, devices_per_node=4, family="gpt", precision="fp16", remat="full",
        zero="zero1", fused=True, plain_tp=True, step_s=22.3066,
        notes=("GPT-2 vocabulary 50257 padded to 50432 (Megatron: a multiple of 128 x tp)",
               "DeepSpeed's pipeline schedule priced as 1F1B",
               "the source calls the machine's step time unsteady (23-26 s between runs; "
               "the logged stretch 22.1-22.3 s is used)",
               "Jean Zay's NVLink topology within a node [?]; its 4 Omni-Path links per "
               "converged node from IDRIS's hardware page (gpu_specs, jean-zay-v100)")),
    # added by the nineteenth session, before any cost change was measured against them:
    # llm.c's GPT-2 scripts (a C/CUDA trainer, one node, 124M to 1.5B), the same 124M run
    # on H100s as modded-nanogpt logged it, TinyLlama's FSDP run on 16 A100 40GB, and
    # GPT-NeoX-20B's pipeline on A100 40GB
    _llmc("llmc-gpt2-124m-a100x8", "124m", "dgx-a100", 64, 0.300,
          notes=("'~300ms/iter': the script's approximate figure",)),
    _llmc("llmc-gpt2-350m-a100x8", "350m", "dgx-a100", 64, 0.820,
          notes=("'~820ms/iter': the script's approximate figure",)),
    _llmc("llmc-gpt2-774m-a100x8", "774m", "dgx-a100", 32, 1.7,
          notes=("'~1.7s/iter': the script's approximate figure; 2 micro-steps of 32",)),
    _llmc("llmc-gpt2-1558m-h100x8", "1558m", "h100", 16, 2.80, tokens=2 ** 20,
          notes=("8 micro-steps of 16 per GPU (-b 16, -d 1048576)",)),
    _llmc("modded-llmc-gpt2-124m-h100x8", "124m", "h100", 64, 0.140, source=MODDED_LLMC,
          short="modded-nanogpt",
          notes=("-b 64 per GPU [?]: the log gives 2^19 tokens a step, the flags are "
                 "those of llm.c's 124M script",)),
    PublishedRow(
        key="tinyllama-1.1b-a100-40x16", label="TinyLlama 1.1B, FSDP on 16 A100 40GB, seq 2048",
        source=TINYLLAMA, short_source="TinyLlama", family="llama",
        config=dict(vocab_size=32000, max_seq_len=2048, num_layers=22, hidden=2048,
                    num_heads=32, num_kv_heads=4, intermediate=5632, rope_theta=10000.0,
                    loss="fused"),
        seq=2048, global_batch=1024, micro_batch=8, dp=16, machine="a100-40", num_nodes=2,
        precision="bf16", remat="none", zero="fsdp", fused=True, float32_logits=False,
        tokens_per_gpu_s=24000,
        notes=("'24k' tokens/s/GPU: a rounded figure; 16 GPUs as the run trained [?] (the "
               "README does not say on how many it was measured)",
               "2 nodes of 8 A100 40GB; their network not stated: DGX A100 40GB [?]",
               "flash-attn 2, fused RMSNorm, fused rotary, xformers' fused SwiGLU: priced "
               "fused (no compiler); SDPA here",
               "Lightning's bf16-mixed FSDP: priced as fp32 parameters gathered and reduced "
               "in fp32, as the MPT rows [not expressible yet]",
               "loss: flash-attn's fused cross-entropy over bf16 logits "
               "(torchalpa::cross_entropy here)")),
    PublishedRow(
        key="gpt-neox-20b-a100-40x96",
        label="GPT-NeoX-20B, tp2 x pp4 x dp12 on 96 A100 40GB", source=NEOX,
        short_source="GPT-NeoX", family="gpt",
        config=_gpt(6144, 44, 64, 2048, vocab=50432), seq=2048, global_batch=1536,
        micro_batch=4, tp=2, pp=4, dp=12, machine="supermicro-a100-40", num_nodes=12,
        precision="fp16", remat="full", zero="zero1", fused=True, plain_tp=True,
        tflops_per_gpu=117, flop_count="gpt-neox", flop_params=20_556_201_984,
        notes=("117 TFLOP/s/GPU under GPT-NeoX's own logged count (6 P + 60 s h l per "
               "token, P = 20,556,201,984 of the model card) [?]: the paper does not say "
               "which count; under Eq. 3 the step would be 47.66 s, not 43.85 s",
               "rotary positions on a quarter of each head and GPT-J's parallel attention "
               "and MLP in the run (one all-reduce a layer instead of two: '15% throughput "
               "increase', the paper); learned positions and the sequential block here",
               "untied input and output embeddings in the run (no_weight_tying), tied here "
               "[not expressible]: 310M of 20.6B parameters",
               "fused softmax and bias-GeLU (Megatron's kernels), eager attention",
               "DeepSpeed's pipeline schedule priced as 1F1B; 11 layers a stage",
               "the batch: 1536 sequences (4 x 32 x 12; the paper: 'approximately 3.15M "
               "tokens')")),
)
"""Published runs added on 2026-11-30 that no cost-model change had been measured
against: their est/pub as first measured is in RESULTS.md ("Held-out rows" for the first
13, "Held-out rows from four new sources" for the nineteenth session's 7), before any
change made after seeing them."""

ROWS: tuple[PublishedRow, ...] = TUNED + HELD_OUT
"""Rows not here, and why: Megatron SC'21's 310B to 1T rows (1920-3072 GPUs; planning
one takes longer than this CPU allows in a run of the whole table); Korthikanti's 530B
and 1T rows (pipelines of 35 and 64 stages, likewise); its sequence-parallel + selective
recompute variants (neither is a plan torchalpa makes); Llama 3 405B (micro-batching and
recompute not published; a 16-stage pipeline on 8192 GPUs, past this CPU too); Megatron's
H100 table (precision, micro-batch and recompute not published; the README's newer weak
and strong scaling figures are images only); torchtitan's float8 rows (no float8 in the
cost model); Megatron-Turing NLG 530B (35-stage pipelines on 2240-3360 GPUs: planning
time, as Korthikanti's 530B); OPT-175B (its logbook PDF is not in the repository
snapshot, and the FLOP count behind its 147 TFLOP/s is not stated; 1024 sequences do not
split over its 124 data-parallel replicas); MegaScale's 175B table (not found in the
search corpora; its own rows also change the model: parallel blocks, sliding-window
attention, LAMB); the PyTorch FSDP paper's runs (not found in the search corpora)."""
