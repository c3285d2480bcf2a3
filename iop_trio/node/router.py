"""Model routing on a node: client-facing model name -> adapter + backend model + options."""

from __future__ import annotations

from typing import Any

from attrs import frozen

from ..adapters import ADAPTERS, Adapter, ExecutionSpec
from ..config import ConfigError, ModelConfig, NodeSettings, structure
from ..wire import RunRequest


@frozen
class Route:
    model: str
    adapter: Adapter
    backend_model: str
    options: Any


class UnknownModel(LookupError):
    pass


class Router:
    def __init__(self, routes: dict[str, Route]) -> None:
        self._routes = routes

    @classmethod
    def from_settings(cls, settings: NodeSettings, source: str = "node config") -> Router:
        """Build the adapters named by ``settings.models``; config errors name the key."""
        by_adapter: dict[str, list[tuple[ModelConfig, Any]]] = {}
        for index, model in enumerate(settings.models):
            entry = ADAPTERS.get(model.adapter)
            if entry is None:
                raise ConfigError(
                    f"{source}: models[{index}].adapter: unknown adapter {model.adapter!r} "
                    f"(known: {', '.join(sorted(ADAPTERS))})"
                )
            options: Any = structure(model.options, entry.options_type, f"{source}: models[{index}].options")
            by_adapter.setdefault(model.adapter, []).append((model, options))
        unknown = set(settings.adapters) - set(ADAPTERS)
        if unknown:
            raise ConfigError(f"{source}: adapters: unknown adapter(s) {', '.join(sorted(unknown))}")
        routes: dict[str, Route] = {}
        for name, models in by_adapter.items():
            entry = ADAPTERS[name]
            config: Any = structure(settings.adapters.get(name, {}), entry.config_type, f"{source}: adapters.{name}")
            adapter = entry.factory(config, {model.name: options for model, options in models})
            for model, options in models:
                if model.name in routes:
                    raise ConfigError(f"{source}: models: {model.name!r} is listed twice")
                routes[model.name] = Route(model.name, adapter, model.backend_model or model.name, options)
        return cls(routes)

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(self._routes)

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return tuple(sorted({route.adapter.name for route in self._routes.values()}))

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
        for adapter in {id(r.adapter): r.adapter for r in self._routes.values()}.values():
            await adapter.aclose()
