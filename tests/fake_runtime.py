"""Shared by the HTTP tests that script a runtime: what the app needs of a TokenizerManager besides
`generate` (a healthy runtime that ignores aborts and has no stats), and an OpenAI client that
talks to the app in-process."""

from __future__ import annotations

import openai
from fastapi.testclient import TestClient
from radixserve.config import Config
from radixserve.server.app import create_app


class HealthyRuntime:
    """Base of the scripted TokenizerManagers: always healthy, aborts ignored, no stats."""

    def abort(self, rid: str) -> None:
        pass

    def is_healthy(self) -> bool:
        return True

    async def get_stats(self) -> dict:
        return {}


def openai_client(tm, **server) -> openai.OpenAI:
    """The official client against `create_app(tm)` with `server.*` settings, no network."""
    http = TestClient(create_app(tm, Config.build({"server": server})))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
