"""`make demo`'s summary names the three measures: the data's own test split, the general panel
and the facts kept."""

import io

from cortiq.measure import panel_gap, text_gap
from flows.summary import print_summary


def test_the_summary_reports_each_named_text_with_its_excess_and_gap():
    data = text_gap("test split of the parameter set's data (in-domain)", {"source": 3.0, "student": 3.5, "healed": 3.1})
    parts = {"shakespeare": text_gap("the test split of the retain source shakespeare",
                                     {"source": 4.0, "student": 5.0, "healed": 4.5}),
             "eval": text_gap("held-out text of another source: x.txt", {"source": 2.0, "student": 2.4, "healed": 2.2})}
    panel = panel_gap(parts)
    assert panel["nll"] == {"source": 3.0, "student": 3.7, "healed": 3.35}
    out = io.StringIO()
    print_summary({"params": "demo", "nll": {"source": 3.0, "pruned": 3.5, "healed": 3.1, "panel.shakespeare.source": 4.0},
                   "bytes": {}, "gap": {**panel, "texts": {"data": data, "panel": panel}},
                   "facts": {"pruned": {"part": "held", "facts": 200, "known": 40, "source_known": 100, "kept": 30,
                                        "kept_share": 0.3},
                             "healed": {"part": "held", "facts": 200, "known": 75, "source_known": 100, "kept": 68,
                                        "kept_share": 0.68}}}, out)
    text = out.getvalue()
    assert "panel.shakespeare" not in text  # the table holds the data's own split; the panel has lines of its own
    assert "your data: gap recovered 80.0%, excess NLL over the source +0.1000 (pruned +0.5000), on test split" in text
    assert "general panel: gap recovered 50.0%, excess NLL over the source +0.3500 (pruned +0.7000), on general panel" in text
    assert "  shakespeare: gap recovered 50.0%, excess NLL over the source +0.5000" in text
    assert ("facts kept (the fact probe's held part, 200 facts): pruned 30 of the source's 100 (30 %), healed 68 (68 %)"
            in text)
