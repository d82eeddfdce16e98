"""vLLM's acceptance as specpilot reads it (``controller.acceptance``): accepted over
draft tokens summed over windows or requests, drafted nothing apart, the recent figure
and where a fall happened."""

from __future__ import annotations

import pytest

from collectors.observations import RequestObservation, SpecDecodeRequestStats
from controller.acceptance import AcceptanceBook, AcceptanceTrack, Evidence

KEY = ("m", "code", "ngram")


def request(drafts: int, draft_tokens: int, accepted: int, at: float) -> RequestObservation:
    return RequestObservation(
        model="m",
        prompt_tokens=32,
        output_tokens=48,
        ttft_s=0.05,
        mean_itl_s=None,
        generation_time_s=1.0,
        spec=SpecDecodeRequestStats(drafts, draft_tokens, accepted, None),
        workload_class="code",
        arm="ngram:4",
        finished_at=at,
    )


def test_requests_sum_as_vllms_counters_do_and_drafting_nothing_is_apart() -> None:
    book = AcceptanceBook()
    book.note_request(request(10, 40, 30, 1.0))
    book.note_request(request(10, 40, 10, 2.0))
    track = book.track(KEY)
    assert track is not None
    recent = track.recent()
    assert recent is not None
    # 40 of 80, not the mean of the two requests' rates weighted otherwise.
    assert (recent.accepted, recent.draft_tokens, recent.ratio) == (40, 80, 0.5)
    assert recent.tokens_per_verify == pytest.approx(1 + 40 / 20)
    assert not track.drafted_nothing
    book.note_request(request(0, 0, 0, 3.0))  # n-gram found no match
    assert track.drafted_nothing
    assert track.recent() == recent  # no acceptance 0 in it
    assert book.of_arm("m", "code", "ngram:4").drafted_nothing is True
    assert book.of_arm("m", "code", "ngram:2").acceptance is None  # never ran
    assert book.of_arm("m", "code", "off").acceptance is None
    book.note_request(request(5, 20, 20, 4.0))
    assert not track.drafted_nothing


def test_recent_is_the_newest_evidence_worth_500_draft_tokens() -> None:
    track = AcceptanceTrack()
    for i in range(6):
        track.add(
            Evidence(i, i + 1.0, "ngram:4", accepted=50.0 * (i % 2), draft_tokens=200.0, drafts=50)
        )
    recent = track.recent()
    assert recent is not None
    assert (recent.since, recent.until, recent.draft_tokens) == (3.0, 6.0, 600.0)
    assert recent.accepted == 100.0  # windows 3 and 5
    after = track.recent(after=5.0)
    assert after is not None and after.draft_tokens == 200.0  # what came after only


def test_the_fall_is_split_where_acceptance_fell() -> None:
    track = AcceptanceTrack()
    rates = [0.9, 0.85, 0.88, 0.92, 0.86, 0.2, 0.15, 0.25]
    for i, rate in enumerate(rates):
        track.add(Evidence(i, i + 1.0, "ngram:4", rate * 100, 100.0, 25.0))
    fall = track.fall()
    assert fall is not None
    before, after = fall
    assert (before.until, after.since) == (5.0, 5.0)
    assert before.ratio == pytest.approx(sum(rates[:5]) / 5)
    assert after.ratio == pytest.approx(sum(rates[5:]) / 3)
    rising = AcceptanceTrack()
    for i, rate in enumerate([0.2, 0.3, 0.8, 0.9]):
        rising.add(Evidence(i, i + 1.0, "ngram:4", rate * 100, 100.0, 25.0))
    assert rising.fall() is None
