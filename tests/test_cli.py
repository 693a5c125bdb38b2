"""torchalpa's command line: ``torchalpa coverage``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import MLP, WithCustomOp

from torchalpa.cli.commands import main


def mlp_step():
    """A ``module:callable`` model: (model, example_inputs, loss_fn), built on meta."""
    x, y = torch.empty(4, 8), torch.empty(4, 8)
    return MLP(8, 2), (x, y), F.mse_loss


def custom_op_step():
    x, y = torch.empty(4, 8), torch.empty(4, 8)
    return WithCustomOp(8), (x, y), F.mse_loss


def value_reading_step():
    """A constructor that computes a width with tensors and reads it back (as
    torchvision's RegNet does): it cannot run on the meta device."""
    width = int(torch.arange(4).sum().item())                # 6
    x, y = torch.empty(4, 8), torch.empty(4, 8)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Linear(width, 8)), (x, y), \
        F.mse_loss


def test_coverage_builds_on_cpu_a_model_whose_constructor_reads_values(capsys):
    assert main(["coverage", "--model", "test_cli:value_reading_step"]) == 0
    assert "rule  aten.mm.default" in capsys.readouterr().out


def test_coverage_lists_the_ops_of_a_training_step(capsys):
    assert main(["coverage", "--model", "test_cli:mlp_step"]) == 0
    out = capsys.readouterr().out
    assert "rule  aten.mm.default" in out
    assert "rule  aten.relu.default" in out
    assert "ops without a sharding rule (run replicated): none" in out


def test_coverage_names_ops_without_a_rule(capsys):
    assert main(["coverage", "--model", "test_cli:custom_op_step"]) == 1
    out = capsys.readouterr().out
    assert "----  torchalpa_test.scaled_tanh.default" in out
    assert "torchalpa_test.scaled_tanh.default: test_cli:custom_op_step" in out


def test_coverage_of_a_zoo_model(capsys):
    pytest.importorskip("torchalpa.models")
    assert main(["coverage", "--model", "llama"]) == 0
    assert "rule  torchalpa.sdpa.default" in capsys.readouterr().out


def test_coverage_reports_models_it_cannot_load(capsys):
    assert main(["coverage", "--model", "no_such_module:step"]) == 1
    assert "no_such_module:step: could not capture" in capsys.readouterr().out


def test_a_command_is_required():
    with pytest.raises(SystemExit):
        main([])


def test_a_model_from_a_file_path_and_bad_callables_are_named(capsys, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch, torch.nn as nn, torch.nn.functional as F\n"
                      "def make():\n"
                      "    return nn.Linear(4, 4), (torch.empty(2, 4), torch.empty(2, 4)), F.mse_loss\n")
    assert main(["coverage", "--model", f"{script}:make"]) == 0
    assert main(["coverage", "--model", "os:getcwd", "--model", f"{tmp_path}/none.py:make",
                 "--model", f"{script}:missing"]) == 1
    out = capsys.readouterr().out
    assert "os:getcwd returned str" in out and "must return a torchalpa.models.Workload" in out
    assert f"no file {tmp_path}/none.py" in out
    assert "has no callable 'missing'" in out


def test_coverage_of_suite_cases_prints_the_table(capsys):
    """``--hf`` runs every case of torchalpa.suite.cases; ``suite:NAME`` picks some. Swin
    captures (its relative position bias goes through the device-neutral attention op) and,
    its pooling's strided views read as reshapes, has a rule for every op; an op without
    one is named in its row and fails the command."""
    pytest.importorskip("transformers")
    assert main(["coverage", "--model", "suite:checkpoint", "--model", "suite:swin"]) == 0
    out = capsys.readouterr().out
    rows = out.split("model                  family")[1].splitlines()
    assert rows[1].split()[:3] == ["checkpoint", "idiom", "captures"]
    assert rows[2].split()[:3] == ["swin", "vision", "captures"]
    assert "replicated" not in rows[2]
    assert "2 of 2 capture" in out
    assert main(["coverage", "--model", "suite:checkpoint", "--model",
                 "test_cli:custom_op_step"]) == 1


# -- plan / show / explain / estimate / cache / --version -----------------------------------

def test_plan_show_explain(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHALPA_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "plan.json"
    assert main(["plan", "test_cli:mlp_step", "--cluster", "cpu:2", "--mesh", "2",
                 "--out", str(out)]) == 0
    assert "parameters:" in capsys.readouterr().out and out.exists()
    assert main(["show", str(out), "--module", "net.0*", "--detail", "full"]) == 0
    shown = capsys.readouterr().out
    assert "net.0.weight" in shown and "net.2.weight" not in shown
    assert main(["explain", str(out), "net.0.weight"]) == 0
    assert "net.0.weight: shape [8, 8]" in capsys.readouterr().out
    assert main(["explain", str(out), "net.0.wieght"]) == 2
    assert "did you mean 'net.0.weight'" in capsys.readouterr().err
    assert main(["cache", "ls"]) == 0
    assert "1 plan(s)" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    assert "removed 1 cached plan(s)" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["shard", "data", "zero2", "zero3", "pipeshard", "auto"])
