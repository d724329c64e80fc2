"""The front: the serving side of a conductor, put together from its parts.

- ``openai_api.OpenAIApi``: the OpenAI-compatible ``/v1/completions`` and ``/v1/models`` (parse,
  check, render, stream);
- ``tenants.Tenants``: API keys to tenants, tenants to cache namespaces;
- ``dispatch.Dispatcher``: route, prefill, handoff and decode as one state machine with one retry rule;
- ``serving_stats.ServingStats``: every serving figure, metric and the recorded trace;
- ``operator.OperatorApi``: the operator's endpoints, served with the control API.
"""

from __future__ import annotations

from aiohttp import web

from tiercake.config import TiercakeConfig

from ..service import Conductor
from .dispatch import Dispatcher, Job, Route
from .openai_api import OPEN_PATHS, OpenAIApi
from .operator import OperatorApi
from .serving_stats import ServingStats
from .session_book import SessionBook
from .tenants import TENANT_HEADER, Tenants

__all__ = ["OPEN_PATHS", "TENANT_HEADER", "Frontend", "Job", "Route"]


class Frontend:
    def __init__(self, conductor: Conductor, config: TiercakeConfig) -> None:
        self.conductor = conductor
        self.config = config
        self.tenants = Tenants(config.serving)
        self.stats = ServingStats(config.serving)
        self.dispatcher = Dispatcher(conductor, config, self.stats, SessionBook())
        self.openai = OpenAIApi(config, self.tenants, self.dispatcher, self.stats)
        self.operator = OperatorApi(conductor, config, self.tenants, self.dispatcher, self.stats)

    def bind_metrics(self, registry) -> None:
        self.stats.bind_metrics(registry)

    def add_routes(self, app: web.Application, public: bool = True, control: bool = True) -> None:
        """``public``: the OpenAI-compatible API; ``control``: the operator's endpoints, which belong
        with the control API when the two are apart."""
        if public:
            app.add_routes(self.openai.routes())
        if control:
            app.add_routes(self.operator.routes())
            app.on_cleanup.append(lambda _: self.close())

    async def close(self) -> None:
        await self.dispatcher.workers.close()
        self.stats.close()
