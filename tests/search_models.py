"""The small GPT the pipeline-search tests plan: big enough that its stages have a few
hundred nodes and a uniform partition can beat the DP's answer, small enough to solve in
seconds."""

from __future__ import annotations

import torch

import torchalpa.models as zoo
from torchalpa.frontends.torch_export import capture


def small_gpt_graph(num_layers: int = 4):
    """The captured training step (on meta) of a 256-wide GPT, batch 8 x 64."""
    config = zoo.GPTConfig(vocab_size=512, max_seq_len=64, num_layers=num_layers, num_heads=4,
                           hidden=256, dropout=0.0)
    workload = zoo.Workload("gpt", config, 8, 64)
    with torch.device("meta"):
        model, batch = workload.build(), workload.example_inputs()
    return capture(model, batch, workload.loss_fn).graph


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
