"""Plans as pictures: a self-contained HTML page and a Chrome trace."""

import json
from html.parser import HTMLParser

from test_report import synthetic_plan

from torchalpa.core.plan import PipelinePlan, StagePlan

VOID = {"meta", "br", "img", "input", "hr", "link"}
SVG_LEAVES = {"rect", "line"}


class _Checker(HTMLParser):
    """Collects text and checks that every element is closed in order."""

    def __init__(self):
        super().__init__()
        self.stack, self.text, self.tags, self.errors = [], [], set(), []

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        if tag not in VOID:
            self.stack.append(tag)
        for k, v in attrs:
            if k in ("src", "href") or (v and "http" in v):
                self.errors.append(f"external reference {k}={v}")

    def handle_startendtag(self, tag, attrs):
        self.tags.add(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
        else:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def parse(page: str) -> _Checker:
    checker = _Checker()
    checker.feed(page)
    checker.close()
    assert not checker.errors and not checker.stack, (checker.errors, checker.stack)
    return checker


def test_html_is_self_contained_and_lists_the_plan(tmp_path):
    plan = synthetic_plan(6, odd_layer=2)
    path = tmp_path / "plan.html"
    plan.to_html(path)
    page = path.read_text()
    checker = parse(page)
    assert "script" not in checker.tags and "svg" in checker.tags
    text = " ".join(checker.text)
    assert "layers.*.mlp.up_proj.weight" in text           # a row of the layer grid
    assert "lm_head.weight" in text                         # a parameter outside the layers
    assert "layers.{0..5}.mlp.down_proj" in text            # collectives by module
    assert "grad layers.3.mlp.up_proj.weight" in text       # every collective, by name
    assert f"all {len(plan.collectives)} collectives" in text
    # layer 2 is planned differently: its cell has the other placement's color
    assert 'title="layers.2.mlp.up_proj.weight 256x64 RS(1)"' in page


def test_pipeline_html_and_trace_show_the_timeline(tmp_path):
    a, b = synthetic_plan(2), synthetic_plan(2)
    timeline = [[("F", 0, 0.0, 0.01), ("F", 1, 0.01, 0.02), ("B", 0, 0.03, 0.05)],
                [("F", 0, 0.01, 0.02), ("B", 0, 0.02, 0.03)]]
    plan = PipelinePlan(mesh_shape=(2, 8), stages=(
        StagePlan(0, (0,), (1, 8), tuple(range(8)), a),
        StagePlan(1, (1,), (1, 8), tuple(range(8, 16)), b)), transfers=(), node_stage={},
        num_micro_batches=2, schedule="1f1b",
        estimates={"step_time_s": 0.05, "timeline": timeline})
    plan.to_html(tmp_path / "p.html")
    text = " ".join(parse((tmp_path / "p.html").read_text()).text)
    assert "estimated pipeline timeline" in text and "stage 1" in text
    plan.to_chrome_trace(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 5 and {e["pid"] for e in spans} == {0, 1}
    assert max(e["ts"] + e["dur"] for e in spans) == 0.05e6


def test_intra_op_trace_spends_the_estimates(tmp_path):
    plan = synthetic_plan(3)
    plan = type(plan)(**{**plan.__dict__, "estimates": {"compute_s": 0.03,
                                                        "communication_s": 0.012,
                                                        "step_time_s": 0.042}})
    plan.to_chrome_trace(tmp_path / "t.json")
    spans = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]
             if e["ph"] == "X"]
    compute = sum(e["dur"] for e in spans if e["tid"] == 0)
    comm = sum(e["dur"] for e in spans if e["tid"] > 0)
    assert abs(compute - 0.03e6) < 1e-3 and abs(comm - 0.012e6) < 1e-3
    assert len(spans) == 2 + len(plan.collectives)
