"""Cluster.preset: a cluster for every GPU and published machine, and the per-axis
bandwidth of its logical meshes from how its devices are linked."""

from __future__ import annotations

import pytest

from torchalpa.core import gpu_specs
from torchalpa.core.cluster import GB, Cluster

LINK = 25 * GB * gpu_specs.NVLINK_EFFICIENCY            # one V100 NVLink 2 link, as reached


@pytest.mark.parametrize("name", sorted(gpu_specs.NODE_PRESETS))
def test_every_preset_builds_from_its_gpu_datasheet(name):
    node = gpu_specs.NODE_PRESETS[name]
    spec = gpu_specs.lookup(node.gpu)
    c = Cluster.preset(name, num_nodes=2)
    assert spec is not None and c.num_devices == 2 * node.devices_per_node
    assert c.memory_per_device == gpu_specs.usable_memory(node.memory)
    assert c.memory_bandwidth == pytest.approx(spec.memory_bandwidth
                                               * gpu_specs.MEMORY_EFFICIENCY)
    peaks = dict(c.peak_flops_by_dtype)
    assert peaks["bfloat16"] == pytest.approx(spec.bf16 * spec.matmul_efficiency)
    assert peaks["float32"] == pytest.approx(spec.fp32 * gpu_specs.FP32_MATMUL_EFFICIENCY)
    # the node's NICs shared by its GPUs, as collectives reach them
    assert c.inter_node_bandwidth == pytest.approx(
        node.network_bandwidth * gpu_specs.NETWORK_EFFICIENCY / node.devices_per_node)
    assert c.multiprocessors == spec.multiprocessors > 0
    assert c.kernel_launch_s > 0 and c.optimizer_tensor_s > 0


def test_the_named_presets_are_preset_clusters():
    assert Cluster.h100(2) == Cluster.preset("h100", 2)
    assert Cluster.h200() == Cluster.preset("h200")
    assert Cluster.a100(1, 4) == Cluster.preset("a100-40", 1, 4)
    assert Cluster.preset("A100_80").memory_per_device == \
        gpu_specs.usable_memory(80 * GB)                                # case and _ forgiven


def test_a_preset_plans_with_what_detect_would_find_on_the_card():
    """An "80GB" card holds 80 GiB and reports about 79.2 of it; ``Cluster.detect`` plans
    with what it reports less the context and its 1.5 GB reserve: about 77.3 GiB, so a
    configuration that ran on the card (76.8 GiB: Llama 2 13B without checkpointing on A100
    80GB) is not refused from the preset. Never more than the card reports."""
    budget = Cluster.preset("a100-80").memory_per_device
    assert 77.0 * 2**30 < budget < 79.2 * 2**30
    assert Cluster.preset("a100-80", memory_per_device=70e9).memory_per_device == 70e9
    for name in ("h100", "h200", "a100-40", "v100-16", "l4", "mi300x"):
        sold = gpu_specs.node_preset(name).memory
        assert Cluster.preset(name).memory_per_device < sold / GB * 2**30 * 0.995


def test_fp16_runs_on_v100_tensor_cores_and_bf16_does_not():
    peaks = dict(Cluster.preset("v100-16").peak_flops_by_dtype)
    assert peaks["float16"] == pytest.approx(125e12 * gpu_specs.MATMUL_EFFICIENCY)
    assert peaks["bfloat16"] < peaks["float16"] / 5


def test_overrides_replace_the_preset_figures():
    c = Cluster.preset("h100", 4, inter_node_bandwidth=10 * GB, memory_per_device=70 * GB,
                       allow_tf32=True)
    assert (c.inter_node_bandwidth, c.memory_per_device) == (10 * GB, 70 * GB)
    assert dict(c.peak_flops_by_dtype)["float32"] == pytest.approx(
        495e12 * gpu_specs.HOPPER_MATMUL_EFFICIENCY)


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown GPU or machine 'h900'.*a100-40.*p3.16xlarge"):
        Cluster.preset("h900")
    with pytest.raises(ValueError, match="hold 8 GPUs; devices_per_node=16"):
        Cluster.preset("p3.16xlarge", devices_per_node=16)


@pytest.mark.parametrize("name, held", [("dgx-a100", 8), ("h100", 8), ("jean-zay-v100", 4),
                                        ("dgx-2", 16)])
