"""The report's spike section: each step a spike flag marked, its loss and gradient norm, and the documents
behind it when `lmforge report --spikes` replayed and scored the step (`lmforge.eval.step_documents`). Everything
shown is escaped: document text is data, never markup."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lmforge.viz.runs import Run

FLAGS = {"loss/spike": "loss", "optim/grad_norm_spike": "gradient norm"}
"""The spike flag metrics and what each flags."""


@dataclass(frozen=True)
class Spike:
    """One flagged step."""

    step: int
    """The step."""
    flags: list[str]
    """What spiked: `loss`, `gradient norm`."""
    loss: float | None
    """The step's `loss/mean`."""
    grad_norm: float | None
    """The step's `optim/grad_norm`."""
    documents: list[dict[str, Any]] = field(default_factory=list)
    """The step's documents of highest summed loss (`lmforge.eval.step_documents.top_documents`), if replayed."""
    note: str = ""
    """How the documents were found (the checkpoint that scored them), or why there are none."""


def flagged_steps(run: Run) -> list[Spike]:
    """Every logged step with a spike flag set, in step order (without documents)."""
    spikes = []
    for record in sorted(run.records, key=lambda r: r["step"]):
        flags = [what for name, what in FLAGS.items() if (record.get(name) or 0) > 0]
        if flags:
            spikes.append(Spike(record["step"], flags, record.get("loss/mean"), record.get("optim/grad_norm")))
    return spikes


def _number(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def spikes_html(spikes: Sequence[Spike], replayed: bool) -> str:
    """The section: a table of the flagged steps, then each step's documents (or a hint how to list them)."""
    rows = "".join(
        f"<tr><td>{s.step}</td><td>{html.escape(', '.join(s.flags))}</td><td>{_number(s.loss, '.4f')}</td>"
        f"<td>{_number(s.grad_norm, '.3g')}</td></tr>"
        for s in spikes
    )
    out = [f'<div id="spikes"><h2>Spikes ({len(spikes)} flagged step{"" if len(spikes) == 1 else "s"})</h2>',
           f"<table><tr><td>step</td><td>flag</td><td>loss</td><td>grad norm</td></tr>{rows}</table>"]  # fmt: skip
    if not replayed:
        out.append('<p class="note">The documents behind each: <code>lmforge report RUN --spikes</code> replays and '
                   "scores the flagged steps (or <code>lmforge replay RUN --step N --score</code>).</p>")  # fmt: skip
    for s in spikes if replayed else ():
        out.append(f'<div class="spike" id="spike-{s.step}"><h3>step {s.step}</h3>')
        if s.note:
            out.append(f'<p class="note">{html.escape(s.note)}</p>')
        if s.documents:
            out.append("<table><tr><td>loss</td><td>mean</td><td>tokens</td><td>document</td><td>text</td></tr>")
            for d in s.documents:
                where = d["where"] + (f" [{d['source']}]" if d.get("source") else "")
                out.append(
                    f"<tr><td>{d['loss_sum']:.2f}</td><td>{d['loss_mean']:.3f}</td><td>{d['loss_tokens']}</td>"
                    f'<td>{html.escape(where)}</td><td class="snippet">{html.escape(d["text"])}</td></tr>'
                )
            out.append("</table>")
        out.append("</div>")
    out.append("</div>")
    return "".join(out)
