"""Model routing on a node: client-facing model name -> adapter + backend model + options."""

from __future__ import annotations

import logging
from typing import Any

from attrs import frozen

from ..adapters import ADAPTERS, Adapter, BackendError, ExecutionSpec
from ..config import ConfigError, ModelConfig, NodeSettings, structure
from ..wire import RunRequest

log = logging.getLogger("iop_trio.node")


@frozen
class Route:
    model: str
    adapter: Adapter
    backend_model: str
    options: Any


class UnknownModel(LookupError):
    pass


class Router:
    def __init__(self, routes: dict[str, Route], adapters: dict[str, Adapter] | None = None) -> None:
        self._routes = routes
        self._adapters = adapters or {route.adapter.name: route.adapter for route in routes.values()}

    @classmethod
    def from_settings(cls, settings: NodeSettings, source: str = "node config") -> Router:
        """Build the adapters named by ``settings``; config errors name the key."""
        unknown = set(settings.adapters) - set(ADAPTERS)
        if unknown:
            raise ConfigError(f"{source}: adapters: unknown adapter(s) {', '.join(sorted(unknown))}")
        by_adapter: dict[str, list[tuple[ModelConfig, Any]]] = {name: [] for name in settings.adapters}
        for index, model in enumerate(settings.models):
            entry = ADAPTERS.get(model.adapter)
            if entry is None:
                raise ConfigError(
                    f"{source}: models[{index}].adapter: unknown adapter {model.adapter!r} "
                    f"(known: {', '.join(sorted(ADAPTERS))})"
                )
            options: Any = structure(model.options, entry.options_type, f"{source}: models[{index}].options")
            by_adapter.setdefault(model.adapter, []).append((model, options))
        routes: dict[str, Route] = {}
        adapters: dict[str, Adapter] = {}
        for name, models in by_adapter.items():
            entry = ADAPTERS[name]
            config: Any = structure(settings.adapters.get(name, {}), entry.config_type, f"{source}: adapters.{name}")
            adapter = entry.factory(config, {model.name: options for model, options in models})
            adapters[name] = adapter
            for model, options in models:
                if model.name in routes:
                    raise ConfigError(f"{source}: models: {model.name!r} is listed twice")
                routes[model.name] = Route(model.name, adapter, model.backend_model or model.name, options)
        return cls(routes, adapters)

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(self._routes)

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return tuple(sorted(self._adapters))

    async def discover(self) -> None:
        """Add the models that opted-in backends report; configured models keep their settings.
        A backend that cannot be asked right now is logged and skipped, never fatal."""
        for name, adapter in self._adapters.items():
            try:
                reported = await adapter.discover_models()
            except BackendError as exc:
                log.warning("model discovery failed", extra={"adapter": name, "reason": exc.message})
                continue
            for model in reported:
                if model not in self._routes:
                    options = ADAPTERS[name].options_type()
                    self._routes[model] = Route(model, adapter, model, options)
                    log.info("discovered model", extra={"adapter": name, "model": model})

    def resolve(self, request: RunRequest) -> tuple[Route, ExecutionSpec]:
        route = self._routes.get(request.model)
        if route is None:
            raise UnknownModel(request.model)
        spec = ExecutionSpec(
            run_id=request.run_id,
            model=request.model,
            backend_model=route.backend_model,
            kind=request.kind,
            messages=request.messages,
            prompt=request.prompt,
            params=request.params,
            options=route.options,
        )
        return route, spec

    async def aclose(self) -> None:
        for adapter in self._adapters.values():
            await adapter.aclose()