def test_a_preset_holds_no_more_gpus_per_node_than_its_machine(name, held):
    """A preset names a node: its switch and its NICs (shared by the node's GPUs) are for
    that many GPUs; more per node were accepted on switched nodes and priced each device
    the NIC share of the named node's GPUs (16 on an 8-GPU node: twice its NICs)."""
    with pytest.raises(ValueError, match=rf"{name}'\): its nodes hold {held} GPUs; "
                                         rf"devices_per_node={held + 1} .*1 to {held}"):
        Cluster.preset(name, devices_per_node=held + 1)
    whole, part = Cluster.preset(name), Cluster.preset(name, devices_per_node=held // 2)
    assert (whole.devices_per_node, part.devices_per_node) == (held, held // 2)


def _bandwidths(cluster: Cluster, shape) -> list[float]:
    return [1 / b for b in cluster.logical_mesh(shape).beta]


def test_hybrid_cube_mesh_axes_get_their_groups_links():
    """p3.16xlarge (Alpa's sanity case): GPUs 0-1 share one link, 2-3 two; 0-2 and 1-3 one
    each; a quad's worst-linked GPU has 4 links to the other three; every GPU 6 in all."""
    quad = Cluster.preset("p3.16xlarge", devices_per_node=4)
    assert _bandwidths(quad, (2, 2)) == pytest.approx([LINK, LINK])   # the slowest pair rules
    assert _bandwidths(quad, (4,)) == pytest.approx([4 * LINK])
    node = Cluster.preset("p3.16xlarge")
    assert _bandwidths(node, (8,)) == pytest.approx([6 * LINK])
    assert node.intra_node_bandwidth == pytest.approx(6 * LINK)
    # GPUs 0 and 4 have two links, 1 and 5 two, ...: pairs 4 apart are well linked, 0 and 5
    # (no link) would go through the host
    assert _bandwidths(node, (2, 4)) == pytest.approx([LINK, 4 * LINK])


def test_a_group_spanning_nodes_moves_all_its_members_nics_at_once():
    c = Cluster.preset("dgx-a100", num_nodes=4)             # 32 A100, 8 x 200 Gb/s per node
    nic = c.inter_node_bandwidth
    assert nic == pytest.approx(200e9 / 8 * gpu_specs.NETWORK_EFFICIENCY)
    assert _bandwidths(c, (32,)) == pytest.approx([8 * nic])        # every GPU's NIC
    assert _bandwidths(c, (4, 8)) == pytest.approx([nic, c.intra_node_bandwidth])
    assert _bandwidths(c, (16, 2)) == pytest.approx([4 * nic, c.intra_node_bandwidth])
    # a single NIC shared by the node (p3.16xlarge's 25 Gb/s) is the same network per node
    p3 = Cluster.preset("p3.16xlarge", num_nodes=2)
    assert _bandwidths(p3, (16,)) == pytest.approx([25e9 / 8 * gpu_specs.NETWORK_EFFICIENCY])


def test_links_are_validated():
    with pytest.raises(ValueError, match="symmetric square matrix"):
        Cluster(devices_per_node=2, intra_node_links=((0, 1), (2, 0)),
                intra_node_link_bandwidth=1e9)
    with pytest.raises(ValueError, match="covers 2 devices but a node has 4"):
        Cluster(devices_per_node=4, intra_node_links=((0, 1), (1, 0)),
                intra_node_link_bandwidth=1e9)
    with pytest.raises(ValueError, match="intra_node_link_bandwidth must be > 0"):
        Cluster(devices_per_node=2, intra_node_links=((0, 1), (1, 0)))


def test_hopper_parts_price_the_sustained_rate_measured_on_a_gh100_and_others_keep_theirs():
    """One rule: every GH100 part (H100 SXM, PCIe, NVL, 96GB; H200) prices its tensor-core
    matmuls at ``HOPPER_MATMUL_EFFICIENCY`` of its datasheet peak (an H200's measured
    sustained rate, ``gpu_specs`` module doc), every other GPU at ``MATMUL_EFFICIENCY``;
    fused attention keeps its own share of the peak either way."""
    hopper = {"H100 SXM", "H100 PCIe", "H100 NVL", "H100 96GB HBM2e", "H200"}
    seen = set()
    for _, spec in gpu_specs.KNOWN_GPUS:
        expected = (gpu_specs.HOPPER_MATMUL_EFFICIENCY if spec.name in hopper
                    else gpu_specs.MATMUL_EFFICIENCY)
        assert spec.matmul_efficiency == expected, spec.name
        peaks = dict(gpu_specs.peaks_by_dtype(spec, allow_tf32=True))
        assert peaks["bfloat16"] == pytest.approx(spec.bf16 * expected)
        sdpa = dict(gpu_specs.op_factors(spec))["sdpa"]
        assert sdpa * peaks["bfloat16"] == pytest.approx(min(spec.bf16 * spec.attention,
                                                             peaks["bfloat16"]))
        seen.add(spec.name)
    assert hopper <= seen
    assert gpu_specs.HOPPER_MATMUL_EFFICIENCY < gpu_specs.MATMUL_EFFICIENCY
