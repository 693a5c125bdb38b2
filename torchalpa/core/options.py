"""Parallelization methods and their options (validated, frozen dataclasses).

``ShardParallel`` is Alpa's intra-op auto-sharding: the ILP decides every layout.
They are plain data: ``torchalpa.parallel.methods`` maps each method class to how it
plans and builds (``torchalpa.plan`` / ``torchalpa.auto_parallel`` dispatch through it).
The options mirror Alpa's ``AutoShardingOption`` where they mean the same thing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from torchalpa.core.option_keywords import names_misplaced_keywords
from torchalpa.core.units import check_bytes

__all__ = ["AutoShardingOption", "ManualShardingOption", "ShardParallel", "DataParallel",
           "Zero1Parallel", "Zero2Parallel", "Zero3Parallel", "PipeshardParallel", "AutoLayerOption",
           "ManualStageOption", "UniformStageOption", "OPTIMIZER_STATES", "is_style",
           "AutoParallel", "method_of_plan", "REMAT_MODES", "Inference", "MODES", "parse_mode",
           "parse_remat", "check_remat", "PARAMETERS_OFFLOADED", "states_on_devices"]

REMAT_MODES = ("none", "selective", "full", "auto")
"""``AutoShardingOption.remat``'s values: one checkpointing mode, or 'auto' (none or full).
A mode may also name how many blocks it checkpoints: ``"full:5"`` recomputes the first 5
blocks (``layers.0`` to ``layers.4``) and keeps the others' activations (``parse_remat``)."""


def parse_remat(mode: str) -> tuple[str, int | None]:
    """``"full:5"`` -> ("full", 5): the policy and how many blocks (the first ones) it
    checkpoints; ``"full"`` -> ("full", None): every block."""
    policy, _, count = str(mode).partition(":")
    if not count:
        return policy, None
    if not count.isdigit():
        raise ValueError(f"remat {mode!r}: the block count after ':' must be an int >= 0, "
                         "e.g. 'full:5'")
    return policy, int(count)


def check_remat(mode: str, owner: str, allowed: tuple[str, ...] = REMAT_MODES) -> None:
    """A ValueError naming the choices unless ``mode`` is one of ``allowed`` or a policy
    of them with a block count ('full:5', 'selective:3')."""
    policy, count = parse_remat(mode) if ":" in str(mode) else (mode, None)
    if policy not in allowed or (count is not None and policy not in ("full", "selective")):
        raise ValueError(f"{owner} must be one of {allowed}, or 'full:K' / 'selective:K' "
                         f"(the first K blocks checkpointed), got {mode!r}")

# Optimizer state tensors kept per parameter element, for the memory model.
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1, "adagrad": 1,
                    "rmsprop": 1}

PARAMETERS_OFFLOADED = -2
"""``optimizer_states`` of a method whose parameters and gradients live in host memory
too: the memory model counts ``2 + optimizer_states`` copies of each trained parameter
on the devices, none here (the copies streamed per op are reserved apart,
``passes/pricing/offload_price.py``)."""


def states_on_devices(option, optimizer: str) -> int:
    """Optimizer state tensors per parameter element on the devices under ``option``."""
    if option.offload_parameters:
        return PARAMETERS_OFFLOADED
    return 0 if option.offload else OPTIMIZER_STATES[optimizer]