def test_plan_takes_every_preset_method_by_name(name, tmp_path, capsys, monkeypatch):
    import torchalpa
    from torchalpa.cli.commands import method_of
    expected = {"shard": torchalpa.ShardParallel, "data": torchalpa.DataParallel,
                "zero2": torchalpa.Zero2Parallel, "zero3": torchalpa.Zero3Parallel,
                "pipeshard": torchalpa.PipeshardParallel, "auto": type(None)}[name]
    assert type(method_of(name, None)) is expected
    if name in ("shard", "zero3"):       # two planned for real (each solve takes seconds)
        monkeypatch.setenv("TORCHALPA_CACHE_DIR", str(tmp_path / "cache"))
        out = tmp_path / "plan.json"
        assert main(["plan", "test_cli:mlp_step", "--cluster", "cpu:2", "--method", name,
                     "--out", str(out)]) == 0
        assert torchalpa.Plan.load(out).method["name"] == expected.__name__
        capsys.readouterr()
    if name == "pipeshard":
        assert main(["plan", "test_cli:mlp_step", "--method", name, "--mesh", "2",
                     "--out", str(tmp_path / "p.json")]) == 2
        assert "drop one of the two" in capsys.readouterr().err


def test_a_batch_the_mesh_does_not_divide_is_refused_in_the_command_lines_terms(
        tmp_path, capsys, monkeypatch):
    """The planner's remedy names ``ShardParallel()``; the command line's names its flags."""
    monkeypatch.setenv("TORCHALPA_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["plan", "test_cli:mlp_step", "--cluster", "cpu:3", "--method", "data",
                 "--out", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert "the batch dim (4) must divide by 3 devices" in err
    assert "--method shard" in err and "--batch" in err and "ShardParallel" not in err


def test_plan_into_a_missing_folder_is_refused_before_planning(tmp_path, capsys, monkeypatch):
    """It planned first (minutes on a large model), then failed writing the file."""
    from torchalpa.cli import commands

    def planned(*args, **kwargs):
        raise AssertionError("the model was loaded before the output folder was checked")
    monkeypatch.setattr(commands, "load_workload", planned)
    for option in ("--out", "--html", "--trace"):
        files = {"--out": str(tmp_path / "plan.json"), option: str(tmp_path / "no" / "f")}
        argv = ["plan", "test_cli:mlp_step", "--cluster", "cpu:2"]
        assert main(argv + [x for kv in files.items() for x in kv]) == 2
        err = capsys.readouterr().err
        assert f"{option} {tmp_path / 'no' / 'f'}: the folder {tmp_path / 'no'} does not " \
            "exist" in err


def test_estimate_fits_or_names_the_devices_needed(capsys):
    assert main(["estimate", "test_cli:mlp_step", "--cluster", "h100:1x8"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("fits:")
    # an MLP of 2 layers of 8x8 cannot need more than one H100; a wrong cluster is named
    assert main(["estimate", "test_cli:mlp_step", "--cluster", "tpu:2x2"]) == 2
    assert "unknown cluster kind 'tpu'" in capsys.readouterr().err


def test_more_gpus_per_node_than_the_machine_holds_is_refused_in_flags(capsys):
    assert main(["estimate", "test_cli:mlp_step", "--cluster", "dgx-a100:2x16"]) == 2
    err = capsys.readouterr().err
    assert "--cluster dgx-a100:2x16: a dgx-a100 node holds 8 GPUs" in err
    assert "dgx-a100:2xD with D from 1 to 8" in err and "Cluster.preset" not in err


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("torchalpa ")


_NO_TORCH = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("cli_alone", sys.argv[1])
cli = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cli)
cli.build_parser().format_help()
assert "torch" not in sys.modules, "the CLI imported torch to build its parser"
"""


def test_help_imports_no_torch():
    """``--help`` and ``--version`` must not pay for importing torch (seconds)."""
    import subprocess
    import sys

    import torchalpa.cli.commands as cli
    subprocess.run([sys.executable, "-c", _NO_TORCH, cli.__file__], check=True)


def test_console_script_imports_no_torch():
    import subprocess
    import sys
    code = ("import sys, torchalpa.cli.commands as c; c.build_parser().format_help(); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- real jobs by name: zoo sizes, HuggingFace configs, batch and sequence ----------------

def test_real_sizes_are_named_with_their_parameter_counts(capsys):
    """The zoo's real sizes build on meta with the published parameter counts."""
    assert main(["estimate", "llama3_8b", "--cluster", "h100:1x8"]) == 0
    assert capsys.readouterr().out.startswith("llama3_8b: 8,030.3 M parameters")
    assert main(["estimate", "alpa_moe_10b", "--cluster", "h100:1x8"]) == 0
    assert "9,915.5 M parameters" in capsys.readouterr().out


def test_a_huggingface_causal_lm_from_its_model_type_or_a_config_json(capsys, tmp_path):
    import json
    assert main(["estimate", "hf:mistral", "--cluster", "h100:1x8"]) == 0
    assert "7,241.7 M parameters" in capsys.readouterr().out
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 1000, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for source in (str(tmp_path), str(tmp_path / "config.json")):
        assert main(["estimate", f"hf:{source}", "--cluster", "cpu:2"]) == 0
        assert "0.2 M parameters" in capsys.readouterr().out   # 2 x 64 x 1000 + 2 layers


def test_batch_and_seq_change_the_captured_step(tmp_path, capsys):
    from torchalpa.cli.workloads import load_workload
    with torch.device("meta"):
        _, (x, _), _ = load_workload("llama", batch=3, seq=5)()
        _, (ids, labels), _ = load_workload("hf:gpt2", batch=2, seq=7)()
    assert tuple(x.shape) == (3, 5) and tuple(ids.shape) == tuple(labels.shape) == (2, 7)
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt", "--batch", "4", "--seq", "8", "--cluster", "cpu:2",
                 "--mixed-precision", "bf16", "--out", str(out)]) == 0
    import torchalpa
    plan = torchalpa.load_plan(str(out))
    assert plan.method["mixed_precision"] == "bfloat16"


