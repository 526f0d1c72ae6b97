"""Shared helpers for the HTML report tests: a page parsed into tags and text."""

from __future__ import annotations

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
