"""The intra-op pass: strategies from rules, the cost graph, the ILP (and its presolve), and
the Plan assembled from its solution."""
