"""Shared helpers for the HTML report tests: a page parsed into tags and text; headless Chromium."""

from __future__ import annotations

import os
import shutil
from html.parser import HTMLParser

import pytest


class Outline(HTMLParser):
    """Collects tags, attributes and text of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def of(self, tag):
        return [attrs for t, attrs in self.tags if t == tag]


def outline(page: str) -> Outline:
    parser = Outline()
    parser.feed(page)
    parser.close()
    return parser


@pytest.fixture(scope="session")
def parse_html():
    """The page parser: ``parse_html(text).of("section")``, ``.text``, ``.tags``."""
    return outline


@pytest.fixture
def chromium() -> str:
    """The Chromium binary for browser tests. Skipped where it is missing, except under CI
    (``.ci/run`` installs it and sets ``OOMKIT_REQUIRE_CHROMIUM=1``), where missing is a failure."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("OOMKIT_REQUIRE_CHROMIUM") == "1":
            pytest.fail("OOMKIT_REQUIRE_CHROMIUM=1 but chromium is not installed")
        pytest.skip("chromium is not installed")
    return found
