"""What a pool runs is what vLLM shows, not what was pushed (``controller.running``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.fleet import Fleet
from controller.ports import InstanceSeen
from controller.running import PushState, RunningConfigs
from controller.settings import Settings
from tests.controller.conftest import make_settings

URL = "http://127.0.0.1:9"
NGRAM4 = {"method": "ngram", "num_speculative_tokens": 4}
NGRAM2 = {"method": "ngram", "num_speculative_tokens": 2}
TINY2 = {"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def running(
    tmp_path: Path, clock: Clock, config: dict[str, object] | None = None
) -> RunningConfigs:
    """Pool ``p`` of ``make_settings`` started with ``config`` (None: off)."""
    data = make_settings(tmp_path).model_dump(mode="json", by_alias=True, exclude_unset=True)
    data["fleet"]["pools"]["p"]["speculative_config"] = config or {"method": "off"}
    return RunningConfigs(Fleet(Settings(**data)), confirm_within_s=60.0, clock=clock)


def seen(positions: int, at: float, *, restarted: bool = False) -> InstanceSeen:
    return InstanceSeen("p", URL, positions, restarted, at)


def test_a_push_nothing_applies_is_not_applied_after_the_deadline(
    tmp_path: Path, clock: Clock
) -> None:
    runs = running(tmp_path, clock, NGRAM4)
    runs.see(seen(4, 99.0))
    push = runs.pushed("p", NGRAM2, 100.0)
    assert push.state is PushState.PENDING
    clock.now = 130.0
    runs.see(seen(4, 130.0))  # vLLM still runs γ = 4
    assert runs.settle() == []
    assert runs.arm("p") == "ngram:4"
    clock.now = 160.0
    runs.see(seen(4, 160.0))
    [(pool, settled)] = runs.settle()
    assert (pool, settled.state, settled.arm) == ("p", PushState.NOT_APPLIED, "ngram:2")
    view = runs.view("p")
    assert (view.running, view.pushed, view.state) == ("ngram:4", "ngram:2", "not_applied")
    assert runs.believed("p") == NGRAM4


def test_a_push_off_while_vllm_keeps_drafting_keeps_the_method(
    tmp_path: Path, clock: Clock
) -> None:
    runs = running(tmp_path, clock, NGRAM4)
    runs.pushed("p", None, 100.0)
    runs.see(seen(4, 110.0))
    assert runs.arm("p") == "ngram:4"  # never "off": its page has per-position series
    assert runs.settle() == []


def test_a_gamma_change_is_confirmed_when_the_instance_shows_it(
    tmp_path: Path, clock: Clock
) -> None:
    runs = running(tmp_path, clock, NGRAM4)
    runs.see(seen(4, 99.0))
    runs.pushed("p", NGRAM2, 100.0)
    runs.see(seen(2, 120.0, restarted=True))
    [(_, push)] = runs.settle()
    assert push.state is PushState.CONFIRMED
    assert runs.believed("p") == NGRAM2 and runs.arm("p") == "ngram:2"


def test_a_new_method_needs_a_restart_after_the_push(tmp_path: Path, clock: Clock) -> None:
    runs = running(tmp_path, clock, NGRAM2)
    runs.see(seen(2, 99.0))
    runs.pushed("p", TINY2, 100.0)
    runs.see(seen(2, 110.0))  # same γ, no restart: still the n-gram engine
    assert runs.settle() == []
    assert runs.arm("p") == "ngram:2"
    runs.see(seen(2, 120.0, restarted=True))
    [(_, push)] = runs.settle()
    assert push.state is PushState.CONFIRMED and runs.arm("p") == "tiny:2"


def test_a_push_of_what_runs_is_confirmed_at_once(tmp_path: Path, clock: Clock) -> None:
    runs = running(tmp_path, clock, NGRAM4)
    runs.see(seen(4, 99.0))
    assert runs.pushed("p", NGRAM4, 100.0).state is PushState.CONFIRMED


def test_off_shows_as_no_series_and_a_speculating_off_pool_as_unknown(
    tmp_path: Path, clock: Clock
) -> None:
    runs = running(tmp_path, clock)  # the settings say it runs off
    assert runs.arm("p") == "off"
    runs.see(seen(3, 100.0))  # yet its page shows three positions
    assert runs.arm("p") == "unknown:3"
    runs.see(seen(0, 110.0))
    assert runs.arm("p") == "off"


def test_a_read_back_confirms_the_method_without_a_restart(tmp_path: Path, clock: Clock) -> None:
    runs = running(tmp_path, clock, NGRAM2)
    started: dict[str, object] = {"config": NGRAM2}
    runs.read_back["p"] = lambda: started["config"]  # type: ignore[return-value]
    runs.pushed("p", TINY2, 100.0)
    runs.see(seen(2, 110.0))
    assert runs.settle() == []  # the actuator has not started it
    started["config"] = TINY2
    runs.see(seen(2, 120.0))
    [(_, push)] = runs.settle()
    assert push.state is PushState.CONFIRMED


def test_a_gamma_table_vllm_cannot_show_needs_a_restart(tmp_path: Path, clock: Clock) -> None:
    """Off at batch 1 and γ = 4 above: the page shows four positions either way, so only
    a restart after the push says the table runs."""
    runs = running(tmp_path, clock, NGRAM4)
    runs.see(seen(4, 99.0))
    table = {**NGRAM4, "num_speculative_tokens_per_batch_size": [[1, 1, 0], [2, 256, 4]]}
    assert runs.pushed("p", table, 100.0).state is PushState.PENDING
    runs.see(seen(4, 110.0))
    assert runs.settle() == []
    assert runs.arm("p", "1-3") == "ngram:4"  # the table is not believed
    runs.see(seen(4, 120.0, restarted=True))
    [(_, push)] = runs.settle()
    assert push.state is PushState.CONFIRMED
    assert runs.arm("p", "1-3") == "off" and runs.arm("p", "4+") == "ngram:4"


def test_the_same_run_written_with_other_keys_is_confirmed_at_once(
    tmp_path: Path, clock: Clock
) -> None:
    runs = running(tmp_path, clock, {**NGRAM4, "prompt_lookup_max": 4})
    runs.see(seen(4, 99.0))
    assert runs.pushed("p", NGRAM4, 100.0).state is PushState.CONFIRMED
