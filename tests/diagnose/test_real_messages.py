"""The classifier on real OOM messages from public issues (issue 14 item 5)."""

from __future__ import annotations

from collections import Counter

import pytest
from cases.real_messages import CASES

from oomkit.diagnose.diagnosis import diagnose_oom_text
from oomkit.diagnose.oom_text import parse_oom_text


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.url.removeprefix("https://github.com/"))
def test_real_message_is_classified_as_labelled(case):
    """Each real message is parsed and its main cause is the one its own numbers show."""
    diagnosis = diagnose_oom_text(parse_oom_text(case.text))
    assert diagnosis.cause == case.expected


def test_the_set_spans_every_wording_and_cause():
    """At least 60 messages, from <= 1.4 to 2.2+, with every cause a message can show."""
    assert len(CASES) >= 60
    assert len({case.url for case in CASES}) == len(CASES)
    versions = Counter(parse_oom_text(case.text).torch_versions for case in CASES)
    assert {"<=1.4", "1.5-2.0", "2.1", ">=2.2"} <= set(versions)
    assert any(parse_oom_text(c.text).variant == "cuda_malloc_async" for c in CASES)
    causes = Counter(case.expected for case in CASES)
    assert set(causes) == {"shortage", "fragmentation", "outside_pytorch", "request_exceeds_device"}


def test_context_alone_is_never_the_cause_on_real_messages():
    """No real message whose outside memory fits a context and its libraries names it a cause."""
    for case in CASES:
        parsed = parse_oom_text(case.text)
        diagnosis = diagnose_oom_text(parsed)
        outside = parsed.outside_allocator_bytes
        if outside is not None and outside <= 1200 * 2**20 and not parsed.processes:
            assert "outside_pytorch" not in [f.cause for f in diagnosis.causes], case.url