def is_style(value) -> bool:
    """Whether ``value`` is one of torch's tensor-parallel styles (``ColwiseParallel()``...)."""
    try:
        from torch.distributed.tensor.parallel import ParallelStyle
    except ImportError:   # torch built without distributed
        return False
    return isinstance(value, ParallelStyle)


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoShardingOption:
    """Knobs of the intra-op ILP."""

    solver: str = "auto"
    """'highs' (HiGHS, given the model's arrays directly), 'cbc' (CBC through PuLP, which
    ships it), or 'auto': HiGHS when highspy is importable (a dependency of torchalpa),
    else CBC. On the convolutional nets of torchvision HiGHS is several times faster and
    CBC can stop without a plan on the unsimplified problem (benchmarks/RESULTS.md,
    "Intra-op solves")."""
    time_limit: float | None = 3600.0
    """Seconds the solver may take: a safety net, not how the search is bounded (that is
    ``max_nodes``, which gives the same plan on any machine at any load). When it stops a
    solve, the plan's notes say so and the plan is not cached (a faster machine may find
    a better one). An hour: far above what any solve of the published targets takes on a
    quiet machine (seconds to a minute), so that a loaded one (a 2-core VM at load 20 runs
    a solve 10x slower) still stops by work; at 60 s the clock stopped LLaMA-3-8B's and
    GPT-39B's solves at load 12-37 (benchmarks/RESULTS.md)."""
    max_nodes: int | None = 2000
    """Branch-and-bound nodes each solver run may explore (HiGHS' ``mip_max_nodes``,
    CBC's ``maxNodes``); the best plan found by then is used. Work, not seconds: the same
    problem stops at the same plan however loaded the machine is. None: no limit."""
    gap: float | None = None
    """Relative optimality gap at which the solver may stop (None: solver default; under
    ``AutoParallel`` the candidates' ILPs then stop at its ``tolerance`` and the views that
    could win are solved again at the solver's default)."""
    memory_budget_per_device: float | None = None
    """Bytes per device the plan must fit in (None: the cluster's device memory)."""
    force_batch_dim_to_mesh_dim: int | None = None
    """Shard dim 0 of every user input over this mesh axis (-1: over all axes)."""
    parameters: str = "auto"
    """Parameter layouts (gradients and optimizer states follow): 'auto' lets the ILP
    choose, 'replicated' keeps them whole (DDP), 'sharded' splits each over every mesh
    axis where it divides (ZeRO / FSDP)."""
    allow_reduce_scatter: bool = True
    """Let a partial sum become a shard by reduce-scatter. Off, it is all-reduced and sliced
    (Alpa's default search space; its ZeRO presets turn reduce-scatter on)."""
    prefer_reduce_scatter: bool = False
    """Alpa's option of that name: after the ILP, each parameter whose gradient is
    all-reduced on a mesh axis (the batch's) is stored split on that axis too, its gradient
    reduce-scattered and the parameter gathered in its step's first read; the objective is
    the ILP's, without the rewrite (``passes/sharding/gradient_scatter.py``). Unlike
    ``allow_reduce_scatter`` it changes no other layout the ILP picks."""
    rematerialize_parameters: bool = False
    """Gather parameters again in backward instead of keeping forward's gathered copies
    (FSDP's reshard-after-forward, ZeRO-3); trades communication for memory."""
    remat: str = "none"
    """Activation checkpointing: 'none' keeps forward's activations for backward, 'full'
    recomputes each block's forward (``layers.3``) in its backward, keeping only block
    inputs (``frontends/block_remat.py``), 'selective' recomputes all but the results of
    matrix products and attention (torchtitan's op-level policy), 'auto' plans 'none' and
    'full' and keeps the faster plan that fits (``passes/sharding/remat_choice.py``; the default
    method, ``AutoParallel``, weighs all three). The plan records its choice
    (``method['remat']``)."""
    force_data_parallel: bool = False
    """Alpa's data parallelism: the mesh flattened to one axis (its largest latency, its
    smallest inverse bandwidth, as Alpa's ``LogicalDeviceMesh.flatten``), the batch split
    over it, parameters whole, no all-gather and no all-to-all: gradients are all-reduced
    over all devices and nothing else is communicated."""
    allow_all_gather: bool = True
    """Let resharding use all-gather (off: any layout change that needs one is forbidden)."""
    allow_all_to_all: bool = True
    """Let resharding use all-to-all."""
    allow_replicated_parameters: bool = True
    """Let a parameter be whole on every device; off, each is split over some mesh axis
    wherever one of its dims divides."""
    allow_mixed_mesh_shape: bool = True
    """Let one tensor dim be split over both axes of a 2D mesh (Alpa's S01). Alpa's
    default is False; ours keeps these layouts, since ZeRO-style plans on 2D meshes need
    them."""
    slice_before_reduce: bool = True
    """Let a sum take a slice of a whole operand, and a partial sum be sliced before its
    all-reduce, so that the all-reduce moves only a part: on a 2D mesh a bias's or layer
    norm's gradient summed at half size over one axis and gathered on the other. Alpa's
    space has neither (its reductions read the layout their operand is made in, and each
    op all-reduces the whole result it makes); False keeps the search to Alpa's there."""
    allow_recompute_heavy_op: bool = False
    """Let compute-bound ops (matmuls, convolutions) run redundantly on several devices;
    off (Alpa's default), they are always split over every device when they can be."""
    force_simple_heuristic: str = ""
    """'' solves the ILP; 'shard-largest' (Alpa's) picks for each op, in order, the
    strategy holding the fewest bytes per device among those its operands can reach."""
    all_reduce_threshold: int | None = None
    """Merge gradient all-reduces on the same mesh axis into buckets of at most this many
    bytes (Alpa's ``all_reduce_threshold``, whose default 2**60 merges them all): the plan
    lists the buckets in ``estimates.gradient_buckets`` and prices one latency per
    bucket. The runtime packs the gradients' final all-reduces and reduce-scatters into
    buckets of this size (``runtime/rewrites/buckets.py``); None: the planner prices one collective
    per gradient and the runtime uses DDP's 25 MiB buckets; 0: no buckets at all."""
    enable_auto_sharding: bool = True
    """Off: no search. Parameters and inputs keep the layouts ``pin`` gives them (Alpa's
    ``ManualShardingOption``) and are otherwise whole; each op takes the cheapest layout
    reachable from its operands' (layouts propagate, as in XLA's sharding propagation)."""
    free_followers_below: int = 4000
    """Graphs of at most this many nodes are solved with the followers (ops that take
    their operand's layout in the simplified ILP) deciding on their own, repeated layers
    still sharing decisions: a problem that contains the simplified one, solved in its
    place (the simplified one only if the solver stops without a plan); graphs also
    re-solved unsimplified (``exact_below``) solve it from the simplified plan, and the
    unsimplified problem from the better of the two. On GPT-39B's
    pipeline stages (800-1600 nodes) this finds nearly all that the unsimplified re-solve
    (``exact_below``) finds, from a problem a tenth its size
    (``tests/test_free_followers.py``); on whole models it doubled the solve for a plan
    0.3-0.5 % faster (LLaMA-3-8B on 8 x 8: 5.6 -> 10.8 s, 6774 nodes), hence the bound.
    0 turns it off."""
    free_followers_near_budget: float = 0.9
    """A graph above ``free_followers_below`` whose simplified plan peaks at this fraction
    of the memory budget or above is re-solved with free followers from that plan, the
    better plan kept (a pipeline's picked stages too; not the search's per-layer
    estimates): near the budget the merge of followers into their operands' decisions
    costs most. On LLaMA-3-8B on 1 x 8 H100 (batch 16 x 8192, ``AutoParallel``) every
    re-solved view got 0.5-25 % faster and the plan 2.632 -> 2.482 s/step, for 1.0-1.2x
    the search's CPU; views at 62-68 % of the budget are left alone, and 0.8 or 0.95
    pick the same plan there. A pipeline whose picked stages are large and sit at the
    budget pays most (the small GPT's stages solved as large ones: 1.1-9.9 % faster
    plans for 1.1-2.2x the CPU). 0 turns it off."""
    alternate_blocks: bool = True
    """Where repeated layers share decisions and the shared plan reshards values between
    them (more than 1 % of its step), solve once more letting every other layer decide
    apart (Megatron's column- then row-parallel Linear pairs), keeping the better plan.
    The pipeline search's per-layer estimates turn it off: on GPT-39B (8 x 8) it was 52
    of their 166 solves and moved 4 of 150 estimates by at most 0.17 %; the stages the
    search picks are solved with it."""
    exact_below: int = 2000
    """Graphs of at most this many nodes are also solved without simplification (shared
    decisions of repeated layers, followers), starting from the best plan found so far,
    and the better plan is kept: there, simplification never costs optimality. Larger
    graphs keep the simplified plan (a restriction of the full problem). 0 turns the
    check off."""
    pin: tuple = ()
    """Fixed layouts: ``{regex: placements}`` (or pairs) matched against parameter names
    and user inputs (named after forward's arguments, e.g. 'input_ids'), e.g.
    ``{"layers[.]0[.]wq[.]weight": ("R", "S(0)")}``;
    ``"*"`` on an axis leaves that axis to the ILP; ``"..."`` first leaves every leading
    axis to it, whatever the mesh's number of axes (``("...", "S(0)")``: the last axis).
    Pins override ``parameters``. A value may also be one of torch's tensor-parallel
    styles keyed by module path, as ``parallelize_module`` takes them:
    ``{"layers.*.attn.wq": ColwiseParallel(), "layers.*.attn.wo": RowwiseParallel()}``
    pins those modules' parameters on the last mesh axis as the style lays them out
    (``torchalpa/parallel/tp_pins.py``; ``plan.to_tp_plan()`` goes the other way)."""
    random: str = "sharded"
    """Random ops (dropout masks, ``rand``): 'sharded' lets each device draw its own block
    (replicas draw alike, blocks independently; same distribution as one device, other
    numbers; dropout's input is never gathered for its mask), 'replicated' has every
    device draw whole tensors as one device does (bitwise single-device numerics, at the
    cost of gathering what random ops read). See ``passes/rules/random.py``."""
    elementwise: str = "eager"
    """How a torch graph's elementwise chains are priced: 'eager' (each ATen op its own
    kernel, moving its inputs and outputs: the runtime without ``compile``) or 'fused'
    (chains fused as ``torch.compile`` and XLA run them, ``passes/pricing/fused_pricing.py``).
    StableHLO programs are always priced as XLA fuses them."""

    sequence_parallel: bool = False
    """Megatron's sequence parallelism, asked for: every normalization of the forward step
    (layer norm; RMS norm's written-out ops, those of a module whose name ends in "norm")
    splits the sequence dim (dim 1 of ``(batch, seq, hidden)``) over the last mesh axis,
    the tensor-parallel one. The ILP places the rest (the residual adds and dropouts
    beside the norms split alike where that pays; an all-gather before each column-parallel
    product, a reduce-scatter after each row-parallel one), and each product's backward
    gathers its input again rather than keep forward's gathered copy. Off, the ILP still
    splits them by sequence where that is cheaper or needed to fit
    (``passes/sharding/constraints.py``), and keeps a gathered copy for backward where its
    memory is worth the gather it saves (``passes/pricing/gathered_views.py``)."""
    plain_tensor_parallel: bool = False
    """Megatron's tensor parallelism as it ran before sequence parallelism (Megatron-LM
    2019-2021, Megatron-DeepSpeed): every normalization of the forward step whole over the
    last mesh axis (the tensor-parallel one), so each row-parallel product's partial sums
    are all-reduced into a whole activation and the norms run whole on every rank; and
    a matmul reads a weight split over that axis (pinned so) in its split, never gathered
    (column- and row-parallel products). Off, the ILP may split the norms by sequence
    (sequence parallelism) and gather weights to split tokens where that is cheaper."""

    offload: bool = False
    """Optimizer states in host memory (DeepSpeed's ZeRO-Offload): devices hold parameters
    and gradients; after backward each rank copies its gradients to the host, steps the
    optimizer there on a host copy of its parameters, and copies them back
    (``runtime/execution/host_optimizer.py``), priced with the host link's bandwidth (``Cluster``'s
    ``host_link_bandwidth``; ``passes/pricing/offload_price.py``). ``AutoParallel`` turns it on only
    when nothing fits on the devices."""
    offload_parameters: bool = False
    """Parameters and gradients in host memory too (ZeRO-Infinity's parameter offload, FSDP's
    ``CPUOffload``): with ``offload``, the devices hold no model state between ops; each
    parameter is copied to the device just before the op that reads it (one ahead, on a
    side stream), in forward and again in backward, and each gradient is copied to the host
    as soon as backward makes it (``runtime/rewrites/param_stream.py``). Needs ``offload``
    and ``rematerialize_parameters`` (backward reads its own copies)."""

    def __post_init__(self):
        check_remat(self.remat, "AutoShardingOption.remat")
        if self.random not in ("sharded", "replicated"):
            raise ValueError(f"AutoShardingOption.random must be 'sharded' or 'replicated', "
                             f"got {self.random!r}")
        if self.elementwise not in ("eager", "fused"):
            raise ValueError(f"AutoShardingOption.elementwise must be 'eager' or 'fused', "
                             f"got {self.elementwise!r}")
        if self.plain_tensor_parallel and self.sequence_parallel:
            raise ValueError("AutoShardingOption: sequence_parallel=True splits the norms by "
                             "sequence and plain_tensor_parallel=True keeps them whole; set "
                             "one of them")
        if self.offload_parameters and not (self.offload and self.rematerialize_parameters):
            raise ValueError("AutoShardingOption.offload_parameters needs offload=True (the "
                             "optimizer steps on the host) and rematerialize_parameters=True "
                             "(backward copies the parameters again): set both")
        if self.parameters not in ("auto", "replicated", "sharded"):
            raise ValueError(f"AutoShardingOption.parameters must be 'auto', 'replicated' or "
                             f"'sharded', got {self.parameters!r}")
        pin = self.pin.items() if isinstance(self.pin, dict) else self.pin
        normalized = []
        for pattern, placements in pin:
            if is_style(placements):   # translated for the model by plan / auto_parallel
                normalized.append((str(pattern), placements))
                continue
            if isinstance(placements, str):
                placements = (placements,)
            from torchalpa.core.placement import check_placement, parse_placements, short_form
            placements = tuple(p if isinstance(p, str) else short_form(check_placement(p))
                               for p in placements)   # torch's Shard(0) or "S(0)"
            if "..." in placements[1:]:
                raise ValueError(f"AutoShardingOption.pin[{pattern!r}] = {placements}: '...' "
                                 "may only come first (the leading mesh axes left free)")
            parsed = parse_placements([p for p in placements if p not in ("*", "...")])
            if any(getattr(p, "reduce_op", None) in ("max", "min") for p in parsed):
                raise ValueError(f"AutoShardingOption.pin[{pattern!r}] = {placements}: a "
                                 "Partial max or min only arises inside a step (a max over "
                                 "a split dim); pin Shard, Replicate or Partial(sum|avg)")
            normalized.append((str(pattern), placements))
        object.__setattr__(self, "pin", tuple(normalized))
        if self.solver not in ("auto", "cbc", "highs"):
            raise ValueError(f"AutoShardingOption.solver must be 'auto', 'cbc' or 'highs', "
                             f"got {self.solver!r}")
        if self.max_nodes is not None and (isinstance(self.max_nodes, bool) or
                                           not isinstance(self.max_nodes, int) or
                                           self.max_nodes < 1):
            raise ValueError(f"AutoShardingOption.max_nodes must be a positive int or None, "
                             f"got {self.max_nodes!r}")
        if self.memory_budget_per_device is not None:
            check_bytes(self.memory_budget_per_device,
                        "AutoShardingOption.memory_budget_per_device")
        if self.time_limit is not None and self.time_limit <= 0:
            raise ValueError(f"AutoShardingOption.time_limit must be > 0 seconds, "
                             f"got {self.time_limit}")
        if self.force_simple_heuristic not in ("", "shard-largest"):
            raise ValueError(f"AutoShardingOption.force_simple_heuristic must be '' or "
                             f"'shard-largest', got {self.force_simple_heuristic!r}")
        if self.all_reduce_threshold is not None and self.all_reduce_threshold < 0:
            raise ValueError(f"AutoShardingOption.all_reduce_threshold must be >= 0 bytes or "
                             f"None, got {self.all_reduce_threshold}")
        for name in ("free_followers_below", "exact_below"):
            if getattr(self, name) < 0:
                raise ValueError(f"AutoShardingOption.{name} must be >= 0 nodes (0: off), "
                                 f"got {getattr(self, name)}")
        if not 0 <= self.free_followers_near_budget:
            raise ValueError(f"AutoShardingOption.free_followers_near_budget must be >= 0 "
                             f"(0: off), got {self.free_followers_near_budget}")
        if self.gap is not None and not 0 <= self.gap < 1:
            raise ValueError(f"AutoShardingOption.gap must be in [0, 1), got {self.gap}")
        self._check_parameter_options()

    def _check_parameter_options(self):
        if self.parameters == "replicated" and not self.allow_replicated_parameters:
            raise ValueError("AutoShardingOption: parameters='replicated' keeps every "
                             "parameter whole, allow_replicated_parameters=False forbids "
                             "that; drop one of the two")