@pytest.mark.parametrize("argv, says", [
    (["estimate", "llama3_80b"], "unknown model 'llama3_80b'; tiny families"),
    (["estimate", "hf:nosuch"], "knows no model_type 'nosuch'"),
    (["estimate", "hf:/nowhere/config.json"], "no HuggingFace config at /nowhere/config.json"),
    (["estimate", "llama", "--batch", "0"], "--batch must be a positive integer, got 0"),
    (["estimate", "test_cli:mlp_step", "--seq", "8"], "--batch and --seq change zoo"),
])
def test_bad_model_arguments_are_one_line_naming_what_is_accepted(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


_WORKLOAD = """
import torch, torch.nn as nn, torch.nn.functional as F

def make():
    from workload_parts import WIDTH      # a neighbour, imported when called
    return (nn.Linear(WIDTH, WIDTH), (torch.empty(2, WIDTH), torch.empty(2, WIDTH)),
            F.mse_loss)
"""


def test_python_dash_m_and_the_console_script_find_a_module_in_the_current_folder(tmp_path):
    """``python -m torchalpa`` is the ``torchalpa`` command; both find ``module:callable``
    in the folder they run from (the console script's own folder is on its sys.path
    instead: torchalpa.cli.workloads.import_by_name adds the current one)."""
    import os
    import subprocess
    import sys
    (tmp_path / "my_workload.py").write_text(_WORKLOAD)
    (tmp_path / "workload_parts.py").write_text("WIDTH = 4\n")
    script = os.path.join(os.path.dirname(sys.executable), "torchalpa")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for command in ([sys.executable, "-m", "torchalpa"], [script]):
        run = subprocess.run([*command, "coverage", "--model", "my_workload:make"],
                             capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
        assert run.returncode == 0, f"{command}: {run.stdout[-2000:]}{run.stderr[-2000:]}"
        assert "my_workload:make: " in run.stdout and "rule  aten.mm.default" in run.stdout
    run = subprocess.run([script, "coverage", "--model", "not_here:make"], capture_output=True,
                         text=True, cwd=tmp_path, env=env, timeout=300)
    assert run.returncode == 1
    assert f"No module named 'not_here' (looked in the current folder {tmp_path}" in run.stdout
    run = subprocess.run([sys.executable, "-m", "torchalpa", "--version"], capture_output=True,
                         text=True, cwd=tmp_path, env=env, timeout=60)
    assert run.returncode == 0 and run.stdout.startswith("torchalpa ")


def test_every_gpu_preset_is_a_cluster_with_nodes_devices_and_overrides():
    from torchalpa.cli.workloads import parse_cluster
    from torchalpa.core.gpu_specs import NODE_PRESETS
    for kind in NODE_PRESETS:
        cluster = parse_cluster(f"{kind}:2x4")
        assert (cluster.num_nodes, cluster.devices_per_node) == (2, 4)
    h200 = parse_cluster("h200:2x8", inter_node_gbps=25, memory_gib=100)
    assert h200.inter_node_bandwidth == 25e9 and h200.memory_per_device == 100 * 2 ** 30
    assert parse_cluster("h200:2x8").memory_per_device > parse_cluster("h100:2x8").memory_per_device
    with pytest.raises(ValueError, match="--memory must be a positive number"):
        parse_cluster("h100:1x8", memory_gib=0)
