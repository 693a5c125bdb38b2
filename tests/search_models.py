"""The small GPT the pipeline-search tests plan: big enough that its stages have a few
hundred nodes and a uniform partition can beat the DP's answer, small enough to solve in
seconds."""

from __future__ import annotations

import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.frontends.torch_export import capture

GB = 1024 ** 3


def small_gpt_graph(num_layers: int = 4):
    """The captured training step (on meta) of a 256-wide GPT, batch 8 x 64."""
    config = zoo.GPTConfig(vocab_size=512, max_seq_len=64, num_layers=num_layers, num_heads=4,
                           hidden=256, dropout=0.0)
    workload = zoo.Workload("gpt", config, 8, 64)
    with torch.device("meta"):
        model, batch = workload.build(), workload.example_inputs()
    return capture(model, batch, workload.loss_fn).graph


def meta_tiny_gpt():
    """The zoo's tiny GPT (2 layers, batch 8) on the meta device: (model, batch, loss_fn)
    for plan-only tests of AutoParallel and its bounds."""
    workload = zoo.tiny("gpt", batch_size=8, dropout=0.0, num_layers=2)
    with torch.device("meta"):
        model = workload.build()
    return model, workload.example_inputs(device="meta"), workload.loss_fn


def checkpointed_llama13b():
    """LLaMA-2-13B cut to 2 blocks (hidden 5120, 40 heads, seq 4096), batch 8 in 4
    micro-batches, fully checkpointed, as a 2-layer pipeline method plans it: (the
    captured micro-batch step, the method)."""
    from torchalpa.parallel.workflow import capture_variants, micro_batch_examples
    workload = zoo.llama2_13b(batch_size=8).replace(num_layers=2)
    with torch.device("meta"):
        model = workload.build()
    method = torchalpa.PipeshardParallel(
        num_micro_batches=4, layer_option=torchalpa.AutoLayerOption(layer_num=2),
        auto_sharding_option=torchalpa.AutoShardingOption(remat="full"))
    batch = micro_batch_examples(workload.example_inputs(device="meta"), 4)
    graph = capture_variants(model, batch, workload.loss_fn,
                             method.auto_sharding_option)["full"].graph
    return graph, method


def small_cluster(memory_gb: float = 0.05, *, nodes: int = 2,
                  devices: int = 2) -> torchalpa.Cluster:
    """``nodes`` nodes of ``devices`` devices with ``memory_gb`` each (by default 2 x 2
    with little memory, so that the search pipelines the small GPT's layers over several
    stages), links between nodes 10x slower."""
    return torchalpa.Cluster(num_nodes=nodes, devices_per_node=devices,
                             memory_per_device=memory_gb * GB,
                             peak_flops=112e12, memory_bandwidth=900e9,
                             intra_node_bandwidth=100e9, intra_node_latency=1e-6,
                             inter_node_bandwidth=10e9, inter_node_latency=1e-5)


def small_pipeline(num_layers: int = 4, **method) -> torchalpa.PipeshardParallel:
    """The pipeline method these tests search with: 8 micro-batches, ``num_layers``
    layers, HiGHS; ``method``: more PipeshardParallel fields."""
    return torchalpa.PipeshardParallel(
        num_micro_batches=8, layer_option=torchalpa.AutoLayerOption(layer_num=num_layers),
        auto_sharding_option=torchalpa.AutoShardingOption(solver="highs"), **method)


def late_layers_stage():
    """Layers 2..3 of the 4-layer small GPT as one stage's graph, with 4 devices of
    ``small_cluster()`` viewed as (4,): (graph, logical mesh), a stage where the
    simplified ILP's merge costs 4 % (``tests/test_free_followers.py``)."""
    from torchalpa.passes.pipeline_search.layers import assign_layers
    from torchalpa.passes.pipeline_search.subgraph import stage_subgraph
    graph = small_gpt_graph(4)
    cluster = small_cluster()
    method = torchalpa.PipeshardParallel(
        num_micro_batches=8, layer_option=torchalpa.AutoLayerOption(layer_num=4))
    layer = assign_layers(graph, method, cluster.num_devices)
    sub = stage_subgraph(graph, {n: (0 if l >= 2 else 1) for n, l in layer.items()}, 0).graph
    return sub, cluster.logical_mesh((4,))


def exact_stages(graph, layer, cluster, method, cache=None):
    """The pipeline search's exact stage pricing of ``graph`` cut into ``layer``, with its
    own ``SolveCache`` unless given one (``cache`` holds what it solves)."""
    from torchalpa.passes.pipeline_search.exact_stages import ExactStages
    from torchalpa.passes.pipeline_search.layer_cache import SolveCache
    from torchalpa.passes.pipeline_search.layer_costs import LayerCosts
    from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
    from torchalpa.passes.pipeline_search.search_problem import SearchProblem
    from torchalpa.passes.pipeline_search.stage_costs import StageCosts
    cache = SolveCache() if cache is None else cache
    problem = SearchProblem(graph, layer, cluster, method, "global")
    layers = LayerCosts(problem, cache, PricingMemo())
    return ExactStages(problem, StageCosts(problem, layers), cache)


def small_exact_stages(graph, memory_gb: float, cache=None):
    """``exact_stages`` of ``graph`` under ``small_pipeline()``'s layers on
    ``small_cluster(memory_gb)``: the stage tests' usual pricing."""
    from torchalpa.passes.pipeline_search.layers import assign_layers
    cluster, method = small_cluster(memory_gb), small_pipeline()
    layer = assign_layers(graph, method, cluster.num_devices)
    return exact_stages(graph, layer, cluster, method, cache)

def small_stage_search(graph, cluster):
    """The stage search (``StageSearch``, one worker) of the small pipeline
    (``small_pipeline``) of ``graph`` on ``cluster``, its stages priced exactly."""
    from torchalpa.passes.pipeline_search.layers import assign_layers
    from torchalpa.passes.pipeline_search.stage_search import StageSearch
    from torchalpa.passes.pipeline_search.stages import submesh_shapes
    method = small_pipeline()
    exact = exact_stages(graph, assign_layers(graph, method, cluster.num_devices), cluster,
                         method)
    shapes = submesh_shapes(cluster.num_nodes, cluster.devices_per_node)
    return StageSearch(exact.costs, exact, cluster, method.num_micro_batches,
                       method.pipeline_schedule, shapes, workers=1)
