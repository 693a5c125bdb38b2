"""Execution: the process group and mesh, parameters as DTensors, the step runner, pipelines,
collectives, optimizer and precision."""