def check_method_option(option: AutoShardingOption) -> None:
    """A method's option combinations that contradict themselves (each error names both
    knobs). Checked where a method is made, not on every ``replace`` of an option (the
    stage search tries sharded parameters on the options it is given)."""
    if option.parameters == "sharded" and option.force_data_parallel:
        raise ValueError("AutoShardingOption: force_data_parallel=True keeps every parameter "
                         "whole (Alpa's data parallelism), parameters='sharded' splits them; "
                         "use Zero2Parallel / Zero3Parallel for sharded parameters, or drop "
                         "one of the two")
    if option.parameters == "sharded" and not option.allow_all_gather \
            and option.force_batch_dim_to_mesh_dim == -1:
        raise ValueError("AutoShardingOption: parameters='sharded' with the batch split over "
                         "every mesh axis (force_batch_dim_to_mesh_dim=-1) gathers each "
                         "parameter where it is used, allow_all_gather=False forbids "
                         "all-gathers; allow them, or keep parameters 'auto'")


@dataclass(frozen=True, kw_only=True, slots=True)
class ManualShardingOption:
    """Layouts given by hand (Alpa's ``ManualShardingOption``): ``pin`` maps regexes over
    parameter names and user inputs ('input0', ...) to placements, as
    ``AutoShardingOption.pin`` does. With ``enable_auto_sharding=False`` these layouts
    propagate to the ops and nothing is searched; otherwise the ILP plans around them."""

    pin: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "pin", AutoShardingOption(pin=self.pin).pin)


