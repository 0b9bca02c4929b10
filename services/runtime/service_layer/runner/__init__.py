"""One agent's resident loop, in parts by concern.

- `loop`: `AgentRunner`, the resident loop and the people's controls
  (start, stop, pause, resume, interrupt, terminate, one cycle);
- `run`: one run (begin, iterate completions and tool calls, end, settle its task);
- `inbox`: what the agent is asked (delivered messages, catching up, read marks);
- `context`: what the model is shown (window, fitting, summaries, recall, system prompt);
- `core`: the state they share and how steps are made and stored;
- `env`: what every runner shares (settings, directory, history cache).
"""

from services.runtime.service_layer.runner.env import (
    STOPPED_DURING_RUN,
    Directory,
    HistoryCache,
    LoopSettings,
    RunnerEnv,
)
from services.runtime.service_layer.runner.loop import AgentRunner

__all__ = ["STOPPED_DURING_RUN", "AgentRunner", "Directory", "HistoryCache", "LoopSettings", "RunnerEnv"]
