"""The fusionstitching command."""

from __future__ import annotations

import json

from fusionstitching.cli import main
from fusionstitching.graph.graph import Graph


def test_graph_command_prints_categories_and_writes_json(tmp_path, capsys):
    path = tmp_path / "ln.json"
    assert main(["graph", "layernorm", "--train", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "layernorm_train forward: 28 nodes, fusable fraction 1.00" in out
    assert "reduction" in out and "library ops: none" in out
    forward = Graph.from_json(path.read_text())
    backward = Graph.from_json((tmp_path / "ln.backward.json").read_text())
    assert len(forward.parameters) == 3 and len(backward.outputs) == 3
    assert json.loads(path.read_text())["format"] == "fusionstitching.graph"


def test_graph_command_rejects_unknown_workloads(capsys):
    assert main(["graph", "no_such_workload"]) == 2
    assert "unknown workload 'no_such_workload'" in capsys.readouterr().err
