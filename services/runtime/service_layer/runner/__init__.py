"""One agent's resident loop (`AgentRunner`) and what every runner shares."""

from services.runtime.service_layer.runner.loop import (
    STOPPED_DURING_RUN,
    AgentRunner,
    Directory,
    HistoryCache,
    LoopSettings,
    RunnerEnv,
)

__all__ = ["STOPPED_DURING_RUN", "AgentRunner", "Directory", "HistoryCache", "LoopSettings", "RunnerEnv"]