def _checked_keywords(cls):
    """Unknown keywords of a method answered with the option record that holds them
    (``option_keywords``): AutoShardingOption's and AutoLayerOption's fields."""
    return names_misplaced_keywords(lambda: {"auto_sharding_option": AutoShardingOption,
                                             "layer_option": AutoLayerOption})(cls)


@_checked_keywords
@dataclass(frozen=True, kw_only=True, slots=True)
class ShardParallel:
    """Intra-operator parallelism chosen by Alpa's ILP over one logical mesh."""

    logical_mesh_shape: tuple[int, ...] | None = None
    """Shape of the logical mesh; None views all devices as one 1D mesh."""
    auto_sharding_option: AutoShardingOption = field(default_factory=AutoShardingOption)
    optimizer: str = "adam"
    """Optimizer whose states the memory model counts (see OPTIMIZER_STATES)."""
    manual_sharding_option: ManualShardingOption | None = None
    """Layouts fixed by hand; they join ``auto_sharding_option.pin``."""
    num_micro_batches: int = 1
    """Gradient accumulation (Alpa's ``ShardParallel(num_micro_batches=)``): a step runs
    this many micro-batches (dim 0 of the example inputs divided by it) one after the
    other and reduces the summed gradients once. The plan is made for one micro-batch and
    priced as the step runs it: everything a micro-batch does counts this many times, the
    gradients' final reductions once (so a gradient is not reduced inside backward, per
    micro-batch, where it could be reduced once at the end). ``auto_parallel``'s
    ``num_micro_batches=`` sets it (or must equal it)."""

    def __post_init__(self):
        if isinstance(self.num_micro_batches, bool) or not isinstance(self.num_micro_batches, int) \
                or self.num_micro_batches < 1:
            raise ValueError(f"ShardParallel.num_micro_batches must be a positive int, "
                             f"got {self.num_micro_batches!r}")
        check_method_option(self.auto_sharding_option)
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"ShardParallel.optimizer must be one of "
                             f"{sorted(OPTIMIZER_STATES)}, got {self.optimizer!r}")
        if self.logical_mesh_shape is not None:
            shape = tuple(int(s) for s in self.logical_mesh_shape)
            if not shape or any(s < 1 for s in shape):
                raise ValueError(f"ShardParallel.logical_mesh_shape must be positive ints, "
                                 f"got {self.logical_mesh_shape}")
            object.__setattr__(self, "logical_mesh_shape", shape)

    @property
    def optimizer_states(self) -> int:
        """Optimizer state tensors per parameter element on the devices (none offloaded;
        ``PARAMETERS_OFFLOADED``: the parameter and its gradient are not there either)."""
        return states_on_devices(self.auto_sharding_option, self.optimizer)

    def to_dict(self) -> dict:
        """Plain JSON data (tuples become lists), as stored in plans."""
        d = json.loads(json.dumps(asdict(self)))
        d["name"] = type(self).__name__
        return d


