"""Planning that takes more than a couple of seconds shows a bar on stderr (issue 41: `placement plan tiny-dit
--height 512 --width 512` printed nothing for 115 s): which call is being estimated, how many block calls have run.
Silent when stderr is not a terminal or with progress=False, and when planning is quicker than the delay (the
delay is set to 0 here to see the bar without waiting: no verdict depends on the machine's speed)."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from pipelines import Pipeline
from pipelines.loading import planning_progress
from placement.activations import memo as estimate_memo
from placement.activations.estimate import estimate_call
from placement.activations.progress import progress_reported

from pipeline_fixtures import save_preset

CALL = {"height": 64, "width": 64}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Listener:
    def __init__(self) -> None:
        self.events: list[str] = []

    def estimating(self, label: str) -> None:
        self.events.append(label)

    def advanced(self) -> None:
        self.events.append("block")


def test_an_estimate_tells_the_listener_what_it_estimates_and_each_block_call():
    blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()) for _ in range(3)])
    listener = Listener()
    with progress_reported(listener):
        estimate_call(blocks.to("meta"), (torch.empty(2, 4, device="meta"),))
    assert listener.events == ["Sequential.forward", "block", "block", "block"]
    estimate_call(blocks, (torch.empty(3, 4, device="meta"),))  # outside: nobody told, nothing raised
    assert len(listener.events) == 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_preset(tmp_path_factory.mktemp("progress") / "tiny-flux")[0]


def test_planning_on_a_terminal_shows_the_bar_past_its_delay(folder, monkeypatch):
    # Estimated afresh: an earlier test of this process may have estimated the same call, which the estimate cache
    # then answers without an estimate to show.
    monkeypatch.setenv(estimate_memo.CACHE_ENV, "0")
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(planning_progress, "PLANNING_BAR_DELAY", 0.0)
    Pipeline.plan_placement(folder, max_memory={0: "2GiB"}, call=CALL)
    shown = terminal.getvalue()
    assert "Planning: estimating" in shown and "block calls" in shown


@pytest.mark.parametrize("where", ["terminal, progress=False", "not a terminal"])
def test_planning_is_silent_off_a_terminal_or_when_asked(folder, monkeypatch, where):
    stream = Terminal() if where.startswith("terminal") else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(planning_progress, "PLANNING_BAR_DELAY", 0.0)
    Pipeline.plan_placement(folder, max_memory={0: "2GiB"}, call=CALL,
                                       progress=not where.startswith("terminal"))
    assert stream.getvalue() == ""