def with_micro_batches(method, num_micro_batches: int | None):
    """``method`` with ``auto_parallel``'s ``num_micro_batches=`` (a ShardParallel or
    PipeshardParallel): set where the method leaves it at 1, a ValueError where the two
    disagree."""
    if num_micro_batches is None or num_micro_batches == method.num_micro_batches:
        return method
    if method.num_micro_batches != 1:
        raise ValueError(f"num_micro_batches={num_micro_batches} disagrees with the method's "
                         f"{type(method).__name__}(num_micro_batches={method.num_micro_batches}); "
                         "give it in one place")
    return replace(method, num_micro_batches=num_micro_batches)


def _option(**kw):
    return field(default_factory=lambda: AutoShardingOption(**kw))


@_checked_keywords
@dataclass(frozen=True, kw_only=True)
class DataParallel(ShardParallel):
    """DDP: the batch split over every device (the mesh flattened to one axis),
    parameters whole on each, gradients all-reduced; nothing else communicated."""

    auto_sharding_option: AutoShardingOption = _option(force_data_parallel=True,
                                                       force_batch_dim_to_mesh_dim=-1,
                                                       parameters="replicated")


@_checked_keywords
@dataclass(frozen=True, kw_only=True)
class Zero1Parallel(ShardParallel):
    """ZeRO-1 (DeepSpeed stage 1): the batch split over every device; optimizer states
    sharded; gradients all-reduced whole, as DDP does, each rank updating its own shard of
    every parameter, the updated shards all-gathered (here: in the next step's forward,
    where each parameter is first read). Between steps a rank keeps its shard of the
    parameters and gradients, so it holds no more than DeepSpeed's stage 1. Beside
    ``Zero2Parallel`` it moves 1.5x the bytes (an all-reduce where ZeRO-2 reduce-scatters)."""

    auto_sharding_option: AutoShardingOption = _option(force_batch_dim_to_mesh_dim=-1,
                                                       parameters="sharded",
                                                       allow_reduce_scatter=False)


@_checked_keywords
@dataclass(frozen=True, kw_only=True)
class Zero2Parallel(ShardParallel):
    """ZeRO-2 / FSDP SHARD_GRAD_OP: the batch split over every device; parameters,
    gradients and optimizer states sharded between steps; each parameter gathered once
    per step and kept until backward is done with it; gradients reduce-scattered."""

    auto_sharding_option: AutoShardingOption = _option(force_batch_dim_to_mesh_dim=-1,
                                                       parameters="sharded")


@_checked_keywords
@dataclass(frozen=True, kw_only=True)
class Zero3Parallel(ShardParallel):
    """ZeRO-3 / FSDP FULL_SHARD: like Zero2Parallel, but parameters are gathered again in
    backward instead of being kept from forward."""

    auto_sharding_option: AutoShardingOption = _option(force_batch_dim_to_mesh_dim=-1,
                                                       parameters="sharded",
                                                       rematerialize_parameters=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoLayerOption:
    """Cut the training step into layers automatically (Alpa's layer construction)."""

    layer_num: int | str = "auto"
    """How many layers; 'auto' uses the model's pipeline-boundary markers if it has any,
    else min(2 x devices, 16)."""
    eps: float = 0.6
    """Each layer may have up to (1 + eps) times the average forward flops."""

    def __post_init__(self):
        if self.layer_num != "auto" and (not isinstance(self.layer_num, int) or self.layer_num < 1):
            raise ValueError(f"AutoLayerOption.layer_num must be a positive int or 'auto', "
                             f"got {self.layer_num!r}")
        if self.eps < 0:
            raise ValueError(f"AutoLayerOption.eps must be >= 0, got {self.eps}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ManualStageOption:
    """Stages given by hand, as in Alpa: which layers, on which submesh, viewed how."""

    forward_stage_layer_ids: tuple[tuple[int, ...], ...]
    submesh_shapes: tuple[tuple[int, int], ...]
    """Physical (nodes, devices per node) of each stage's submesh."""
    logical_shapes: tuple[tuple[int, ...], ...] | None = None
    """Logical mesh of each stage (default: the submesh as 1D)."""
    options: tuple[AutoShardingOption, ...] | None = None
    recompute: tuple[bool, ...] | None = None
    """Per stage, whether it checkpoints its activations (keeps only each micro-batch's
    inputs and runs its forward again before its backward; default: none does)."""

    def __post_init__(self):
        ids = tuple(tuple(int(i) for i in s) for s in self.forward_stage_layer_ids)
        object.__setattr__(self, "forward_stage_layer_ids", ids)
        flat = [i for s in ids for i in s]
        if not ids or flat != list(range(len(flat))):
            raise ValueError("ManualStageOption.forward_stage_layer_ids must cover layers 0..L-1 "
                             f"in order, each once, got {ids}")
        shapes = tuple(tuple(int(x) for x in s) for s in self.submesh_shapes)
        object.__setattr__(self, "submesh_shapes", shapes)
        if len(shapes) != len(ids):
            raise ValueError(f"ManualStageOption has {len(ids)} stages but {len(shapes)} "
                             "submesh_shapes")
        for name in ("logical_shapes", "options", "recompute"):
            value = getattr(self, name)
            if value is not None:
                if len(value) != len(ids):
                    raise ValueError(f"ManualStageOption.{name} needs one entry per stage "
                                     f"({len(ids)}), got {len(value)}")
                object.__setattr__(self, name, tuple(tuple(v) if name == "logical_shapes" else
                                                     bool(v) if name == "recompute" else v
                                                     for v in value))


@dataclass(frozen=True, kw_only=True, slots=True)
class UniformStageOption:
    """Equal stages on equal submeshes: the simple baseline."""

    num_stages: int | None = None
    """Default: one stage per node, or 2 on a single node."""


@_checked_keywords
@dataclass(frozen=True, kw_only=True, slots=True)
class PipeshardParallel:
    """Alpa's inter- and intra-operator parallelism: the training step is cut into layers,
    layers into pipeline stages on submeshes (a dynamic program), and each stage is
    sharded on its submesh by the intra-op ILP; micro-batches flow through the stages."""

    num_micro_batches: int = 1
    layer_option: AutoLayerOption = field(default_factory=AutoLayerOption)
    stage_option: object = "auto"
    """'auto' (Alpa's DP on the cost model), 'profile' (the same DP on layer times measured
    on this job's devices; needs ``auto_parallel`` under torchrun), 'uniform',
    UniformStageOption(...) or ManualStageOption(...)."""
    pipeline_schedule: str = "1f1b"
    """'1f1b' or 'gpipe'."""
    auto_sharding_option: AutoShardingOption = field(default_factory=AutoShardingOption)
    optimizer: str = "adam"

    def __post_init__(self):
        if not isinstance(self.num_micro_batches, int) or self.num_micro_batches < 1:
            raise ValueError(f"PipeshardParallel.num_micro_batches must be a positive int, "
                             f"got {self.num_micro_batches!r}")
        if self.pipeline_schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"PipeshardParallel.pipeline_schedule must be '1f1b' or 'gpipe', "
                             f"got {self.pipeline_schedule!r}")
        if self.stage_option == "uniform":
            object.__setattr__(self, "stage_option", UniformStageOption())
        if not (self.stage_option in ("auto", "profile") or
                isinstance(self.stage_option, (ManualStageOption, UniformStageOption))):
            raise ValueError("PipeshardParallel.stage_option must be 'auto', 'profile', "
                             "'uniform', UniformStageOption or ManualStageOption, got "
                             f"{self.stage_option!r}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"PipeshardParallel.optimizer must be one of "
                             f"{sorted(OPTIMIZER_STATES)}, got {self.optimizer!r}")
        stage_options = getattr(self.stage_option, "options", None) or ()
        if any(o.offload for o in (self.auto_sharding_option, *stage_options)):
            raise ValueError("PipeshardParallel cannot offload (AutoShardingOption.offload): "
                             "offloading to host memory is planned for intra-op plans only; "
                             "use ShardParallel(auto_sharding_option=AutoShardingOption("
                             "offload=True)) or AutoParallel(offload=True), or a pipeline "
                             "without offload")

    @property
    def optimizer_states(self) -> int:
        """Optimizer state tensors per parameter element on the devices (none offloaded;
        ``PARAMETERS_OFFLOADED``: the parameter and its gradient are not there either)."""
        return states_on_devices(self.auto_sharding_option, self.optimizer)

    def intra_op_method(self, option: AutoShardingOption | None = None) -> ShardParallel:
        """The ShardParallel each stage is planned with."""
        return ShardParallel(auto_sharding_option=option or self.auto_sharding_option,
                             optimizer=self.optimizer)

    def to_dict(self) -> dict:
        d = json.loads(json.dumps(asdict(self), default=str))
        d["name"] = type(self).__name__
        return d


@_checked_keywords
@dataclass(frozen=True, kw_only=True, slots=True)
class AutoParallel:
    """The default method: the planner chooses among the others.

    It weighs intra-op plans on every logical view of the cluster (``ShardParallel``,
    whose ILP already covers data parallelism and every ZeRO stage through parameter
    layouts), pipelines (``PipeshardParallel``: stages, submeshes, schedule), activation
    checkpointing (``remat``) and gradient accumulation (``num_micro_batches`` among the
    divisors of the batch), under the memory budget, and keeps the fastest estimate that
    fits (``torchalpa/parallel/auto.py``). Candidates that cannot fit or cannot win are
    refused by lower bounds (``passes/pricing/bounds.py``) without a solver. The plan's summary
    says what was chosen and what came second. Each field given narrows the search; a
    concrete method given to ``plan``/``auto_parallel`` is used as it is.
    """

    remat: tuple[str, ...] = ("none", "selective", "full", "layers")
    """Activation checkpointing modes weighed (``AutoShardingOption.remat``'s modes, with
    block counts too: 'full:5'). 'layers' lets the search checkpoint only some blocks
    where memory is tight (the first k of L, k chosen by the memory each block frees:
    ``passes/sharding/layer_remat.py``); it needs 'none' or 'full' beside it to bracket k."""
    offload: bool | str | None = None
    """Optimizer states in host memory (``AutoShardingOption.offload``): None weighs it
    only when no plan fits on the devices (then parameters too, when even that does not
    fit), False never, True always, 'parameters' always with the parameters and gradients
    in host memory too (``AutoShardingOption.offload_parameters``)."""
    num_micro_batches: int | None = None
    """Micro-batches per step; None: chosen among the divisors of the batch."""
    pipeline: bool | None = None
    """True: only pipelines; False: never (one intra-op plan); None: weighed."""
    rematerialize_parameters: bool | None = None
    """Intra-op plans gather parameters again in backward (ZeRO-3, FSDP's reshard after
    forward; ``AutoShardingOption.rematerialize_parameters``): True or False fixes it,
    None weighs both."""
    time_budget_s: float = 3600.0
    """A safety net, not how the search is bounded: the search stops by work (candidates'
    bounds, the solver's ``AutoShardingOption.max_nodes``), so it gives the same plan on
    any machine at any load. Past these seconds it starts no new candidate (the one being
    solved finishes with what is left; at least one is always solved), and the plan's
    notes say the clock stopped it (such a plan is not cached). An hour, as the solver's
    ``time_limit``: at 600 s it fired on LLaMA-3-8B (1 x 8 H100, 286 s quiet) at load 18
    and on GPT-39B (8 x 8) at load 12 on a 2-core VM, and the plan was then the clock's."""
    tolerance: float = 0.01
    """Stop once no remaining candidate's lower bound is below the best plan's estimate
    by more than this fraction. The candidates' intra-op ILPs stop within this relative
    gap too (where ``auto_sharding_option.gap`` is None), and every view whose plan could
    hide a better one is solved again at the solver's own gap, keeping the better plan."""
    optimizer: str = "adam"
    """Optimizer whose states the memory model counts (see OPTIMIZER_STATES)."""
    auto_sharding_option: AutoShardingOption = field(default_factory=AutoShardingOption)
    """Solver, memory budget, pins and layout restrictions, applied to every candidate
    (its ``remat`` is the search's to set: leave it 'none')."""
    layer_option: AutoLayerOption = field(default_factory=AutoLayerOption)
    """How pipeline candidates cut the step into layers."""

    def __post_init__(self):
        remat = (self.remat,) if isinstance(self.remat, str) else tuple(self.remat)
        try:
            for m in remat:
                check_remat(m, "AutoParallel.remat", ("none", "selective", "full", "layers"))
        except ValueError:
            raise ValueError(f"AutoParallel.remat must be modes among ('none', 'selective', "
                             f"'full', 'layers') or 'full:K' / 'selective:K', got "
                             f"{self.remat!r}") from None
        if not remat:
            raise ValueError("AutoParallel.remat must name at least one mode, e.g. ('none',)")
        object.__setattr__(self, "remat", remat)
        if self.offload not in (None, True, False, "parameters"):
            raise ValueError(f"AutoParallel.offload must be True, False, None or "
                             f"'parameters', got {self.offload!r}")
        if self.num_micro_batches is not None and (
                isinstance(self.num_micro_batches, bool)
                or not isinstance(self.num_micro_batches, int) or self.num_micro_batches < 1):
            raise ValueError(f"AutoParallel.num_micro_batches must be a positive int or None, "
                             f"got {self.num_micro_batches!r}")
        if self.rematerialize_parameters not in (None, True, False):
            raise ValueError(f"AutoParallel.rematerialize_parameters must be True, False or "
                             f"None, got {self.rematerialize_parameters!r}")
        if self.pipeline not in (None, True, False):
            raise ValueError(f"AutoParallel.pipeline must be True, False or None, "
                             f"got {self.pipeline!r}")
        if self.pipeline is True and self.offload:
            raise ValueError(f"AutoParallel(pipeline=True, offload={self.offload!r}) cannot be "
                             "planned: offloading to host memory is planned for intra-op plans "
                             "only, not pipeline stages; use pipeline=True with offload=None "
                             "or False, or offload=True / 'parameters' with pipeline=None or "
                             "False")
        if self.time_budget_s <= 0:
            raise ValueError(f"AutoParallel.time_budget_s must be > 0 seconds, "
                             f"got {self.time_budget_s}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"AutoParallel.tolerance must be in [0, 1), got {self.tolerance}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"AutoParallel.optimizer must be one of "
                             f"{sorted(OPTIMIZER_STATES)}, got {self.optimizer!r}")
        if self.auto_sharding_option.remat != "none":
            raise ValueError("AutoParallel chooses activation checkpointing itself: set "
                             "AutoParallel(remat=(...)) to narrow it, not "
                             "auto_sharding_option.remat")
        if self.auto_sharding_option.offload or self.auto_sharding_option.offload_parameters:
            raise ValueError("AutoParallel chooses offload itself: set "
                             "AutoParallel(offload=True) to force it, not "
                             "auto_sharding_option.offload")

    @property
    def optimizer_states(self) -> int:
        """Optimizer state tensors per parameter element on the devices (none offloaded;
        ``PARAMETERS_OFFLOADED``: the parameter and its gradient are not there either)."""
        return PARAMETERS_OFFLOADED if self.offload == "parameters" else \
            0 if self.offload else OPTIMIZER_STATES[self.optimizer]

    @property
    def weighs_offload(self) -> bool:
        """Whether the search tries host memory when no plan fits on the devices: offload
        left None, an optimizer with states, and intra-op plans among the candidates
        (offloading is planned for intra-op plans only: ``pipeline=True`` never offloads)."""
        return self.offload is None and self.pipeline is not True and \
            OPTIMIZER_STATES[self.optimizer] > 0

    def to_dict(self) -> dict:
        d = json.loads(json.dumps(asdict(self), default=str))
        d["name"] = type(self).__name__
        return d


def method_of_plan(plan) -> ShardParallel | PipeshardParallel:
    """The concrete method a plan was made with, from its record (``plan.method``): what
    ``auto_parallel`` builds when it is given a plan, or when ``AutoParallel`` chose it."""
    record = dict(plan.method)
    fields = dict(record.get("auto_sharding_option", {}))
    fields = {k: v for k, v in fields.items() if k in AutoShardingOption.__dataclass_fields__}
    fields["remat"] = record.get("remat", fields.get("remat", "none"))
    option = AutoShardingOption(**fields)
    optimizer = record.get("optimizer", "adam")
    if hasattr(plan, "transfers"):       # a PipelinePlan
        return PipeshardParallel(num_micro_batches=plan.num_micro_batches,
                                 auto_sharding_option=option, optimizer=optimizer,
                                 pipeline_schedule=plan.schedule)
    shape = record.get("logical_mesh_shape")
    return ShardParallel(num_micro_batches=int(record.get("num_micro_batches", 1)),
                         auto_sharding_option=option, optimizer=optimizer,
                         logical_mesh_shape=tuple(shape) if shape else None)


# -- what is planned: the training step, or generation -----------------------------------

MODES = ("training", "inference")
"""``mode=`` of ``torchalpa.plan`` / ``torchalpa.auto_parallel`` (an ``Inference`` too)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Inference:
    """Plan and build a causal LM for generation (``mode="inference"`` is ``Inference()``).

    Two forward-only programs are planned, with no backward and no optimizer state: the
    one-token decode step (planned first: it runs once per generated token) and the
    prefill of a prompt (planned on first use per prompt length, with every weight and
    cache layout pinned to the decode plan's). The KV cache is static: one
    ``(batch, kv heads, max_context, head dim)`` key and value tensor per layer, allocated
    once as this rank's blocks in the planned layouts, so the decode step is one program
    of fixed shapes. ``batch`` is the example inputs' batch; generation takes any batch up
    to it (``torchalpa/parallel/cached_step.py`` says which models, ``runtime/serving/inference_module.py``
    how a call runs).
    """

    max_context: int | None = None
    """Tokens the cache holds per sequence, prompt and generated ones together; None:
    the model's maximum positions (``max_position_embeddings``, ``max_seq_len``)."""

    def __post_init__(self):
        if self.max_context is not None and (isinstance(self.max_context, bool) or
                                             not isinstance(self.max_context, int)
                                             or self.max_context < 1):
            raise ValueError(f"Inference.max_context must be a positive int or None, got "
                             f"{self.max_context!r}")


def parse_mode(mode) -> Inference | None:
    """``mode=`` as given to the API: None for the training step, else the ``Inference``
    settings; a ValueError names what is accepted."""
    if isinstance(mode, Inference):
        return mode
    if mode == "training":
        return None
    if mode == "inference":
        return Inference()
    raise ValueError(f"mode must be one of {MODES} or a torchalpa.Inference(...), got {mode!r}")
